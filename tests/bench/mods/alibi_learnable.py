"""ALiBi with learnable slopes, as a user's mod file with a make(...) factory."""
import torch


def make(H, device):
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H).to(device)
    slopes.requires_grad_(True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    return alibi, None
