"""Comparison against the float64 reference, shared by the forward, decode and paged tests.

The tolerance is relative to torch's own error: the kernel's relative Frobenius error must stay
within twice that of the eager reference computed in the inputs' dtype, plus a small eps.
"""
from __future__ import annotations

import math
import zlib

import torch

from flexcore.reference import flex_attention_reference


def seed_of(*parts) -> int:
    """A stable seed per test case (str hashes change between processes)."""
    return zlib.crc32(repr(parts).encode())


def rel_err(out, golden) -> float:
    """Relative Frobenius error over finite golden entries; inf if finiteness differs."""
    out, golden = out.double(), golden.double()
    fin = torch.isfinite(golden)
    if not torch.equal(torch.isfinite(out), fin):
        return math.inf
    diff = (out[fin] - golden[fin]).norm()
    return (diff / golden[fin].norm().clamp_min(1e-30)).item()


def assert_matches_reference(q, k, v, score_mod, block_mask, out, lse, what: str, scale=None) -> None:
    """``out``/``lse`` of flex_attention(q, k, v, ..., scale=scale) against the float64 reference."""
    gqa = q.shape[1] != k.shape[1]
    gold, gold_lse = flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                              enable_gqa=gqa, return_lse=True, upcast=True)
    base = flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                    enable_gqa=gqa, upcast=False)
    assert out.dtype == q.dtype and out.shape == gold.shape, what
    assert not out.isnan().any(), what
    err, base_err = rel_err(out, gold), rel_err(base, gold)
    eps = 1e-6 if q.dtype == torch.float32 else 1e-3
    assert err <= 2 * base_err + eps, f"{what}: err {err:.3g} vs torch {base_err:.3g}"
    # lse: -inf exactly where the reference has it, close elsewhere.
    assert torch.equal(torch.isinf(lse), torch.isinf(gold_lse)), what
    fin = torch.isfinite(gold_lse)
    scale = max(1.0, gold_lse[fin].abs().max().item())
    assert (lse[fin].double() - gold_lse[fin]).abs().max() <= 1e-4 * scale, what
