"""Host side of the backward kernels: tile choice, gradient buffers and the launches.

The preprocessing kernel computes delta = rowsum(dO * O) - grad_lse (the lse's gradient, when the
loss reads the lse: d lse_i / d s_ij = P_ij, so dS = P * (dP - delta) takes it whole); then
``flex_bwd_kernel`` runs its dK/dV programs and its dQ programs, in one launch or two (see
the policy's ``backward.fused``). Where gradients of captured tensors are wanted, a launch of the
dQ programs' grid first recomputes delta as rowsum(P * dP) - grad_lse from the backward's own
probabilities; where only sinks' are, the dQ programs sum it beside dQ (the policy's
``backward.exact_delta``). float64 inputs are computed in float64 throughout (see
``flexcore.kernels.forward.scale_args``).

dQ, dK and dV never use atomics (each program owns its rows), so they are bit-identical across runs.
Gradients of captured tensors are scattered by the dK/dV programs with atomic adds:

- default: float32 atomics (float64 for float64 tensors). Fast; the summation order, hence the
  last bits, varies between runs on the GPU.
- ``KernelOptions(deterministic=True)``: each contribution is rounded to a multiple of
  2**-FIXED_POINT_BITS (2**-32, about 2.3e-10) and added as two int64 words, its integer part and
  its fraction times 2**32. Integer addition is associative, so the result is bit-identical across
  runs. Trade-off: absolute resolution 2**-32 per contribution (a gradient summing N contributions
  is off by at most N * 2**-33; contributions that depend on b and h only are summed per tile in
  float32 first), two int64 atomics per contribution (somewhat slower than one float32 atomic), and
  range: integer parts up to 2**62 (4.6e18), past which the gradient reads as an infinity, as a
  float overflow would (a loss scaler then sees it).
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from flexcore._runtime import capturing, use_interpreter
from flexcore.errors import InputError
from flexcore.kernels import hopper
from flexcore.kernels.choice import choose, time_candidates
from flexcore.kernels.codegen import HEADER, cached_module, cap_list, fill_template, read_template
from flexcore.kernels.forward import (check_tile, ensure_tma_allocator, fit_tile, pad_head_dim, q_rows_descriptor,
                                      scale_args, use_tma)
from flexcore.kernels.launch import (arg_key, direct_launches, get_plan, keep_plan, launch, out_of_resources,
                                     plan_key, recording, run)
from flexcore.kernels.policy import DEFAULT_POLICY
from flexcore.kernels.tables import BlockTensors, finer_tables, q_block_tensors, refine_key, table_strides  # noqa: F401
from flexcore.options import KernelOptions

_log = logging.getLogger("flexcore.dispatch")

#: Captured-tensor gradients in deterministic mode are int64 multiples of 2**-FIXED_POINT_BITS.
FIXED_POINT_BITS = 32


def build_backward_source(score_lowered, score_bwd_lowered, mask_lowered) -> str:
    """The backward template filled with the forward mods and the score_mod's lowered VJP."""
    functions = "\n\n\n".join(m.source.rstrip() for m in (score_lowered, score_bwd_lowered, mask_lowered))
    values = {
        "MOD_FUNCTIONS": functions + "\n",
        "SCORE_CAPS": cap_list(score_lowered.cap_params),
        "MASK_CAPS": cap_list(mask_lowered.cap_params),
        "CAPS": cap_list(tuple(score_lowered.cap_params) + tuple(mask_lowered.cap_params)),
        "GRAD_CAPS": cap_list(score_bwd_lowered.grad_params),
    }
    return HEADER + fill_template(read_template("backward.py.tmpl"), values)


def backward_module(score_lowered, score_bwd_lowered, mask_lowered):
    """The compiled backward module for these mods, cached by their sources."""
    return cached_module(
        ("backward.py.tmpl", score_lowered.source, score_bwd_lowered.source, mask_lowered.source),
        lambda: build_backward_source(score_lowered, score_bwd_lowered, mask_lowered), "backward")


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim, 2-byte dtypes. dK/dV programs own
# BLOCK_N keys and step over BLOCK_M queries; dQ programs own BLOCK_M queries and step over BLOCK_N
# keys. One launch for both kinds uses both tiles, the common num_warps and the smaller num_stages.
# At D=128 one launch (2 stages) is fastest on noop and causal masks; at D=64 (4 warps) two launches
# are (docs/decisions.md#backward-launch-layout).
# A mod with many live values can exceed shared memory: see flexcore.kernels.launch.
_DKDV_CONFIGS = {64: (64, 64, 4, 3), 128: (64, 128, 8, 3), 256: (32, 64, 8, 1)}
_DQ_CONFIGS = {64: (64, 64, 4, 3), 128: (128, 128, 8, 2), 256: (64, 32, 4, 1)}
# dQ tiles where the score_mod is not the identity, or the mask has no partial block (dense path):
# 64 keys per step, so one launch keeps 3 stages and a score_mod's chain spills less. The identity
# score_mod with a partial mask is slower there, so it keeps _DQ_CONFIGS (docs/decisions.md#backward-tiles).
_DQ_CONFIGS_SCORE_OR_DENSE = {128: (128, 64, 8, 3)}
# Tiles over 64x64 mask blocks (the finer tables of flexcore.kernels.tables, or a mask built
# with BLOCK_SIZE=64): 4 warps, since 8 warps on 64x64 tiles run far slower; 3 stages for dK/dV and 2
# for dQ are near the best pairing everywhere (docs/decisions.md#finer-tables).
_FINE_DKDV_CONFIGS = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)}
_FINE_DQ_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}
# The paths below follow the policy's ``backward`` family (flexcore.kernels.policy):
# - tma: descriptors for the tiles read in the inner loops; off by default, pointer loads being as
#   fast within noise (docs/decisions.md#backward-launch-layout).
# - full_runs: runs of full blocks stepped over from the first index, as in the forward; at large
#   head dims only with a score_mod that reads the positions (docs/decisions.md#table-paths).
# - p_from_lse: 16-bit inputs recompute probabilities as exp2(s - lse2) with lse2 = m + log2(l)
#   per row (one product less per score); lse2's float32 rounding is far below the 16-bit rounding
#   of p. Float32 and float64 inputs keep (m, 1/l).
# - dense, dense_head_dims: masks whose blocks are all full skip the partial loops and the tables;
#   with a score_mod only warp-specialized (docs/decisions.md#backward-dense-path).
# - warp_spec: warp-specialized dense loops (triton's `tl.range(..., warp_specialize=True)`)
#   reading every tile through descriptors over all rows; they need 16-bit inputs (lse2), no GQA,
#   sequences that divide the tiles, layouts that such descriptors can read, no captured tensors
#   and, on the GPU, 8-warp tiles for both kinds of program (docs/decisions.md#dense-warp-specialization).
# - exact_delta: where captured tensors or sinks want gradients, delta = rowsum(P * dP):
#   rowsum(dO * O) carries the forward's 16-bit rounding, which a one-signed mod derivative (an
#   ALiBi slope's |i - j|) or a sink's p_sink adds up over the rows (docs/decisions.md#exact-delta).
#   Captured tensors' gradients read it in dS, so an extra pass over the dQ programs' grid computes
#   it first; a sink's gradient reads it only after, so the dQ programs sum it beside dQ (ROW_SUMS),
#   the Gluon dQ kernel's too.
# - fused, fused_head_dims: one launch for both kinds of program, timed against two per kernel
#   and size bucket (_tune_layout).
# Kernels (module, tiles, constexprs) whose single launch ran out of shared memory: they run as two.
_split: set = set()
# Whether one launch was measured faster than two, per kernel and size bucket (see _tune_layout).
_layout_choice: dict = {}


