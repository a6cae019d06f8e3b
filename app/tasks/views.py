"""Pictures of the mods (run in the worker): mask, block map, scores, attention probabilities.

Every view is plain data (numpy arrays and numbers). Masks larger than :data:`MAX_PIXELS` a side are
pooled, a slab of rows at a time, so a 64k-token mask never exists in memory as a whole.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from app.tasks.mods import code_shape, device, mods_for, namespace_for, time_limit
from app.usercode import code_shape_mismatch
from bench.flops import attention_flops, block_density
from flexcore import create_block_mask, create_mask, noop_mask
from flexcore.lowering import evaluate_mods, lower_mask_mod, lower_score_mod

#: Largest side of a heatmap; larger masks are pooled down to it.
MAX_PIXELS = 256
#: Largest B*H*Q_LEN*KV_LEN evaluated densely when checking the code (index errors in captured
#: tensors show up there rather than in a kernel).
PROBE_ELEMENTS = 1 << 24
#: Positions evaluated at once when drawing a long mask (bounded memory at any sequence length).
CHUNK_POSITIONS = 1 << 24


def prepare(code: str, shape: dict, seed: int) -> dict:
    """Run, lower and probe the code once; what the views and the Triton code tab need.

    Returns:
        ``{"ok": True, "tensors", "score_source", "mask_source", "mismatch"}``; problems raise
        (:class:`app.usercode.UserCodeError`, :class:`app.tasks.mods.CodeTimeout`).
    """
    mods = mods_for(code, shape, seed)
    out = {"ok": True, "tensors": sorted(mods.captured),
           "mismatch": code_shape_mismatch(namespace_for(code, shape, seed), shape)}
    with time_limit(code):
        if mods.score_mod is not None:
            out["score_source"] = lower_score_mod(mods.score_mod).source
        if mods.mask_mod is not None:
            out["mask_source"] = lower_mask_mod(mods.mask_mod).source
        B, H, L, S = shape["B"], shape["Hq"], shape["Q_LEN"], shape["KV_LEN"]
        if B * H * L * S <= PROBE_ELEMENTS:
            # Over every index once, on the worker's device: an out-of-range read of a captured
            # tensor is reported here, with the user's line.
            for fn in (mods.mask_mod, mods.score_mod):
                if fn is not None:
                    create_mask(fn, B, H, L, S, device=device())
    return out


def slice_mod(fn: Callable, b0: int, h0: int, score: bool, q0: int = 0) -> Callable:
    """``fn`` seen from one (b, h) and a row offset: index 0 means ``(b0, h0, q0)``."""
    if score:
        def sliced(s, b, h, q_idx, kv_idx):
            return fn(s, b + b0, h + h0, q_idx + q0, kv_idx)
    else:
        def sliced(b, h, q_idx, kv_idx):
            return fn(b + b0, h + h0, q_idx + q0, kv_idx)
    sliced.__name__ = getattr(fn, "__name__", "mod")
    return sliced


def pool_factors(rows: int, cols: int, max_side: int = MAX_PIXELS) -> tuple[int, int]:
    return max(1, math.ceil(rows / max_side)), max(1, math.ceil(cols / max_side))


def pool_sums(array, rs: int, cs: int):
    """Sums over rs x cs tiles of a 2-D array (ragged edges padded with zeros)."""
    rows, cols = array.shape
    padded = np.pad(array.astype(np.float64), ((0, (-rows) % rs), (0, (-cols) % cs)))
    return padded.reshape(padded.shape[0] // rs, rs, padded.shape[1] // cs, cs).sum(axis=(1, 3))


def pool(array, max_side: int = MAX_PIXELS):
    """Average-pool a 2-D array so neither side exceeds ``max_side``; returns (array, (rs, cs))."""
    rs, cs = pool_factors(*array.shape, max_side)
    if (rs, cs) == (1, 1):
        return array.astype(np.float32), (1, 1)
    sums = pool_sums(np.nan_to_num(array), rs, cs)
    counts = pool_sums(np.ones(array.shape), rs, cs)
    return (sums / np.maximum(counts, 1)).astype(np.float32), (rs, cs)


def pooled_rows(evaluate: Callable, L: int, S: int) -> dict:
    """Evaluate a (rows, S) slab at a time and pool it, so long sequences never materialise L x S.

    ``evaluate(q0, rows) -> (kept bool array, values float array or None)``.

    Returns:
        ``{"kept": exact kept count, "frac": pooled fraction kept, "mean": pooled mean of the
        values over kept positions (or None), "pool": (rs, cs)}``.
    """
    rs, cs = pool_factors(L, S)
    step = max(rs, (CHUNK_POSITIONS // max(S, 1)) // rs * rs)
    kept_sum, frac, mean = 0, [], []
    for q0 in range(0, L, step):
        rows = min(step, L - q0)
        keep, values = evaluate(q0, rows)
        kept_sum += int(keep.sum())
        k = pool_sums(keep, rs, cs)
        n = pool_sums(np.ones(keep.shape), rs, cs)
        frac.append(k / np.maximum(n, 1))
        if values is not None:
            v = pool_sums(np.where(keep, values, 0.0), rs, cs)
            mean.append(np.where(k > 0, v / np.maximum(k, 1), np.nan))
    return {"kept": kept_sum, "frac": np.concatenate(frac).astype(np.float32),
            "mean": np.concatenate(mean).astype(np.float32) if mean else None, "pool": (rs, cs)}


def mask_pooled(mask_mod: Callable | None, b: int, h: int, L: int, S: int) -> dict:
    """Pooled token-level mask of head (b, h), with the exact number of kept positions."""
    if mask_mod is None:
        return pooled_rows(lambda q0, rows: (np.ones((rows, S), dtype=bool), None), L, S)

    def evaluate(q0, rows):
        dense = create_mask(slice_mod(mask_mod, b, h, False, q0), 1, 1, rows, S, device=device())[0, 0]
        return dense.cpu().numpy(), None

    return pooled_rows(evaluate, L, S)


def mask_view_of(mods, L: int, S: int, b: int, h: int) -> dict:
    pooled = mask_pooled(mods.mask_mod, b, h, L, S)
    return {"pooled": pooled["frac"], "pool": pooled["pool"], "kept": pooled["kept"],
            "total": L * S, "has_mask": mods.mask_mod is not None}


def mask_view(code: str, shape: dict, seed: int, b: int, h: int) -> dict:
    """The token-level mask of head (b, h): pooled for display, with exact counts."""
    return mask_view_of(mods_for(code, shape, seed), shape["Q_LEN"], shape["KV_LEN"], b, h)


def block_mask_of(mods, shape: dict):
    """The BlockMask of the mods' mask at this shape (every block full without a mask_mod)."""
    return create_block_mask(mods.mask_mod or noop_mask, shape["B"], shape["Hq"], shape["Q_LEN"],
                             shape["KV_LEN"], device=device(), BLOCK_SIZE=shape["BLOCK_SIZE"])


