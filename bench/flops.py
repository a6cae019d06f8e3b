"""Work counted for throughput: FLOPs of attention and bytes read by decoding (docs/benchmark-method.md#what-is-counted)."""
from __future__ import annotations

import torch

#: Passes the runner knows, and how many forward-equivalents of work each counts.
PASS_FACTORS = {"fwd": 1.0, "fwd_bwd": 3.5, "decode": 1.0}


def attention_flops(B: int, H: int, Q_LEN: int, KV_LEN: int, D: int, Dv: int, density: float,
                    pass_: str) -> float:
    """Useful floating-point operations of one attention call, as counted in docs/benchmark-method.md.

    Forward is ``2·B·H·Q_LEN·KV_LEN·(D + Dv)·density`` (one multiply-add per element of Q·Kᵀ and
    of P·V), which is ``4·B·H·S²·D·density`` when Q_LEN = KV_LEN = S and Dv = D. Forward+backward
    counts 3.5 times the forward (the backward recomputes Q·Kᵀ and computes dV, dP, dQ, dK: 2.5×).
    Decode counts as a forward. Softmax, score_mod and mask work is not counted.

    Args:
        B: batch size. H: query heads (with GQA, the number of query heads, not KV heads).
        Q_LEN, KV_LEN: sequence lengths. D: query/key head dim. Dv: value head dim.
        density: fraction of BLOCK_SIZE×BLOCK_SIZE blocks the BlockMask computes (full + partial),
            in [0, 1]; 1 for no mask. See :func:`bench.flops.block_density`.
        pass_: ``"fwd"``, ``"fwd_bwd"`` or ``"decode"``.

    Returns:
        FLOPs as a float.

    Example:
        >>> attention_flops(4, 16, 4096, 4096, 128, 128, 1.0, "fwd") == 4 * 4 * 16 * 4096**2 * 128
        True
    """
    if pass_ not in PASS_FACTORS:
        raise ValueError(f"pass_={pass_!r} is not a pass; expected one of {sorted(PASS_FACTORS)}")
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density={density} must lie in [0, 1] (fraction of computed blocks)")
    for name, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("D", D), ("Dv", Dv)):
        if value < 0:
            raise ValueError(f"{name}={value} must be non-negative")
    return 2.0 * B * H * Q_LEN * KV_LEN * (D + Dv) * density * PASS_FACTORS[pass_]


def decode_bytes(B: int, KV_HEADS: int, KV_LEN: int, D: int, Dv: int, itemsize: int,
                 density: float = 1.0) -> float:
    """Bytes a decoding step must read: K and V once, ``B·KV_HEADS·KV_LEN·(D + Dv)·itemsize·density``.

    ``density`` (fraction of computed KV blocks) makes a sliding window count only the blocks it
    reads; it is 1 for no mask, which is the decode convention of docs/benchmark-method.md. Queries and outputs are
    negligible at query length 1 and not counted.
    """
    return float(B) * KV_HEADS * KV_LEN * (D + Dv) * itemsize * density


def block_density(block_mask) -> float:
    """Fraction of (query block, KV block) pairs a BlockMask computes, full and partial blocks together.

    Works on flexcore's and torch's BlockMask (same ``kv_num_blocks`` / ``full_kv_num_blocks``
    layout, (B, H, Q_BLOCKS) with B and H possibly 1 for broadcast).
    """
    b, h, q_blocks = block_mask.kv_num_blocks.shape
    q_len, kv_len = block_mask.seq_lengths
    bq, bkv = _block_sizes(block_mask)
    # Block tensors may be padded beyond the sequence: count only the blocks that cover it.
    q_blocks = min(q_blocks, -(-q_len // bq))
    kv_blocks = min(block_mask.kv_indices.shape[-1], -(-kv_len // bkv))
    counts = block_mask.kv_num_blocks[:, :, :q_blocks].to("cpu", torch.int64).sum()
    if getattr(block_mask, "full_kv_num_blocks", None) is not None:
        counts = counts + block_mask.full_kv_num_blocks[:, :, :q_blocks].to("cpu", torch.int64).sum()
    total = b * h * q_blocks * kv_blocks
    return min(1.0, float(counts) / total) if total else 0.0


def _block_sizes(block_mask) -> tuple[int, int]:
    size = block_mask.BLOCK_SIZE
    if isinstance(size, int):
        return size, size
    return int(size[0]), int(size[1])

