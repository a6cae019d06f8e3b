"""Eager reference of :func:`flexcore.flex_attention`, with FlagAttention's ``upcast`` flag.

Scores are materialised a chunk of query rows at a time (at most ``_CHUNK_SCORES`` per chunk), so
long sequences fit in memory; under autograd each chunk is checkpointed, so the backward pass is
bounded the same way. Mods are evaluated with torch's per-element (vmap) semantics, after a check
that every index they take into a captured tensor is in range (as torch's eager path, which
raises IndexError; flexcore raises its subclass ModIndexError naming the tensor and the line).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from flexcore._types import ScoreMod
from flexcore._validate import check_block_mask, check_qkv
from flexcore.interop import coerce_block_mask
from flexcore.blockmask import EMPTY, FULL, BlockMask
from flexcore.blockmask import as_bool_mask as _as_bool_mask
from flexcore.blockmask import broadcast_result as _broadcast_result
from flexcore.blockmask import call_mod as _call_mod
from flexcore.blockmask import mod_kind as _mod_kind
from flexcore.blockmask import mod_location as _mod_location
from flexcore.blockmask import row_chunks as _row_chunks
from flexcore.errors import ModReturnError
from flexcore.fp8 import FP8_DTYPE, OUTPUT_DTYPE, check_fp8_inputs, dequantize
from flexcore.lowering import check_indices, per_element
from flexcore.masks import noop_mask
from flexcore.sinks import check_sinks

__all__ = ["flex_attention_reference"]

#: Most scores (B * Hq * rows * S) materialised at once.
_CHUNK_SCORES = 1 << 26


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, row0: int, score_mod, mask_mod, block_map,
                 block_size, scale: float, work_dtype: torch.dtype, out_dtype: torch.dtype,
                 lse_dtype: torch.dtype, sinks: Tensor | None = None,
                 probs_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Attention of query rows [row0, row0 + q.shape[2]) against all keys; fully masked rows give
    output 0 and lse -inf (or the sink's logit, with sinks). ``probs_dtype``: round the
    unnormalised probabilities exp(s - max) to it before @ V and divide after (the FP8 kernels' math)."""
    B, Hq, Lc, _ = q.shape
    S = k.shape[2]
    device = q.device
    b = torch.arange(B, device=device, dtype=torch.int32).view(-1, 1, 1, 1)
    h = torch.arange(Hq, device=device, dtype=torch.int32).view(1, -1, 1, 1)
    q_idx = torch.arange(row0, row0 + Lc, device=device, dtype=torch.int32).view(1, 1, -1, 1)
    kv_idx = torch.arange(S, device=device, dtype=torch.int32).view(1, 1, 1, -1)
    shape = (B, Hq, Lc, S)

    # GQA without repeating K/V: the G query heads of a KV head are folded into the rows of one
    # product, (B, Hkv, G * Lc, D) @ (B, Hkv, D, S).
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.to(work_dtype).reshape(B, Hkv, G * Lc, q.shape[-1])
    scores = (qg @ k.to(work_dtype).transpose(-2, -1)).view(shape) * scale
    if score_mod is not None:
        result = _call_mod(per_element(score_mod, "score"), (scores, b, h, q_idx, kv_idx), "score")
        if not isinstance(result, Tensor) or not result.is_floating_point():
            name, filename, lineno = _mod_location(score_mod)
            raise ModReturnError("score_mod must return a floating-point tensor; it returned "
                                 + (str(result.dtype) if isinstance(result, Tensor)
                                    else type(result).__name__),
                                 mod_name=name, filename=filename, lineno=lineno)
        scores = _broadcast_result(result.to(work_dtype), score_mod, shape, device)

    keep = None
    if block_map is not None:
        BQ, BK = block_size
        rows = block_map.index_select(2, (q_idx.view(-1) // BQ).long())
        kind = rows.index_select(3, (kv_idx.view(-1) // BK).long())  # (Bm, Hm, Lc, S)
        keep = kind == FULL
        partial = (kind != EMPTY) & ~keep
        if mask_mod is noop_mask:
            keep = keep | partial
        else:
            with torch.no_grad():
                mod_keep = _as_bool_mask(_call_mod(per_element(mask_mod, "mask"),
                                                   (b, h, q_idx, kv_idx), "mask"),
                                         mask_mod, shape, device)
            keep = keep | (partial & mod_keep)
    if keep is not None:
        scores = torch.where(keep, scores, torch.tensor(-math.inf, dtype=work_dtype, device=device))
    if sinks is not None:
        # A sink is one more column of the softmax, a score without a value: it takes its share
        # of each row's probability mass, and that share is dropped before @ V.
        sink_column = sinks.to(work_dtype).view(1, Hq, 1, 1).expand(B, Hq, Lc, 1)
        scores = torch.cat([scores, sink_column], dim=-1)

    # The row max is a constant shift (softmax and lse are invariant to it): detaching it keeps
    # gradients exact and avoids max's subgradient.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    has_keys = row_sum > 0
    safe_sum = torch.where(has_keys, row_sum, torch.ones_like(row_sum))
    if probs_dtype is not None:
        # FP8 (FlashAttention-3's math): exp(s - max) rounded to e4m3 for the product with V, the
        # row sum unrounded, the division after the product.
        probs = p[..., :S].to(probs_dtype).to(work_dtype).reshape(B, Hkv, G * Lc, S)
        out = ((probs @ v.to(work_dtype)).view(B, Hq, Lc, v.shape[-1]) / safe_sum).to(out_dtype)
    else:
        # As torch's eager math: normalised probabilities, cast to the output dtype, then @ V.
        probs = (p / safe_sum)[..., :S].to(out_dtype).reshape(B, Hkv, G * Lc, S)
        out = (probs @ v.to(out_dtype)).view(B, Hq, Lc, v.shape[-1])
    lse = torch.where(has_keys, row_max + torch.log(safe_sum),
                      torch.full_like(row_sum, -math.inf)).squeeze(-1)
    return out, lse.to(lse_dtype)


def flex_attention_reference(query: Tensor, key: Tensor, value: Tensor,
                             score_mod: ScoreMod | None = None, block_mask: BlockMask | None = None,
                             scale: float | None = None, enable_gqa: bool = False,
                             return_lse: bool = False, kernel_options=None, *,
                             upcast: bool = True, sinks: Tensor | None = None,
                             descale_q: Tensor | None = None, descale_k: Tensor | None = None,
                             descale_v: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Eager, differentiable flex_attention: softmax(score_mod(Q Kᵀ · scale), masked) V.

    A position is kept when its block is full, or partial and ``block_mask.mask_mod`` keeps it
    (exactly what the kernels compute); without a block_mask every position is kept. Fully masked
    rows give output 0 and lse -inf.

    Args:
        query: (B, Hq, L, D); key: (B, Hkv, S, D); value: (B, Hkv, S, Dv); key and value may
            have batch 1 (shared by every query batch).
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score``; ``h`` is the query head.
        block_mask: a :class:`BlockMask` covering (L, S), with B and H of 1 or the inputs'.
        scale: default 1/sqrt(D).
        enable_gqa: allow Hq to be a multiple of Hkv (query head h reads key/value head h // (Hq/Hkv)).
        return_lse: also return the natural-log logsumexp of the kept scores, (B, Hq, L).
        kernel_options: accepted for signature compatibility and ignored.
        upcast: True computes and returns float64 (the golden); False mirrors torch's eager math in
            the input dtype (scores and softmax in float32, probabilities cast to the input dtype
            before @ V), to measure torch's own error.
        sinks: (Hq,) attention-sink logits, one per query head: each joins its rows' softmax as
            one more score without a value (and the lse includes it); differentiable.
        descale_q, descale_k, descale_v: the descale factors of float8_e4m3fn q, k, v (as
            flex_attention takes them): the inputs are the descaled values ``x_fp8 · descale``,
            computed in float64 with upcast (so the error against it is a kernel's own rounding);
            without upcast in float32 with FP8 kernels' math (exp(s - max) rounded to e4m3 before
            @ V, the sum unrounded), a bfloat16 output and float32 lse.

    Returns:
        out (B, Hq, L, Dv), float64 if upcast else the input dtype (bfloat16 for float8 inputs);
        with return_lse also lse, float64 if upcast else float32.

    Example:
        >>> golden = flex_attention_reference(q, k, v, block_mask=bm)          # float64
        >>> torch_err = flex_attention_reference(q, k, v, block_mask=bm, upcast=False)
    """
    descales = check_fp8_inputs(query, key, value, descale_q, descale_k, descale_v, device_check=False)
    check_qkv(query, key, value, enable_gqa, dtypes=None, rows_may_be_empty=True)
    if sinks is not None:
        check_sinks(sinks, query)
    B, Hq, L, D = query.shape
    S = key.shape[2]
    if score_mod is not None:
        _mod_kind(score_mod, "flex_attention_reference", allowed=("score",), arg="score_mod")
    block_map = mask_mod = None
    block_mask = coerce_block_mask(block_mask)  # a torch BlockMask, as flex_attention takes it
    if block_mask is not None:
        check_block_mask(block_mask, B, Hq, L, S, query.device)
        block_map = block_mask.block_map()
        mask_mod = block_mask.mask_mod
        if mask_mod is not noop_mask:
            _mod_kind(mask_mod, "flex_attention_reference", arg="block_mask.mask_mod")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if score_mod is not None:
        check_indices(score_mod, "score", B, Hq, L, S, runtime=True)
    if mask_mod is not None and mask_mod is not noop_mask:
        check_indices(mask_mod, "mask", B, Hq, L, S, runtime=True)

    probs_dtype = None
    if upcast:
        work_dtype = out_dtype = lse_dtype = torch.float64
    else:
        work_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        out_dtype, lse_dtype = query.dtype, torch.float32
    if key.shape[0] != B:
        key, value = key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1)
    if descales is not None:
        query, key, value = (dequantize(t, d, work_dtype) for t, d in
                             ((query, descales.q), (key, descales.k), (value, descales.v)))
        if not upcast:
            out_dtype, probs_dtype = OUTPUT_DTYPE, FP8_DTYPE

    def chunk(q_rows: Tensor, row0: int, k: Tensor, v: Tensor):
        return _attend_rows(q_rows, k, v, row0, score_mod, mask_mod, block_map,
                            block_mask.BLOCK_SIZE if block_mask is not None else None, scale,
                            work_dtype, out_dtype, lse_dtype, sinks, probs_dtype)

    rows_list = list(_row_chunks(L, B * Hq * S, _CHUNK_SCORES)) or [slice(0, 0)]  # L == 0: one empty chunk
    # Checkpointing bounds the memory autograd keeps to one chunk of scores at a time; it re-runs
    # the mods in backward, which is harmless since they are pure.
    use_checkpoint = len(rows_list) > 1 and torch.is_grad_enabled()
    outs, lses = [], []
    for rows in rows_list:
        q_rows = query[:, :, rows]
        if use_checkpoint:
            out, lse = checkpoint(chunk, q_rows, rows.start, key, value, use_reentrant=False)
        else:
            out, lse = chunk(q_rows, rows.start, key, value)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    if not return_lse:
        return out
    return out, (lses[0] if len(lses) == 1 else torch.cat(lses, dim=2))