def block_view_of(bm, shape: dict, b: int, h: int) -> dict:
    """Block map of head (b, h) (0 empty, 1 partial, 2 full), counts, sparsity and FLOPs saved."""
    block_map = bm.block_map()
    bb, hh = min(b, block_map.shape[0] - 1), min(h, block_map.shape[1] - 1)
    counts = bm.counts()
    density = block_density(bm)
    args = (shape["B"], shape["Hq"], shape["Q_LEN"], shape["KV_LEN"], shape["D"], shape["D"])
    return {"map": block_map[bb, hh].cpu().numpy(), "full": counts.full, "partial": counts.partial,
            "empty": counts.empty, "sparsity": bm.sparsity(), "block_size": tuple(bm.BLOCK_SIZE),
            "density": density, "flops_dense": attention_flops(*args, 1.0, "fwd"),
            "flops_sparse": attention_flops(*args, density, "fwd")}


def block_view(code: str, shape: dict, seed: int, b: int, h: int) -> dict:
    mods = mods_for(code, shape, seed)
    return block_view_of(block_mask_of(mods, shape), shape, b, h)


def _scores(mods, b: int, h: int, L: int, S: int, score_of: Callable):
    """Post-score_mod scores of (b, h), pooled, evaluated through the generated Triton code;
    ``score_of(q0, rows)`` gives the scores fed to the score_mod (float32, (1, 1, rows, S))."""
    bounds = [np.inf, -np.inf]

    def evaluate(q0, rows):
        score_mod = slice_mod(mods.score_mod, b, h, True, q0) if mods.score_mod else None
        mask_mod = slice_mod(mods.mask_mod, b, h, False, q0) if mods.mask_mod else None
        scores, mask = evaluate_mods(score_mod, mask_mod, 1, 1, rows, S, device=device(),
                                     score=score_of(q0, rows))
        keep, values = mask[0, 0].cpu().numpy(), scores[0, 0].cpu().numpy()
        if keep.any():
            bounds[0] = min(bounds[0], float(values[keep].min()))
            bounds[1] = max(bounds[1], float(values[keep].max()))
        return keep, values

    pooled = pooled_rows(evaluate, L, S)
    finite = bool(np.isfinite(bounds).all())
    return {"pooled": pooled["mean"], "pool": pooled["pool"],
            "min": bounds[0] if finite else float("nan"), "max": bounds[1] if finite else float("nan"),
            "has_score_mod": mods.score_mod is not None}


