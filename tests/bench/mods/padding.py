"""Per-batch key padding (depends on b), as a user's mod file with a make(...) factory."""
import torch


def make(B, KV_LEN, device):
    lengths = torch.tensor([KV_LEN - 3 * b - 1 for b in range(B)], device=device)

    def padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return None, padding
