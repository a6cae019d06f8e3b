"""Causal mask, as a user's mod file (module-level mask_mod)."""


def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
