"""Shared helpers of the variant tests: the settings every variant is tested at, and an
independent dense evaluation of mods."""
from __future__ import annotations

import torch

import variants

#: Odd lengths on purpose: neither is a multiple of the 32-wide blocks and tiles used below, so
#: every variant meets a ragged last block.
DEFAULT_Q_LEN = 97
EXAMPLE_Q_LEN = 131
#: Two heads so that per-head tensors are indexed by h; a second batch element only where the
#: variant differs across the batch (the interpreter's cost grows with B * H).
HEADS = 2
SETTINGS = ("default", "example")
CASES = [(name, setting) for name in variants.names() for setting in SETTINGS]
SCORE_CASES = [(name, setting) for name, setting in CASES
               if variants.get(name).kind in ("score", "both")]


def case_params(name: str, setting: str) -> dict:
    return {} if setting == "default" else dict(variants.get(name).example)


def case_q_len(setting: str) -> int:
    return DEFAULT_Q_LEN if setting == "default" else EXAMPLE_Q_LEN


def make_case(name: str, setting: str) -> variants.Mods:
    """The variant's mods at its default (Q_LEN 97) or example (Q_LEN 131) setting."""
    variant = variants.get(name)
    return variant.make(B=2 if variant.batch_dependent else 1, H=HEADS,
                        Q_LEN=case_q_len(setting), **case_params(name, setting))


def index_grid(B: int, H: int, Q_LEN: int, KV_LEN: int):
    """Broadcast int32 index tensors b (B,1,1,1), h (1,H,1,1), q (1,1,Q,1), kv (1,1,1,KV)."""
    return (torch.arange(B, dtype=torch.int32).view(B, 1, 1, 1),
            torch.arange(H, dtype=torch.int32).view(1, H, 1, 1),
            torch.arange(Q_LEN, dtype=torch.int32).view(1, 1, Q_LEN, 1),
            torch.arange(KV_LEN, dtype=torch.int32).view(1, 1, 1, KV_LEN))


def dense_mask(mask_mod, B: int, H: int, Q_LEN: int, KV_LEN: int) -> torch.Tensor:
    """``mask_mod`` on the whole (B, H, Q_LEN, KV_LEN) grid in one broadcast call."""
    if mask_mod is None:
        return torch.ones(B, H, Q_LEN, KV_LEN, dtype=torch.bool)
    with torch.no_grad():
        out = mask_mod(*index_grid(B, H, Q_LEN, KV_LEN))
    assert out.dtype == torch.bool, f"{mask_mod.__name__} returned {out.dtype}, expected bool"
    return out.expand(B, H, Q_LEN, KV_LEN)


def dense_scores(score_mod, scores: torch.Tensor) -> torch.Tensor:
    """``score_mod`` applied to a (B, H, Q_LEN, KV_LEN) score tensor in one broadcast call."""
    B, H, Q_LEN, KV_LEN = scores.shape
    with torch.no_grad():
        return score_mod(scores, *index_grid(B, H, Q_LEN, KV_LEN)).expand_as(scores)
