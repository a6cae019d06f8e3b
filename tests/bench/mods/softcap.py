"""Tanh soft-capping at 20: not an additive bias, so SDPA cannot express it."""
import torch


def score_mod(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)