def score_view(code: str, shape: dict, seed: int, b: int, h: int, zero_scores: bool) -> dict:
    """Scores after the score_mod for (b, h), masked positions NaN: on zero input scores (the
    score_mod's bias) or on seeded standard-normal ones."""
    mods = mods_for(code, shape, seed)
    L, S = shape["Q_LEN"], shape["KV_LEN"]
    generator = torch.Generator().manual_seed(seed)

    def score_of(q0, rows):
        if zero_scores:
            return torch.zeros(1, 1, rows, S)
        return torch.randn(1, 1, rows, S, generator=generator)

    return _scores(mods, b, h, L, S, score_of)


#: Largest Q_LEN * KV_LEN whose attention probabilities are computed (one (b, h), in float64 on
#: the host: a few arrays of this size).
PROBS_ELEMENTS = 1 << 24


def probs_view(code: str, shape: dict, seed: int, b: int, h: int) -> dict:
    """Attention probabilities of (b, h) after softmax, on seeded random q and k.

    ``softmax_kv(score_mod(q·kᵀ / sqrt(D)))`` over the kept keys, with q and k drawn as the Check
    draws them (standard normal, this seed); rows with no kept key are blank.
    """
    mods = mods_for(code, shape, seed)
    L, S, D = shape["Q_LEN"], shape["KV_LEN"], shape["D"]
    if L * S > PROBS_ELEMENTS:
        raise ValueError(f"Q_LEN·KV_LEN = {L * S:,} is too large for the probability heatmap "
                         f"(at most {PROBS_ELEMENTS:,}); use a smaller shape.")
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(L, D, generator=generator, dtype=torch.float64)
    k = torch.randn(S, D, generator=generator, dtype=torch.float64)
    qk = (q @ k.T / math.sqrt(D)).to(torch.float32)
    scores, mask = evaluate_mods(
        slice_mod(mods.score_mod, b, h, True) if mods.score_mod else None,
        slice_mod(mods.mask_mod, b, h, False) if mods.mask_mod else None,
        1, 1, L, S, device=device(), score=qk.view(1, 1, L, S))
    s = scores[0, 0].double().cpu()
    keep = mask[0, 0].cpu()
    s = torch.where(keep, s, torch.tensor(-math.inf, dtype=torch.float64))
    row_max = s.amax(dim=1, keepdim=True)
    e = torch.where(keep, torch.exp(s - torch.where(torch.isfinite(row_max), row_max, 0.0)), 0.0)
    total = e.sum(dim=1, keepdim=True)
    p = (e / torch.where(total > 0, total, 1.0)).numpy()
    kept = keep.numpy()
    rs, cs = pool_factors(L, S)
    # Mean probability over the kept positions each pixel covers; NaN (blank) where none is kept.
    n = pool_sums(kept, rs, cs)
    pooled = np.where(n > 0, pool_sums(np.where(kept, p, 0.0), rs, cs) / np.maximum(n, 1), np.nan)
    return {"pooled": pooled.astype(np.float32), "pool": (rs, cs),
            "max": float(p[kept].max()) if kept.any() else 0.0,
            "min": float(p[kept].min()) if kept.any() else 0.0,
            "empty_rows": int((~keep.any(dim=1)).sum())}


# ---- the gallery ------------------------------------------------------------------------------

def gallery_view(name: str, params: dict, q_len: int, heads: int, h: int, block_size: int) -> dict:
    """Mask, block map and (for score mods) the bias of a registered variant, for head ``h``."""
    import variants

    v = variants.get(name)
    kv_len = v.default_kv_len(q_len, **params)
    mods = v.make(B=1, H=heads, Q_LEN=q_len, KV_LEN=int(kv_len), device=device(), **params)
    L, S = mods.shape.Q_LEN, mods.shape.KV_LEN
    pooled_mask = mask_pooled(mods.mask_mod, 0, h, L, S)
    bm = mods.create_block_mask(BLOCK_SIZE=block_size)
    block_map = bm.block_map()
    hh = min(h, block_map.shape[1] - 1)
    counts = bm.counts()
    view = {"mask": {"pooled": pooled_mask["frac"], "pool": pooled_mask["pool"],
                     "kept": pooled_mask["kept"], "total": L * S,
                     "has_mask": mods.mask_mod is not None},
            "blocks": {"map": block_map[0, hh].cpu().numpy(), "full": counts.full,
                       "partial": counts.partial, "empty": counts.empty,
                       "sparsity": bm.sparsity(), "block_size": tuple(bm.BLOCK_SIZE)},
            "Q_LEN": L, "KV_LEN": S, "captured": sorted(mods.captured), "scores": None}
    if mods.score_mod is not None:
        view["scores"] = _scores(mods, 0, h, L, S, lambda q0, rows: torch.zeros(1, 1, rows, S))
    return view


__all__ = ["prepare", "mask_view", "block_view", "score_view", "probs_view", "gallery_view",
           "code_shape"]
