"""flex_attention: torch.nn.attention.flex_attention's API on flexlab's own Triton kernels."""
from __future__ import annotations

import collections
import functools
import math
import weakref

import torch
from torch import Tensor

from flexcore._runtime import prepare_triton, use_interpreter
from flexcore._types import ScoreMod
from flexcore._validate import check_block_mask, check_qkv
from flexcore.errors import InputError
from flexcore.options import KernelOptions


def validate_inputs(query, key, value, block_mask, scale, enable_gqa) -> None:
    """Raise InputError naming the argument when the inputs cannot be attended by the kernels."""
    check_qkv(query, key, value, enable_gqa)
    D, Dv = query.shape[-1], value.shape[-1]
    if max(D, Dv) > 256:
        raise InputError(f"head dims up to 256 are supported; got D={D}, Dv={Dv}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise InputError(f"scale must be a float or None, got {type(scale).__name__}")
    if block_mask is not None:
        check_block_mask(block_mask, query.shape[0], query.shape[1], query.shape[2], key.shape[2],
                         query.device)
    if query.device.type != "cuda" and not use_interpreter():
        raise InputError(f"flexcore's kernels run on CUDA tensors on this machine; query is on "
                         f"{query.device}. Move the inputs with .cuda(), or use flexcore.reference")


@functools.lru_cache(maxsize=64)
def _full_block_mask(L: int, S: int, device: torch.device):
    """The all-full BlockMask of an (L, S) problem, broadcast over batch and heads."""
    from flexcore.blockmask import create_block_mask
    from flexcore.masks import noop_mask

    return create_block_mask(noop_mask, None, None, L, S, device=device)


# BlockTensors views of the last few masks, by (id(mask), B, Hq, kind); see _mask_views.
_views_cache: collections.OrderedDict = collections.OrderedDict()
# Per BlockMask, the forward's launch orders (BlockTensors.schedule): they live as long as the mask,
# as its own tables do, so that a captured CUDA graph that reads one never outlives it.
_schedules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mask_views(block_mask, B, Hq, kind, build, stamp=None):
    """``build()`` remembered for the last few masks (a training or decoding loop calls with the
    same mask at every step): entries hold the mask weakly and leave with it, so the cache never
    keeps tables alive. ``stamp``: a value that must be unchanged for an entry to be reused."""
    key = (id(block_mask), B, Hq, kind)
    hit = _views_cache.get(key)
    if hit is not None and hit[0]() is block_mask and hit[1] == stamp:
        return hit[2]
    try:
        ref = weakref.ref(block_mask)
    except TypeError:  # not weak-referenceable: do not remember it
        return build()
    views = build()
    if hit is None:
        weakref.finalize(block_mask, _views_cache.pop, key, None)
    _views_cache[key] = (ref, stamp, views)
    _views_cache.move_to_end(key)
    while len(_views_cache) > 32:
        _views_cache.popitem(last=False)
    return views


def _kv_blocks(block_mask, B, Hq):
    """The BlockMask's key-block tables viewed as (B, Hq, ...) (the views share its storage)."""
    from flexcore.kernels.forward import BlockTensors

    def build():
        try:
            orders = _schedules.setdefault(block_mask, {})
        except TypeError:  # not weak-referenceable: its orders live with these views
            orders = None
        try:
            refine = functools.partial(_refine_kv, weakref.ref(block_mask), B, Hq)
        except TypeError:  # not weak-referenceable: no finer tables (they would keep it alive)
            refine = None
        return BlockTensors.expanded(block_mask.kv_num_blocks, block_mask.kv_indices,
                                     block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                     block_mask.BLOCK_SIZE, B, Hq, orders, refine)

    return _mask_views(block_mask, B, Hq, "kv", build)


def _refine_kv(mask_ref, B, Hq, captured, compute: bool):
    """``BlockTensors.refine`` of a mask's key-block tables (flexcore.kernels.forward.finer_tables):
    the tables over REFINE_BLOCK-sized blocks and their transpose, expanded to (B, Hq, ...), and
    their cost relative to the mask's own; None where the mask has none (see flexcore.blockmask.refine_block_map). Kept with
    the mask while the mask_mod's captured tensors are unmodified (their version counters); with
    ``compute`` False only a kept answer is given (inside a CUDA graph capture)."""
    block_mask = mask_ref()
    if block_mask is None:
        return None
    from flexcore.kernels.forward import versions

    stamp = versions(captured)
    hit = _views_cache.get((id(block_mask), B, Hq, "kv_fine"))
    if hit is not None and hit[0]() is block_mask and hit[1] == stamp:
        return hit[2]
    if not compute:
        return None
    return _mask_views(block_mask, B, Hq, "kv_fine", lambda: _finer_tables(block_mask, B, Hq), stamp)


def _finer_tables(block_mask, B, Hq):
    from flexcore.blockmask import BlockMask, refine_block_map
    from flexcore.kernels.backward import q_block_tensors
    from flexcore.kernels.forward import REFINE_BLOCK, BlockTensors

    size = (REFINE_BLOCK, REFINE_BLOCK)
    fine = refine_block_map(block_mask, size)
    if fine is None:
        return None
    finer = BlockMask._from_block_map(fine, size, block_mask.seq_lengths, block_mask.mask_mod)
    kv_fine = BlockTensors.expanded(finer.kv_num_blocks, finer.kv_indices, finer.full_kv_num_blocks,
                                    finer.full_kv_indices, size, B, Hq)
    own = _kv_blocks(block_mask, B, Hq)
    bq, bkv = block_mask.BLOCK_SIZE
    per_block = (bq // REFINE_BLOCK) * (bkv // REFINE_BLOCK)  # finer blocks per block of the mask
    costs = torch.stack([own.row_cost(own.num_blocks.shape[-1]).sum() * per_block,
                         kv_fine.row_cost(kv_fine.num_blocks.shape[-1]).sum()])
    coarse, cost = costs.tolist()  # one read-back per mask
    return kv_fine, q_block_tensors(finer, B, Hq), (cost / coarse if coarse else 1.0)


def _q_blocks(block_mask, B, Hq):
    """The backward's transposed tables (``flexcore.kernels.backward.q_block_tensors``). A mask
    built without them (``compute_q_blocks=False``) has them computed once, not at every backward;
    that transpose is reused while the key-block tables are unmodified (their version counters)."""
    from flexcore.kernels.backward import q_block_tensors

    stamp = None
    if block_mask.q_indices is None:
        stamp = tuple(None if t is None else (id(t), t._version)
                      for t in (block_mask.kv_num_blocks, block_mask.kv_indices,
                                block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    return _mask_views(block_mask, B, Hq, "q", lambda: q_block_tensors(block_mask, B, Hq), stamp)


def _decodes(query, opts) -> bool:
    """Whether the decode kernel runs the forward (short queries), rather than the forward kernel."""
    from flexcore.kernels.decode import use_decode_kernel

    return query.dtype != torch.float64 and use_decode_kernel(query.shape[2], opts)


def _prefetch_stats(block_mask, blocks, query, key, value, score_lowered, opts) -> None:
    """Before a forward that autograd will differentiate: read back the transposed tables'
    statistics that the backward will ask for together with the key-block tables' ones that the
    forward asks for (one wait on the GPU per new mask instead of two; nothing when both are known)."""
    from flexcore.kernels.backward import uses_runs
    from flexcore.kernels.forward import gather_stats, pad_head_dim

    if _decodes(query, opts):
        return
    head_dim_pad = max(pad_head_dim(query.shape[-1]), pad_head_dim(value.shape[-1]))
    if not uses_runs(head_dim_pad, score_lowered.is_trivial):
        return
    B, Hq, L = query.shape[:3]
    sparse_q, sparse_kv = blocks.sparse_block
    gather_stats([(blocks, math.ceil(L / sparse_q)),
                  (_q_blocks(block_mask, B, Hq), math.ceil(key.shape[2] / sparse_kv))])


def _run_kernels(query, key, value, score_lowered, mask_lowered, blocks, scale, opts):
    """(out, lse, row_stats) of the forward or the decode kernel; row_stats is None from decode."""
    from flexcore.kernels.decode import decode
    from flexcore.kernels.forward import forward

    if _decodes(query, opts):
        out, lse = decode(query, key, value, score_lowered, mask_lowered, blocks, scale, opts)
        return out, lse, None
    B = query.shape[0]
    # A shared (batch 1) cache is read through stride-0 views.
    return forward(query, key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1),
                   score_lowered, mask_lowered, blocks, scale, opts)


class _FlexAttention(torch.autograd.Function):
    """Forward (or decode) kernel; fused backward kernels. Captured tensors of the score_mod are
    inputs of ``apply`` so that autograd routes their gradients."""

    @staticmethod
    def forward(ctx, query, key, value, score_lowered, mask_lowered, blocks, scale, opts,
                block_mask, score_mod, *captured):
        out, lse, row_stats = _run_kernels(query, key, value, score_lowered, mask_lowered, blocks,
                                           scale, opts)
        # The decode kernel keeps only lse: the backward derives the row statistics from it.
        ctx.save_for_backward(query, key, value, out, lse if row_stats is None else row_stats)
        ctx.stats_from_lse = row_stats is None
        ctx.bwd = (score_lowered, mask_lowered, blocks, scale, opts, block_mask, score_mod)
        ctx.mark_non_differentiable(lse)
        # lse has no gradient: autograd need not fill a zero tensor for it at every backward. The
        # backward then takes None for an undefined gradient of out too (gradcheck sends one).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        from flexcore.kernels.backward import backward
        from flexcore.kernels.forward import row_stats_from_lse
        from flexcore.lowering.vjp import lower_score_mod_backward

        query, key, value, out, row_stats = ctx.saved_tensors
        if grad_out is None:  # an undefined gradient (not materialised, see forward): none flows back
            return (None,) * (10 + len(ctx.bwd[0].captured))
        if ctx.stats_from_lse:
            row_stats = row_stats_from_lse(row_stats)
        score_lowered, mask_lowered, blocks, scale, opts, block_mask, score_mod = ctx.bwd
        B, Hq = query.shape[:2]
        dq, dk, dv, captured_grads = backward(
            query, key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1), out, row_stats, grad_out,
            score_lowered, lower_score_mod_backward(score_mod, score_lowered, query.dtype if query.dtype == torch.float64 else torch.float32),
            mask_lowered,
            blocks, _q_blocks(block_mask, B, Hq), scale, opts)
        if key.shape[0] != B:  # a shared batch-1 cache: its gradient sums over the batch
            dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
        return (dq, dk, dv, None, None, None, None, None, None, None, *captured_grads)


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: ScoreMod | None = None,
                   block_mask=None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options=None):
    """Attention with a user score_mod and a block-sparse mask, in one fused Triton kernel.

    Same signature and semantics as ``torch.nn.attention.flex_attention.flex_attention``.

    Args:
        query: (B, Hq, L, D); key: (B, Hkv, S, D); value: (B, Hkv, S, Dv). float16, bfloat16 or float32.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to every computed score.
        block_mask: a :class:`flexcore.BlockMask`; None attends everywhere.
        scale: multiplies q·k; default ``1/sqrt(D)``.
        enable_gqa: allow Hq to be a multiple of Hkv (grouped-query attention).
        return_lse: also return the log-sum-exp of the scores, (B, Hq, L) float32.
        kernel_options: a :class:`flexcore.KernelOptions` or a dict of its fields.

    Returns:
        out (B, Hq, L, Dv) in the inputs' dtype, and lse if ``return_lse``.

    Example:
        >>> def alibi(score, b, h, q_idx, kv_idx):
        ...     return score - slopes[h] * (q_idx - kv_idx).abs()
        >>> out = flex_attention(q, k, v, score_mod=alibi, block_mask=causal_mask)
    """
    from flexcore.lowering import lower_mask_mod, lower_score_mod

    prepare_triton()  # before anything imports triton's jit machinery on an interpreter machine
    validate_inputs(query, key, value, block_mask, scale, enable_gqa)
    opts = KernelOptions.from_any(kernel_options)
    if score_mod is not None and not callable(score_mod):
        raise InputError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, "
                         f"got {type(score_mod).__name__}")
    B, Hq, L, D = query.shape
    S = key.shape[2]
    if block_mask is None:
        block_mask = _full_block_mask(L, S, query.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    score_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    # 16-bit inputs round scores far more coarsely than approximate transcendentals err.
    score_lowered = lower_score_mod(score_mod, score_dtype,
                                    fast_math=query.dtype in (torch.float16, torch.bfloat16))
    mask_lowered = lower_mask_mod(block_mask.mask_mod)
    blocks = _kv_blocks(block_mask, B, Hq)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or any(t.requires_grad for t in score_lowered.captured)):
        _prefetch_stats(block_mask, blocks, query, key, value, score_lowered, opts)
        out, lse = _FlexAttention.apply(query, key, value, score_lowered, mask_lowered, blocks, scale,
                                        opts, block_mask, score_mod, *score_lowered.captured)
    else:  # inference (decoding steps above all): no autograd node, no saved tensors
        out, lse, _ = _run_kernels(query, key, value, score_lowered, mask_lowered, blocks, scale, opts)
    return (out, lse) if return_lse else out
