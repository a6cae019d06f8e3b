"""The code the Playground starts with."""

TEMPLATE = '''\
# A score_mod and/or a mask_mod in plain PyTorch.
# Tensors they read are captured (created on `device`
# unless you name another). B, H (query heads), HKV,
# Q_LEN, KV_LEN, D and device come from the controls.
import torch

WINDOW = 48
# ALiBi slopes, one per query head; requires_grad makes
# Gradients compare d(slopes) too.
heads = torch.arange(1, H + 1, device=device)
slopes = torch.exp2(-8.0 * heads / H).requires_grad_()


def score_mod(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx).abs()


def mask_mod(b, h, q_idx, kv_idx):
    causal = q_idx >= kv_idx
    in_window = q_idx - kv_idx < WINDOW
    return causal & in_window
'''