def _tune_layout(key, run_fused, run_split, grad_buffers, rule) -> bool:
    """Time one launch against two for this kernel and size bucket, remember the faster, and leave
    the gradients to the caller's next run. One launch is usually faster (a single tail, both kinds
    of program on the GPU at once), but a score_mod with a long derivative chain can lose more to the
    shared num_stages than it gains (softcap, docs/decisions.md#backward-launch-layout). Inside a CUDA graph capture
    nothing is timed: one launch, and tuning at the next call outside a capture."""
    if capturing():
        return True
    if not run_fused():  # also compiles it
        _layout_choice[key] = False
        return False
    run_split()
    # One launch is preferred: it keeps the choice unless two are faster beyond the tie tolerance.
    times = time_candidates([run_fused, run_split], rule)
    for buf in grad_buffers:  # the timed runs added captured-tensor gradients again and again
        buf.zero_()
    _layout_choice[key] = fused = choose(times, rule.tolerance) == 0
    return fused


def _head_dim_key(head_dim_pad: int) -> int:
    return min((k for k in _DKDV_CONFIGS if k >= head_dim_pad), default=256)


def _tiles(opts: KernelOptions, head_dim_pad: int, itemsize: int, sparse_q: int, sparse_kv: int,
           score_or_dense: bool = False):
    """((BLOCK_M, BLOCK_N, meta) for dK/dV, (BLOCK_M, BLOCK_N, meta) for dQ); ``score_or_dense``:
    the score_mod is not the identity or the dense path runs (see _DQ_CONFIGS_SCORE_OR_DENSE)."""
    if use_interpreter():
        # The interpreter costs the same per loop step whatever the tile: use large tiles.
        bm = fit_tile(64, sparse_q, "query")
        bn = fit_tile(64, sparse_kv, "key")
        configs = [(bm, bn, {}), (bm, bn, {})]
    else:
        key = _head_dim_key(head_dim_pad)
        configs = []
        dkdv_table, dq_table = _DKDV_CONFIGS, _DQ_CONFIGS
        if score_or_dense and key in _DQ_CONFIGS_SCORE_OR_DENSE:
            dq_table = _DQ_CONFIGS_SCORE_OR_DENSE
        if (sparse_q, sparse_kv) == (64, 64) and itemsize == 2 and key in _FINE_DKDV_CONFIGS:
            dkdv_table, dq_table = _FINE_DKDV_CONFIGS, _FINE_DQ_CONFIGS
        for table in (dkdv_table, dq_table):
            m, n, w, s = table[key]
            if itemsize == 4:  # float32 tiles take twice the registers and shared memory
                m, n, s = max(16, m // 2), max(16, n // 2), max(1, s - 1)
            meta = dict(num_warps=opts.num_warps or w, num_stages=opts.num_stages or s)
            configs.append((fit_tile(m, sparse_q, "query"), fit_tile(n, sparse_kv, "key"), meta))
    if opts.BLOCK_M or opts.BLOCK_N:
        bm = check_tile(opts.BLOCK_M, sparse_q, "BLOCK_M", "query") if opts.BLOCK_M else None
        bn = check_tile(opts.BLOCK_N, sparse_kv, "BLOCK_N", "key") if opts.BLOCK_N else None
        configs = [(bm or m, bn or n, meta) for m, n, meta in configs]
    return configs[0], configs[1]


def _warp_spec_rows(q, k, v, grad_out, allowed: bool, rule: str) -> tuple[int, int, int, int]:
    """The row counts of descriptors over all rows of q, k, v and grad_out (see
    flexcore.kernels.forward.q_rows_descriptor) where ``allowed`` and the warp-specialized loops may
    run (``rule``: the policy's backward.warp_spec): all four nonzero, or all 0."""
    if not allowed:
        return (0, 0, 0, 0)
    if rule == "auto" and not use_tma((q, k, v, grad_out), True):  # Hopper or later, 16-bit
        return (0, 0, 0, 0)
    if q.shape[-1] != pad_head_dim(q.shape[-1]) or v.shape[-1] != pad_head_dim(v.shape[-1]):
        return (0, 0, 0, 0)
    rows = tuple(q_rows_descriptor(t, True) for t in (q, k, v, grad_out))
    return rows if all(rows) else (0, 0, 0, 0)


def uses_runs(head_dim_pad: int, score_is_trivial: bool, opts: KernelOptions | None = None) -> bool:
    """Whether the backward may step over runs of full blocks (the policy's backward.full_runs and
    full_runs_max_head_dim), and so reads the tables' :meth:`BlockTensors.stats`. ``opts`` None:
    the default policy."""
    policy = DEFAULT_POLICY.backward if opts is None else opts.dispatch.backward
    return policy.full_runs and (head_dim_pad <= policy.full_runs_max_head_dim or not score_is_trivial)


def backward(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
             kv_blocks: BlockTensors, q_blocks: BlockTensors, scale: float, opts: KernelOptions,
             grad_lse=None, return_delta: bool = False):
    """Gradients of flex_attention's output (and lse) with respect to q, k, v and the score_mod's
    captures.

    Args:
        q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv): the forward's inputs.
        out (B, Hq, L, Dv): the forward's output. row_stats (2, B, Hq, L): the forward's row max
            (log2 units) and 1/row sum (``flexcore.kernels.forward.forward``); from a kernel that
            returns only lse, use ``flexcore.kernels.forward.row_stats_from_lse``.
        grad_out (B, Hq, L, Dv): gradient of the loss with respect to ``out``.
        score_lowered, mask_lowered: the forward's lowered mods.
        score_bwd_lowered: ``flexcore.lowering.vjp.lower_score_mod_backward(score_mod, score_lowered)``.
        kv_blocks: the forward's BlockTensors; q_blocks: :func:`q_block_tensors` of the same mask.
        scale: the forward's scale. opts: KernelOptions (``deterministic`` makes the captured
            gradients bit-identical across runs; dq, dk, dv are always deterministic).
        grad_lse (B, Hq, L) or None: gradient of the loss with respect to the forward's lse
            (natural log, as returned), any float dtype and strides; None means zero. Since
            d lse_i / d s_ij = P_ij, it enters as dS = P * (dP - (delta - grad_lse)). Rows
            without a kept key (lse = -inf) get no gradient from it (their P is 0). InputError
            where it is not a floating-point tensor of that shape on q's device.
        return_delta: also return the rows' delta, rowsum(dO * O) - grad_lse (B, Hq, L) in the
            row statistics' dtype, which the kernels computed (a sink's gradient reads it). Where
            the policy's ``backward.exact_delta`` is on, it is computed as rowsum(P * dP) - grad_lse
            from the backward's own probabilities (by the Triton template's dQ programs, or by the
            pass that captured tensors' gradients take: the Gluon kernels have neither), equal to
            it in exact arithmetic.

    Returns:
        (dq, dk, dv, captured_grads): dq, dk, dv in the dtypes and shapes of q, k, v;
        ``captured_grads[i]`` is the gradient of ``score_lowered.captured[i]`` (same shape and
        dtype), or None where that tensor does not require grad. With ``return_delta``,
        (dq, dk, dv, captured_grads, delta).
    """
    result = _gradients(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
                        kv_blocks, q_blocks, scale, opts, grad_lse, return_delta)
    return result if return_delta else result[:4]


def _gradients(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
               kv_blocks: BlockTensors, q_blocks: BlockTensors, scale: float, opts: KernelOptions,
               grad_lse=None, delta_wanted: bool = False):
    """backward's (dq, dk, dv, captured_grads, delta), through a plan where one is kept;
    ``delta_wanted``: the caller reads delta (backward's ``return_delta``)."""
    row_stats = row_stats.contiguous()
    grad_lse = _check_grad_lse(grad_lse, q, row_stats.dtype)
    caps = (*score_lowered.kernel_args(), *mask_lowered.kernel_args())
    key = _plan_key(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
                    kv_blocks, q_blocks, scale, opts, caps, grad_lse, delta_wanted)
    if key is not None:
        plan = get_plan(key)
        if plan is not None:  # it holds the tables that finer_tables chose (the key has what it read)
            return plan(q, k, v, out, row_stats, grad_out, caps, score_lowered.captured,
                        score_bwd_lowered.grad_of, opts.deterministic, grad_lse)
    owners = (kv_blocks, q_blocks)
    # The finer tables where the forward's rule takes them (the policy's forward.refine), here also
    # where the Gluon backward would serve the mask's own: the template over them is as fast or
    # faster there (docs/decisions.md#finer-tables). Forced (gluon.backward "on"), the Gluon
    # backward reads the mask's own tables.
    fine = finer_tables(kv_blocks, q.shape[2], mask_lowered, opts,
                        lambda: opts.dispatch.gluon.backward == "on")
    if fine is not None:
        kv_blocks, q_blocks = fine
    if key is None:
        return _backward(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered,
                         mask_lowered, kv_blocks, q_blocks, scale, opts, caps, grad_lse, delta_wanted)[0]
    with recording() as record:
        result, (make_plan, count) = _backward(q, k, v, out, row_stats, grad_out, score_lowered,
                                               score_bwd_lowered, mask_lowered, kv_blocks, q_blocks, scale,
                                               opts, caps, grad_lse, delta_wanted)
    launches = direct_launches(record, count)
    if launches is not None:
        keep_plan(key, make_plan(launches), owners)
    return result


def _check_grad_lse(grad_lse, q, stats_dtype):
    """``grad_lse`` as the kernels read it: (B, Hq, L) contiguous in the row statistics' dtype, or
    None. Raises InputError (a ValueError) naming it where it cannot be an lse's gradient."""
    if grad_lse is None:
        return None
    B, Hq, L = q.shape[:3]
    if not isinstance(grad_lse, torch.Tensor) or not grad_lse.is_floating_point():
        raise InputError(f"grad_lse must be a floating-point tensor of shape (B, Hq, L) = {(B, Hq, L)} "
                         f"or None; got {type(grad_lse).__name__}"
                         + (f" of dtype {grad_lse.dtype}" if isinstance(grad_lse, torch.Tensor) else ""))
    if tuple(grad_lse.shape) != (B, Hq, L) or grad_lse.device != q.device:
        raise InputError(f"grad_lse must have the lse's shape (B, Hq, L) = {(B, Hq, L)} on {q.device}; "
                         f"got {tuple(grad_lse.shape)} on {grad_lse.device}")
    return grad_lse.to(stats_dtype).contiguous()


def _plan_key(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
              kv_blocks, q_blocks, scale, opts, caps, grad_lse=None, delta_wanted: bool = False):
    """Everything the backward's host decisions read besides the tables' statistics (fixed for
    the tables) and the layout tuner's choice (fixed once made): see flexcore.kernels.launch's
    per-call plans. None where plans are off. The mods count by their sources and traits, as in
    the forward's key. A given ``grad_lse`` (HAS_GRAD_LSE) keys apart from None, with its
    alignment; its values are read at each call. ``delta_wanted`` (a sink's gradient) may add
    the exact-delta pass."""
    return plan_key(
        opts.dispatch.launch, "backward", score_lowered.source, score_bwd_lowered.source, mask_lowered.source,
        score_lowered.is_trivial, bool(score_lowered.captured), score_bwd_lowered.grad_of,
        id(kv_blocks), id(q_blocks),
        q.device, q.dtype, k.dtype, v.dtype, out.dtype, grad_out.dtype, row_stats.dtype,
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape, out.stride(),
        grad_out.shape, grad_out.stride(), row_stats.shape,
        q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, out.data_ptr() & 15,
        grad_out.data_ptr() & 15, row_stats.data_ptr() & 15, scale, opts,
        arg_key(caps) if caps else (), refine_key(mask_lowered),
        None if grad_lse is None else grad_lse.data_ptr() & 15, delta_wanted)


def _grad_buffers(captured, grad_of, deterministic: bool, device) -> tuple[dict, list]:
    """Zeroed buffers for the gradients of ``captured[i]``, i in ``grad_of`` (int64 fixed point
    where ``deterministic``, else float32, float64 for float64 tensors), and the kernel's arguments
    for them (each buffer and its strides)."""
    grad_buffers = {}
    grad_args = []
    for i in grad_of:
        if deterministic:  # (integer part, fraction) words side by side: the kernel adds at +0 and +1
            buf = grad_buffers[i] = torch.zeros((*captured[i].shape, 2), dtype=torch.int64, device=device)
            grad_args.append(buf)
            grad_args.extend(buf.stride()[:-1])
            continue
        # float32 atomics, or float64 ones for float64 tensors
        dtype = torch.float64 if captured[i].dtype == torch.float64 else torch.float32
        buf = grad_buffers[i] = torch.zeros(captured[i].shape, dtype=dtype, device=device)
        grad_args.append(buf)
        grad_args.extend(buf.stride())
    return grad_buffers, grad_args


def _from_fixed_point(buf: torch.Tensor) -> torch.Tensor:
    """float64 values of a deterministic gradient buffer (see _grad_buffers); an integer part at
    the kernel's clamp (2**62) reads as an infinity of its sign."""
    whole, fraction = buf.unbind(-1)
    value = whole.double() + fraction.double() * 2.0 ** -FIXED_POINT_BITS
    limit = 2 ** 62
    return torch.where((whole >= limit) | (whole <= -limit), whole.double().sign() * torch.inf, value)


def _captured_grads(captured, grad_buffers: dict, deterministic: bool) -> list:
    """The gradients of the captured tensors from their buffers (None where there is none)."""
    grads = []
    for i, t in enumerate(captured):
        buf = grad_buffers.get(i)
        if buf is None:
            grads.append(None)
        elif deterministic:
            grads.append(_from_fixed_point(buf).to(t.dtype))
        else:
            grads.append(buf.to(t.dtype))
    return grads


class _BackwardPlan:
    """A repeated backward call (see flexcore.kernels.launch's per-call plans): the compiled
    preprocessing and backward kernels as they ran (one launch or two), their grids and integer
    arguments."""

    __slots__ = ("pre", "launches", "pre_fixed", "fixed", "rows_shape", "acc_dtype", "p_from_lse", "sums_slot")

    def __init__(self, launches, pre_fixed, fixed, rows_shape, acc_dtype, p_from_lse, sums_slot=0):
        self.pre, self.launches = launches[0], tuple(launches[1:])
        self.pre_fixed, self.fixed = pre_fixed, fixed
        self.rows_shape, self.acc_dtype, self.p_from_lse = rows_shape, acc_dtype, p_from_lse
        self.sums_slot = sums_slot

    def __call__(self, q, k, v, out, row_stats, grad_out, caps, captured, grad_of, deterministic,
                 grad_lse=None):
        device = q.device
        row_terms = torch.empty(self.rows_shape, dtype=self.acc_dtype, device=device)
        delta = row_terms[0]
        entry, grid = self.pre
        entry.launch(grid, (out, grad_out, delta, row_stats, row_terms[1 if self.p_from_lse else 0],
                            delta if grad_lse is None else grad_lse, *self.pre_fixed))
        if self.p_from_lse:
            row_stats = row_terms[1]
        grad_buffers, grad_args = _grad_buffers(captured, grad_of, deterministic, device)
        dq = torch.empty(q.shape, dtype=q.dtype, device=device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=device)
        ensure_tma_allocator()  # per thread (autograd's); cheap where set
        args = (q, k, v, grad_out, dq, dk, dv, row_stats, delta, *self.fixed, *caps, *grad_args)
        for entry, grid in self.launches:
            entry.launch(grid, args)
        if self.sums_slot:
            delta = _summed_delta(row_terms, self.sums_slot, grad_lse)
        return dq, dk, dv, _captured_grads(captured, grad_buffers, deterministic), delta


def _preprocess(module, out, grad_out, row_stats, p_from_lse: bool, grad_lse=None, delta_from_out=True,
                opts: KernelOptions | None = None, row_sums: bool = False):
    """delta = rowsum(dO * O) - grad_lse (without the rowsum where not ``delta_from_out``: the
    PHASE 3 pass adds its own), and with ``p_from_lse`` the rows' lse2 = m + log2(l), in one buffer
    (slots, B, Hq, L) of the accumulation dtype, with a last slot left for the dQ programs' row sums
    where ``row_sums`` (read through _summed_delta); and the preprocessing launch's integer arguments."""
    B, Hq, L, _ = out.shape
    fp64 = out.dtype == torch.float64
    row_terms = torch.empty(((2 if p_from_lse else 1) + row_sums, B, Hq, L),
                            dtype=torch.float64 if fp64 else torch.float32, device=out.device)
    grid, pre_fixed, constexprs = _preprocess_launch(out, grad_out, p_from_lse, grad_lse is not None,
                                                     delta_from_out)
    # An absent grad_lse is not read (HAS_GRAD_LSE): delta's buffer stands in for the pointer.
    run(module.flex_bwd_preprocess, grid,
        (out, grad_out, row_terms[0], row_stats, row_terms[1 if p_from_lse else 0],
         row_terms[0] if grad_lse is None else grad_lse, *pre_fixed),
        constexprs, (DEFAULT_POLICY if opts is None else opts.dispatch).launch)
    return row_terms, pre_fixed


def _preprocess_launch(out, grad_out, p_from_lse: bool, has_grad_lse: bool, delta_from_out: bool):
    """(grid, integer arguments, constexprs) of ``flex_bwd_preprocess`` over ``out``'s rows."""
    B, Hq, L, Dv = out.shape
    block_m = 64
    fixed = (*out.stride(), *grad_out.stride(), B * Hq * L, L, Hq)
    constexprs = dict(HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=pad_head_dim(Dv), BLOCK_M=block_m,
                      ACC_FP64=out.dtype == torch.float64, P_FROM_LSE=p_from_lse, HAS_GRAD_LSE=has_grad_lse,
                      DELTA_FROM_OUT=delta_from_out)
    return (math.ceil(L / block_m), B * Hq), fixed, constexprs


def _row_terms(out, grad_out, row_stats, grad_lse, acc, p_from_lse: bool, delta_from_out: bool):
    """(delta, lse2 or None) as flex_bwd_preprocess writes them, from torch ops: inside a compiled
    step Inductor fuses them into one reduction that its own launcher starts, cheaper on the host
    than a user kernel's launch (docs/decisions.md#compiled-host-path)."""
    if delta_from_out:
        delta = (out.to(acc) * grad_out.to(acc)).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse.to(acc)
    else:  # the PHASE 3 pass adds rowsum(P * dP) to -dlse
        delta = (-grad_lse.to(acc) if grad_lse is not None
                 else out.new_zeros(out.shape[:3], dtype=acc))
    lse2 = None
    if p_from_lse:  # lse2 = m + log2(l); rows without a kept key (1/l = 0) get +inf, so p = 0
        m, inv_l = row_stats.unbind(0)
        empty = inv_l == 0
        lse2 = torch.where(empty, torch.inf,
                           torch.where(empty, 0.0, m) - torch.log2(torch.where(empty, 1.0, inv_l))).contiguous()
    return delta.contiguous(), lse2


def _summed_delta(row_terms, slot: int, grad_lse):
    """A sink's delta from the dQ programs' row sums (slot ``slot`` of ``row_terms``): rowsum(P * dP)
    - grad_lse, as the PHASE 3 pass stores it."""
    sums = row_terms[slot]
    return sums if grad_lse is None else sums - grad_lse


def _row_rules(opts: KernelOptions, itemsize: int, sums_delta: bool) -> tuple[bool, bool]:
    """(p_from_lse, exact_delta): the policy's backward rules for the rows' statistics, which
    read the input's element size and whether a gradient sums the rows' delta one-signed."""
    policy = opts.dispatch.backward
    return policy.p_from_lse and itemsize == 2, policy.exact_delta and sums_delta


def _hopper_backward(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
                     kv_blocks: BlockTensors, q_blocks: BlockTensors, scale: float, opts: KernelOptions,
                     caps: tuple, grad_lse=None, exact_delta: bool = False):
    """backward's result and plan parts (as _backward's) from flexcore.kernels.hopper's Gluon kernels,
    or None where they do not serve the call (see hopper.applies_backward) or fail to build for this
    mask_mod. ``exact_delta``: a sink's gradient reads delta, which the dQ kernel then sums as
    rowsum(P * dP) (ROW_SUMS; the Gluon kernels serve only the identity score_mod, so no captured
    tensor wants a gradient)."""
    if not hopper.backward_may_apply(q, opts):
        return None
    L, S = q.shape[2], k.shape[2]
    sparse_q, sparse_kv = kv_blocks.sparse_block
    dense = kv_blocks.all_full(math.ceil(L / sparse_q), math.ceil(S / sparse_kv))
    if not hopper.applies_backward(q, k, v, grad_out, score_lowered, kv_blocks, q_blocks, dense, scale, opts):
        return None
    module = hopper.backward_module(mask_lowered)
    if module is None:
        return None
    # The Gluon kernels take dS = P * (dP - delta) with the preprocessing's delta, which carries
    # grad_lse (see flex_bwd_preprocess).
    row_terms, pre_fixed = _preprocess(backward_module(score_lowered, score_bwd_lowered, mask_lowered), out,
                                       grad_out, row_stats, True, grad_lse, opts=opts, row_sums=exact_delta)
    sums_slot = row_terms.shape[0] - 1 if exact_delta else 0
    launches = hopper.BackwardLaunches(module, kv_blocks, q_blocks, dense, scale, sums_slot)
    grads = hopper.backward(q, k, v, grad_out, row_terms[1], row_terms[0], launches, caps,
                            hopper.backward_key(mask_lowered, dense, q.dtype, sums_slot),
                            opts.dispatch.launch)
    if grads is None:
        return None
    _log.debug("backward: Gluon kernels (dense=%s, head dim %d, %s, row sums %s)", dense, q.shape[3], q.dtype,
               bool(sums_slot))
    delta = _summed_delta(row_terms, sums_slot, grad_lse) if sums_slot else row_terms[0]
    result = (*grads, _captured_grads(score_lowered.captured, {}, opts.deterministic), delta)
    return result, (lambda entries: _HopperBackwardPlan(entries, pre_fixed, launches, row_terms.shape,
                                                        row_terms.dtype, sums_slot), 3)


class _HopperBackwardPlan:
    """A repeated backward call that flexcore.kernels.hopper serves: the preprocessing launch and
    the two Gluon kernels' direct launches."""

    __slots__ = ("pre", "launches", "pre_fixed", "gluon", "rows_shape", "rows_dtype", "sums_slot")

    def __init__(self, entries, pre_fixed, gluon, rows_shape, rows_dtype, sums_slot=0):
        self.pre, self.launches = entries[0], tuple(entries[1:])
        self.pre_fixed, self.gluon = pre_fixed, gluon
        self.rows_shape, self.rows_dtype, self.sums_slot = rows_shape, rows_dtype, sums_slot

    def __call__(self, q, k, v, out, row_stats, grad_out, caps, captured, grad_of, deterministic,
                 grad_lse=None):
        row_terms = torch.empty(self.rows_shape, dtype=self.rows_dtype, device=q.device)
        entry, grid = self.pre
        entry.launch(grid, (out, grad_out, row_terms[0], row_stats, row_terms[1],
                            row_terms[0] if grad_lse is None else grad_lse, *self.pre_fixed))
        grads = self.gluon.replay(self.launches, q, k, v, grad_out, row_terms[1], row_terms[0], caps)
        delta = _summed_delta(row_terms, self.sums_slot, grad_lse) if self.sums_slot else row_terms[0]
        return (*grads, _captured_grads(captured, {}, deterministic), delta)


class BackwardChoice(NamedTuple):
    """What the Triton backward template runs for a call (:func:`template_choice`)."""

    dense: bool                # all-full mask: every tile, no tables
    warp_spec_rows: tuple      # row counts of the warp-specialized loops' descriptors, or zeros
    tma: bool                  # inner-loop tiles through tensor descriptors
    full_q_runs: bool          # runs of full blocks stepped over (dK/dV programs)
    full_kv_runs: bool         # the same for the dQ programs
    p_from_lse: bool           # probabilities as exp2(s - lse2)
    exact_delta: bool          # delta from the backward's own probabilities (see _backward)
    dkdv_tiles: tuple          # (BLOCK_M, BLOCK_N, launch knobs) of the dK/dV programs
    dq_tiles: tuple            # the same for the dQ programs
    may_fuse: bool             # one launch for both kinds may run (forced or timed, see _tune_layout)


def template_choice(q, k, v, grad_out, score_lowered, kv_blocks: BlockTensors, q_blocks: BlockTensors,
                    opts: KernelOptions, sums_delta: bool) -> BackwardChoice:
    """The Triton backward template's paths, descriptors and tiles for the call (no launch).
    ``sums_delta``: a gradient sums the rows' delta one-signed (captured tensors' or sinks')."""
    policy = opts.dispatch.backward
    L, D = q.shape[2], q.shape[3]
    Hq, Hkv, S, Dv = q.shape[1], k.shape[1], k.shape[2], v.shape[3]
    head_dim_pad, head_dim_v_pad = pad_head_dim(D), pad_head_dim(Dv)
    sparse_q, sparse_kv = kv_blocks.sparse_block
    itemsize = q.element_size()
    head_dim_max = max(head_dim_pad, head_dim_v_pad)  # tiles and paths follow the larger head dim
    head_dim_key = _head_dim_key(head_dim_max)
    trivial = score_lowered.is_trivial
    # The dense path and its warp-specialized loops (the policy's dense and warp_spec); the tables'
    # all_full is read only where the rules could take it.
    dense_dims = head_dim_key in policy.dense_head_dims
    ws_rule = policy.warp_spec == "on" or (policy.warp_spec == "auto" and dense_dims and not trivial)
    dense_rule = policy.dense == "on" or (policy.dense == "auto" and dense_dims and trivial)
    dense = (policy.dense != "off" and (ws_rule or dense_rule)
             and kv_blocks.all_full(math.ceil(L / sparse_q), math.ceil(S / sparse_kv)))
    dkdv_tiles, dq_tiles = _tiles(opts, head_dim_max, itemsize, sparse_q, sparse_kv, not trivial or dense)
    p_from_lse, exact_delta = _row_rules(opts, itemsize, sums_delta)
    gqa = Hq // Hkv
    # On the GPU only with 8-warp tiles for both kinds: at 4 warps triton 3.6 partitions the loops
    # and a forced run at head dim 64 gave NaN gradients (docs/decisions.md#backward-dense-path).
    eight_warps = use_interpreter() or dkdv_tiles[2].get("num_warps") == dq_tiles[2].get("num_warps") == 8
    ws_rows = _warp_spec_rows(
        q, k, v, grad_out, dense and ws_rule and eight_warps and p_from_lse and gqa == 1
        and L % sparse_q == 0 and S % sparse_kv == 0 and L % 4 == 0 and not score_lowered.captured,
        policy.warp_spec)
    ws = ws_rows[0] > 0
    dense = dense and (ws or dense_rule)
    tma = ws or use_tma((q, k, v, grad_out), D == head_dim_pad and Dv == head_dim_v_pad, policy.tma)
    runs = uses_runs(head_dim_max, trivial, opts)
    may_fuse = ((policy.fused == "on" or (policy.fused == "auto" and head_dim_key in policy.fused_head_dims))
                and dkdv_tiles[2].get("num_warps") == dq_tiles[2].get("num_warps"))
    return BackwardChoice(dense, ws_rows, tma, runs and q_blocks.full_runs(math.ceil(S / sparse_kv)),
                          runs and kv_blocks.full_runs(math.ceil(L / sparse_q)), p_from_lse, exact_delta,
                          dkdv_tiles, dq_tiles, may_fuse)


def _template_args(q, k, v, grad_out, dq, dk, dv, row_stats, delta, kv_blocks: BlockTensors,
                   q_blocks: BlockTensors, scale: float, opts: KernelOptions, score_lowered, caps: tuple,
                   grad_args: list, choice: BackwardChoice, unread=None):
    """(arguments, fixed, constexprs) of ``flex_bwd_kernel`` for the paths of ``choice``, but its
    tiles and PHASE. The arguments are (tensors of the call, fixed, captures, gradient buffers): a
    plan keeps ``fixed``. ``row_stats``: lse2 where ``choice.p_from_lse``. ``unread``: a function
    returning a tensor of its own for each table pointer the kernel does not read (tables without
    full blocks); None: the partial tables stand in."""
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    sparse_q, sparse_kv = kv_blocks.sparse_block
    # Stand-ins of the tables' rank: the kernel takes three strides of each.
    qn, qi = (q_blocks.full_tables() if unread is None or q_blocks.full_num_blocks is not None
              else (unread((1, 1, 1)), unread((1, 1, 1, 1))))
    kn, ki = (kv_blocks.full_tables() if unread is None or kv_blocks.full_num_blocks is not None
              else (unread((1, 1, 1)), unread((1, 1, 1, 1))))
    ws_rows = choice.warp_spec_rows
    fixed = (
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
        kv_blocks.num_blocks, kv_blocks.indices, kn, ki,
        *table_strides(kv_blocks.num_blocks), *table_strides(kv_blocks.indices)[:3], *table_strides(kn),
        *table_strides(ki)[:3],
        q_blocks.num_blocks, q_blocks.indices, qn, qi,
        *table_strides(q_blocks.num_blocks), *table_strides(q_blocks.indices)[:3], *table_strides(qn),
        *table_strides(qi)[:3],
        B * Hq * L, L, S, Hq, Hkv, *scale_args(scale, q.dtype), *ws_rows)
    args = (q, k, v, grad_out, dq, dk, dv, row_stats, delta, *fixed, *caps, *grad_args)
    ws = ws_rows[0] > 0
    kinds = opts.dispatch.backward.warp_spec_kinds
    constexprs = dict(
        HEAD_DIM=D, HEAD_DIM_PAD=pad_head_dim(D), HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=pad_head_dim(Dv),
        SPARSE_Q_BLOCK=sparse_q, SPARSE_KV_BLOCK=sparse_kv, HAS_FULL_BLOCKS=kv_blocks.full_num_blocks is not None,
        EVEN_Q=L % sparse_q == 0, EVEN_KV=S % sparse_kv == 0,  # tiles divide mask blocks
        SCORE_IS_TRIVIAL=score_lowered.is_trivial, FIXED_POINT_GRADS=opts.deterministic,
        UPCAST_DOT=use_interpreter() and q.dtype in (torch.float16, torch.bfloat16),
        INPUT_PRECISION="tf32" if (opts.allow_tf32 and not use_interpreter()) else "ieee",
        ACC_FP64=q.dtype == torch.float64, GQA_GROUP=Hq // Hkv, WRITE_CAPTURED_GRADS=bool(grad_args),
        USE_TMA=choice.tma, P_FROM_LSE=choice.p_from_lse, DENSE=choice.dense,
        DKDV_WARP_SPEC=ws and "dkdv" in kinds, DQ_WARP_SPEC=ws and "dq" in kinds,
        FULL_Q_RUNS=choice.full_q_runs, FULL_KV_RUNS=choice.full_kv_runs)
    return args, fixed, constexprs


def _delta_pass(kernel, args: tuple, common: dict, choice: BackwardChoice, q, k, opts: KernelOptions) -> None:
    """The exact-delta pass: delta = rowsum(P * dP) - grad_lse over the dQ programs' grid (PHASE 3),
    before the other phases; ``args`` and ``common`` from :func:`_template_args`."""
    B, Hq, L = q.shape[:3]
    Hkv = k.shape[1]
    tile_m, tile_n, meta = choice.dq_tiles
    launch(kernel, lambda bm, bn: (Hq // Hkv * math.ceil(L / bm), B * Hkv), args, tile_m, tile_n, meta,
           dict(PHASE=3, DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, **common), pinned=opts.pins_tiles,
           tile_names=("DQ_BLOCK_M", "DQ_BLOCK_N"), policy=opts.dispatch.launch)


def _refuse_forced_gluon(q, opts: KernelOptions) -> None:
    """InputError where the policy forces the Gluon backward on a call that it could otherwise take
    (hopper.backward_may_apply) but whose sinks alone want a gradient."""
    if opts.dispatch.gluon.backward == "on" and hopper.backward_may_apply(q, opts):
        raise InputError("the Gluon backward kernels were required (policy.gluon.backward='on') but "
                         "cannot serve this call: only the sinks want a gradient, whose delta = rowsum(P * dP) "
                         "without the other gradients only the Triton template computes "
                         "(policy.backward.exact_delta); use gluon.backward='auto', or "
                         "backward.exact_delta=False to read delta from the output")


def row_deltas(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
               kv_blocks: BlockTensors, q_blocks: BlockTensors, scale: float, opts: KernelOptions,
               grad_lse=None):
    """The rows' delta of :func:`backward` (``return_delta``) without its gradients, for a call
    that wants no other (sinks that learn while q, k, v and the captures are frozen): the
    preprocessing, then, with the policy's ``backward.exact_delta``, the pass that computes it as
    rowsum(P * dP) - grad_lse (B, Hq, L). Over the mask's own tables; no plan is kept."""
    row_stats = row_stats.contiguous()
    grad_lse = _check_grad_lse(grad_lse, q, row_stats.dtype)
    module = backward_module(score_lowered, score_bwd_lowered, mask_lowered)
    choice = template_choice(q, k, v, grad_out, score_lowered, kv_blocks, q_blocks, opts, True)
    if choice.exact_delta:
        _refuse_forced_gluon(q, opts)
    row_terms, _ = _preprocess(module, out, grad_out, row_stats, choice.p_from_lse, grad_lse,
                               delta_from_out=not choice.exact_delta, opts=opts)
    delta = row_terms[0]
    if choice.exact_delta:
        caps = (*score_lowered.kernel_args(), *mask_lowered.kernel_args())
        _, grad_args = _grad_buffers(score_lowered.captured, score_bwd_lowered.grad_of, opts.deterministic,
                                     q.device)
        # The pass writes delta alone: q, k and v stand in for the gradients' pointers.
        stats = row_terms[1] if choice.p_from_lse else row_stats
        args, _, common = _template_args(q, k, v, grad_out, q, k, v, stats, delta, kv_blocks, q_blocks, scale,
                                         opts, score_lowered, caps, grad_args, choice)
        _delta_pass(module.flex_bwd_kernel, args, common, choice, q, k, opts)
    return delta


def _backward(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
              kv_blocks: BlockTensors, q_blocks: BlockTensors, scale: float, opts: KernelOptions,
              caps: tuple, grad_lse=None, delta_wanted: bool = False):
    """backward's decisions and launches: (the result (dq, dk, dv, captured_grads, delta), (a
    function of the launches that ran, recorded, to the plan that repeats them, the number of
    launches that ran)). The Gluon kernels of flexcore.kernels.hopper serve the call where they
    apply, the exact delta included (their dQ kernel sums it, ROW_SUMS)."""
    # A sink's gradient, -sum over rows of p_sink * delta, adds up rowsum(dO * O)'s rounding of the
    # 16-bit output as a captured tensor's does: delta from the backward's own P and dP instead.
    exact_wanted = _row_rules(opts, q.element_size(), delta_wanted)[1]
    hopper_result = _hopper_backward(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered,
                                     mask_lowered, kv_blocks, q_blocks, scale, opts, caps, grad_lse,
                                     exact_wanted)
    if hopper_result is not None:
        return hopper_result
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    module = backward_module(score_lowered, score_bwd_lowered, mask_lowered)
    sparse_q, sparse_kv = kv_blocks.sparse_block
    if q_blocks.sparse_block != (sparse_kv, sparse_q):
        raise ValueError(f"q_blocks.sparse_block {q_blocks.sparse_block} is not the transpose of "
                         f"kv_blocks.sparse_block {kv_blocks.sparse_block}")
    policy = opts.dispatch
    captured = score_lowered.captured
    choice = template_choice(q, k, v, grad_out, score_lowered, kv_blocks, q_blocks, opts,
                             bool(score_bwd_lowered.grad_of) or delta_wanted)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("backward: Triton template, tables %s, dense=%s warp_spec=%s tma=%s full_runs=(%s, %s) "
                   "p_from_lse=%s exact_delta=%s tiles dK/dV %s dQ %s", kv_blocks.sparse_block, choice.dense,
                   choice.warp_spec_rows[0] > 0, choice.tma, choice.full_q_runs, choice.full_kv_runs,
                   choice.p_from_lse, choice.exact_delta, choice.dkdv_tiles, choice.dq_tiles)
    (bm1, bn1, meta1), (bm2, bn2, meta2) = choice.dkdv_tiles, choice.dq_tiles
    pinned = opts.pins_tiles
    p_from_lse = choice.p_from_lse
    grad_buffers, grad_args = _grad_buffers(captured, score_bwd_lowered.grad_of, opts.deterministic,
                                            q.device)
    # Where only a sink's gradient reads the exact delta, the dQ programs sum it beside dQ (ROW_SUMS)
    # and dS takes rowsum(dO * O): no pass before (captured tensors' gradients need it in dS).
    row_sums = choice.exact_delta and delta_wanted and not score_bwd_lowered.grad_of
    exact_delta = choice.exact_delta and not row_sums
    row_terms, pre_fixed = _preprocess(module, out, grad_out, row_stats, p_from_lse, grad_lse,
                                       delta_from_out=not exact_delta, opts=opts, row_sums=row_sums)
    delta = row_terms[0]
    sums_slot = row_terms.shape[0] - 1 if row_sums else 0
    if p_from_lse:
        row_stats = row_terms[1]  # the kernel reads lse2 where it read the row max, and no 1/l

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    gqa = Hq // Hkv
    args, fixed, common = _template_args(q, k, v, grad_out, dq, dk, dv, row_stats, delta, kv_blocks, q_blocks,
                                         scale, opts, score_lowered, caps, grad_args, choice)
    if sums_slot:
        common["ROW_SUMS"] = sums_slot
    kernel = module.flex_bwd_kernel
    launching = policy.launch
    if exact_delta:
        _delta_pass(kernel, args, common, choice, q, k, opts)

    def run_split():
        launch(kernel, lambda bm, bn: (math.ceil(S / bn), B * Hkv), args, bm1, bn1, meta1,
               dict(PHASE=1, DQ_BLOCK_M=16, DQ_BLOCK_N=16, **common), pinned=pinned,
               tile_names=("DKDV_BLOCK_M", "DKDV_BLOCK_N"), policy=launching)
        launch(kernel, lambda bm, bn: (gqa * math.ceil(L / bm), B * Hkv), args, bm2, bn2, meta2,
               dict(PHASE=2, DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, **common), pinned=pinned,
               tile_names=("DQ_BLOCK_M", "DQ_BLOCK_N"), policy=launching)

    def run_fused() -> bool:
        # One launch: the dK/dV programs, then the dQ programs of each query head of the group.
        if config_key in _split:
            return False
        grid = (math.ceil(S / bn1) + gqa * math.ceil(L / bm2), B * Hkv)
        try:
            run(kernel, grid, args, dict(PHASE=0, DKDV_BLOCK_M=bm1, DKDV_BLOCK_N=bn1, DQ_BLOCK_M=bm2,
                                         DQ_BLOCK_N=bn2, **meta_fused, **common), launching)
        except Exception as e:  # noqa: BLE001 - only triton's OutOfResources is handled
            if not out_of_resources(e):
                raise
            _split.add(config_key)  # the two kinds need less shared memory apart
            return False
        return True

    fused = choice.may_fuse
    if fused:  # keys built only here: the two-launch path costs no extra host time
        meta_fused = dict(meta1, num_stages=min(meta1["num_stages"], meta2["num_stages"])) if meta1 else {}
        config_key = (module.__name__, bm1, bn1, bm2, bn2, tuple(sorted(meta_fused.items())),
                      tuple(sorted((name, str(value)) for name, value in common.items())))
        if policy.backward.fused == "auto" and opts.autotune and not use_interpreter():
            layout_key = (config_key, *(max(n, 1).bit_length() for n in (L, S, B * Hkv)))
            fused = _layout_choice.get(layout_key)
            if fused is None:
                fused = _tune_layout(layout_key, run_fused, run_split, list(grad_buffers.values()),
                                     policy.launch.tune)
    ran_fused = bool(fused) and run_fused()
    if not ran_fused:
        run_split()
    if sums_slot:
        delta = _summed_delta(row_terms, sums_slot, grad_lse)
    result = (dq, dk, dv, _captured_grads(captured, grad_buffers, opts.deterministic), delta)
    return result, (lambda launches: _BackwardPlan(launches, pre_fixed, fixed, row_terms.shape, row_terms.dtype,
                                                   p_from_lse, sums_slot), (2 if ran_fused else 3) + exact_delta)


def backward_inline(q, k, v, out, row_stats, grad_out, grad_lse, score_lowered, score_bwd_lowered, mask_lowered,
                    kv_blocks: BlockTensors | None, q_blocks: BlockTensors | None, scale: float,
                    opts: KernelOptions):
    """(dq, dk, dv, captured_grads) of :func:`backward`, from the preprocessing kernel and the Triton
    template launched through ``torch.library.wrap_triton``, for the compiled call that Inductor
    launches itself (flexcore.ops, "inline" backward). As flexcore.kernels.forward.forward_inline,
    every decision reads shapes, dtypes and options only: the mask's own tables, no full-block runs,
    descriptors or warp specialization, the first tile configuration, and one launch for both kinds
    of program unless the policy's backward.fused is "off" (one launch measured as fast or faster
    inside compiled steps; its shared memory is the larger kind's). ``kv_blocks`` and ``q_blocks``
    None: no mask (the dense path)."""
    from torch.library import wrap_triton

    from flexcore.kernels.forward import _DENSE_SPARSE_BLOCK, _constexpr_defaults

    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    policy = opts.dispatch.backward
    dense = kv_blocks is None
    # Every pointer gets a tensor of its own: Inductor treats a kernel's tensor arguments as
    # distinct buffers, and where its analysis of the kernel's writes gives up, as all written.
    def unread(shape=(1,), dtype=torch.int32):
        return torch.empty(shape, dtype=dtype, device=q.device)

    if dense:
        # DENSE visits every tile as a full block and reads no table: stand-ins take the tables'
        # places, the full ones included (the template runs DENSE in its full-block loop).
        kv_blocks, q_blocks = (BlockTensors(unread((1, 1, 1)), unread((1, 1, 1, 1)), unread((1, 1, 1)),
                                            unread((1, 1, 1, 1)), _DENSE_SPARSE_BLOCK) for _ in range(2))
    sparse_q, sparse_kv = kv_blocks.sparse_block
    trivial = score_lowered.is_trivial
    dkdv_tiles, dq_tiles = _tiles(opts, max(pad_head_dim(D), pad_head_dim(Dv)), q.element_size(), sparse_q,
                                  sparse_kv, not trivial or dense)
    choice = BackwardChoice(dense, (0, 0, 0, 0), False, False, False,
                            *_row_rules(opts, q.element_size(), bool(score_bwd_lowered.grad_of)), dkdv_tiles,
                            dq_tiles,
                            policy.fused != "off" and dkdv_tiles[2].get("num_warps") == dq_tiles[2].get("num_warps"))
    module = backward_module(score_lowered, score_bwd_lowered, mask_lowered)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    row_stats = row_stats.contiguous()
    delta, lse2 = _row_terms(out, grad_out, row_stats, _check_grad_lse(grad_lse, q, row_stats.dtype), acc,
                             choice.p_from_lse, not choice.exact_delta)

    captured = score_lowered.captured
    grad_buffers, grad_args = _grad_buffers(captured, score_bwd_lowered.grad_of, opts.deterministic, q.device)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    caps = (*score_lowered.kernel_args(), *mask_lowered.kernel_args())
    args, _, common = _template_args(q, k, v, grad_out, dq, dk, dv, row_stats if lse2 is None else lse2, delta,
                                     kv_blocks, q_blocks, scale, opts, score_lowered, caps, grad_args, choice,
                                     unread)
    kernel = module.flex_bwd_kernel
    for name, default in _constexpr_defaults(kernel).items():
        common.setdefault(name, default)
    (bm1, bn1, meta1), (bm2, bn2, meta2) = dkdv_tiles, dq_tiles
    gqa = Hq // Hkv
    dkdv_grid = ((S + bn1 - 1) // bn1, B * Hkv, 1)
    dq_grid = (gqa * ((L + bm2 - 1) // bm2), B * Hkv, 1)
    launch = wrap_triton(kernel)
    if choice.exact_delta:  # delta = rowsum(P * dP) first (see backward)
        launch[dq_grid](*args, **{**common, "PHASE": 3, "DKDV_BLOCK_M": 16, "DKDV_BLOCK_N": 16,
                                  "DQ_BLOCK_M": bm2, "DQ_BLOCK_N": bn2, **meta2})
    if choice.may_fuse:
        meta = dict(meta1, num_stages=min(meta1["num_stages"], meta2["num_stages"])) if meta1 else {}
        launch[(dkdv_grid[0] + dq_grid[0], B * Hkv, 1)](
            *args, **{**common, "PHASE": 0, "DKDV_BLOCK_M": bm1, "DKDV_BLOCK_N": bn1, "DQ_BLOCK_M": bm2,
                      "DQ_BLOCK_N": bn2, **meta})
    else:
        launch[dkdv_grid](*args, **{**common, "PHASE": 1, "DKDV_BLOCK_M": bm1, "DKDV_BLOCK_N": bn1,
                                    "DQ_BLOCK_M": 16, "DQ_BLOCK_N": 16, **meta1})
        launch[dq_grid](*args, **{**common, "PHASE": 2, "DKDV_BLOCK_M": 16, "DKDV_BLOCK_N": 16,
                                  "DQ_BLOCK_M": bm2, "DQ_BLOCK_N": bn2, **meta2})
    return dq, dk, dv, _captured_grads(captured, grad_buffers, opts.deterministic)
