"""Host side of the forward kernel: tile choice, autotuning and the launch."""
from __future__ import annotations

import functools
import logging
import math
import struct

from typing import NamedTuple

import torch

from flexcore._runtime import use_interpreter
from flexcore.errors import InputError
from flexcore.fp8 import FP8_DTYPE, OUTPUT_DTYPE, key_major
from flexcore.kernels import hopper, triton_compat
from flexcore.kernels.codegen import load_kernel_module
from flexcore.kernels.launch import (Tuned, arg_key, direct_launches, get_plan, keep_plan, launch, plan_key,
                                     recording)
from flexcore.kernels.tables import (REFINE_BLOCK, BlockTensors, finer_tables, gather_stats,  # noqa: F401
                                     longest_first, refine_key, table_strides, versions)
from flexcore.options import KernelOptions

_log = logging.getLogger("flexcore.dispatch")

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def scale_args(scale: float, dtype: torch.dtype) -> tuple:
    """(SM_SCALE, QK_SCALE_LOG2) as the template kernels take them: scale and scale * log2(e).

    Triton passes a Python float as a float32, which puts every float64 score about 3e-8 off.
    For float64 inputs each is passed as the int64 of its IEEE-754 bits instead, and the kernels
    (ACC_DTYPE float64) bitcast it back to the exact float64.
    """
    scaled = scale * _LOG2E
    if dtype != torch.float64:
        return scale, scaled
    # The int 1 (the bits of 5e-324) would reach the kernel as a constant of triton's
    # specialisation, not an integer: the next subnormal, 1e-323, stands in (the scores differ
    # by a factor of 2 below 1e-20, which no float64 softmax sees).
    return tuple(bits if bits != 1 else 2
                 for bits in (struct.unpack("<q", struct.pack("<d", x))[0] for x in (scale, scaled)))


@functools.lru_cache(maxsize=256)
def output_strides(shape: tuple, query_strides: tuple) -> tuple[int, ...]:
    """Strides of a fresh (B, H, L, Dv) output laid out in the query's stride order, as torch's
    flex_attention allocates it: dimensions filled from the query's smallest stride to its
    largest (equal strides: the inner dimension first), the head dim always innermost."""
    def fill(order):
        strides, step = [0] * len(shape), 1
        for dim in order:
            strides[dim] = step
            step *= shape[dim]
        return strides

    order = sorted(range(len(shape)), key=lambda i: query_strides[i], reverse=True)[::-1]
    strides = fill(order)
    if strides[-1] != 1:  # the kernels store rows of unit stride
        last = len(shape) - 1
        strides = fill([last, *(d for d in order if d != last)])
    return tuple(strides)


def empty_output(q: torch.Tensor, head_dim_v: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised (B, Hq, L, head_dim_v) output of ``dtype`` (default q's) in q's stride order."""
    shape = (*q.shape[:3], head_dim_v)
    return torch.empty_strided(shape, output_strides(shape, tuple(q.stride())), dtype=dtype or q.dtype,
                               device=q.device)


def max_scores(row_stats: torch.Tensor) -> torch.Tensor:
    """The row max of the modded, masked scores (torch's ``AuxOutput.max_scores``), natural units,
    (B, Hq, L) in row_stats' dtype, from the forward's row_stats (whose first row is that max in
    log2 units); -inf on rows without a kept key, +inf on rows with a +inf score."""
    return row_stats[0] * _LN2


def row_stats_from_lse(lse: torch.Tensor) -> torch.Tensor:
    """Row statistics (2, B, H, L) equivalent to ``lse``, for outputs of kernels that keep only lse
    (decoding): max = lse in log2 units and 1/l = 1, i.e. p = exp2(s - lse2)."""
    finite = torch.isfinite(lse)
    row_max = torch.where(finite, lse * _LOG2E, lse)
    return torch.stack([row_max, finite.to(lse.dtype)])


def pad_head_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def fit_tile(preferred: int, block: int, what: str) -> int:
    """Largest power of two <= preferred that divides the mask block (tiles never straddle blocks)."""
    tile = preferred
    while tile >= 16:
        if block % tile == 0:
            return tile
        tile //= 2
    raise InputError(f"BlockMask {what} BLOCK_SIZE {block} is not a multiple of 16; the kernels need "
                     "mask blocks that are multiples of 16 (128 is the usual choice)")


def check_tile(tile: int, block: int, name: str, what: str) -> int:
    """``tile`` (kernel_options[name]) where it divides the mask's ``what`` block; InputError else."""
    if block % tile:
        raise InputError(f"kernel_options[{name!r}] = {tile} does not divide the BlockMask's {what} "
                         f"BLOCK_SIZE {block}; use a power of two that divides it")
    return tile


# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim for 2-byte dtypes, best
# first: 4 warps and 2 stages win at D=128 and D=64 (docs/decisions.md#forward-tiles).
_GPU_CONFIGS = {
    64: [(128, 128, 4, 2), (128, 128, 4, 3), (64, 64, 4, 2)],
    128: [(128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2)],
    256: [(128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2)],
}


def gpu_configs(head_dim_pad: int, itemsize: int) -> list[tuple[int, int, int, int]]:
    key = min((k for k in _GPU_CONFIGS if k >= head_dim_pad), default=256)
    configs = _GPU_CONFIGS[key]
    if itemsize == 4:  # float32 tiles take twice the shared memory: fewer stages, smaller tiles
        configs = [(m, min(n, 64), w, max(1, s - 1)) for m, n, w, s in configs] + [(64, 32, 4, 2)]
    return list(dict.fromkeys(configs))


_autotuners: dict = {}


@functools.lru_cache(maxsize=8)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _tma_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_tma(tensors, head_dims_padded: bool, rule: str = "auto") -> bool:
    """Whether a kernel may read ``tensors`` (B, H, rows, head dim) through tensor descriptors
    (TMA): on Hopper and later, for 2-byte and FP8 dtypes whose rows are contiguous and 16-byte
    aligned, at power-of-two head dims. ``rule`` "on"/"off" (a policy's ``tma``) overrides the GPU check; the
    layout is checked either way. Sets triton's scratch allocator (device-side descriptors live in
    global scratch)."""
    first = tensors[0]
    if rule != "auto":
        wanted = rule == "on"
    else:
        wanted = (not use_interpreter() and first.is_cuda
                  and all(t.element_size() == 2 or t.dtype == FP8_DTYPE for t in tensors)
                  and _capability_major(first.device.index or 0) >= 9)
    if not wanted or not head_dims_padded:
        return False
    for t in tensors:
        if (t.stride(-1) != 1 or t.stride(-2) <= 0 or t.data_ptr() % 16
                or any(st * t.element_size() % 16 for st in t.stride()[:-1])):
            return False
    ensure_tma_allocator()
    return True


def dense_flops(q, k, v) -> float:
    """The call's dense-equivalent forward FLOPs, 2·B·Hq·L·S·(D + Dv): its size before the mask."""
    B, H, L, D = q.shape
    return 2.0 * B * H * L * k.shape[2] * (D + v.shape[3])


def tma_rule(q, k, v, policy) -> str:
    """The forward template's TMA rule for the call: the policy's, except that "auto" is "off" for
    16-bit calls under ``policy.tma_min_flops``: host descriptors and the scratch of device-side ones
    cost such calls more host time than their kernels gain (docs/decisions.md#forward-tma-size)."""
    if (policy.tma == "auto" and q.dtype != FP8_DTYPE
            and dense_flops(q, k, v) < policy.tma_min_flops):
        return "off"
    return policy.tma


def ensure_tma_allocator() -> None:
    """Set triton's scratch allocator where none is set: device-side descriptors live in global
    scratch, which each launch allocates through it. The setting is per thread (a context variable),
    so each launch that may need it makes sure of it (the backward runs in autograd's thread)."""
    triton_compat.ensure_allocator(_tma_allocator)


# K and V through descriptors made on the host over all their rows (kv_rows_descriptor) instead of
# descriptors built by each program, at the policy's kv_rows_head_dims: short rows gain at D=128,
# while at D=64 the 64x64 tiles that sliding windows pick lose (docs/decisions.md#kv-descriptors).


def _all_rows(t: torch.Tensor) -> int:
    """The row count of one descriptor over every row of ``t`` (B, H, L, D), based at t itself with
    row stride ``t.stride(2)``, from which a kernel reads head (b, h) at row
    (b·stride_b + h·stride_h) / stride_row: where the batch and head strides are multiples of the
    row stride (0 included: a broadcast batch or head reads the same rows) and every head starts
    within 2**31 - 1 elements (the kernels compute that offset in int32); 0 otherwise."""
    B, H, L, _ = t.shape
    sb, sh, sm, _ = t.stride()
    if sm <= 0 or sb % sm or sh % sm or (B - 1) * sb + (H - 1) * sh >= 2 ** 31:
        return 0
    return (B - 1) * (sb // sm) + (H - 1) * (sh // sm) + L


def kv_rows_descriptor(t: torch.Tensor, tma: bool, even: bool):
    """A tensor descriptor made on the host over every row of ``t`` (B, H, rows, D) (see _all_rows),
    as the forward reads K and V: blocks of [BLOCK_N, D], whose BLOCK_N ``fit_kv_blocks`` sets per
    launch (64 until then). ``even``: the key tiles never pass the end of a head, which a descriptor
    per head would zero-fill. None where _all_rows refuses t, or ``tma`` or ``even`` is off."""
    rows = _all_rows(t) if tma and even else 0
    return _rows_descriptor(t, rows, 64) if rows else None


def _rows_descriptor(t: torch.Tensor, rows: int, block_n: int):
    """The descriptor of kv_rows_descriptor over ``rows`` rows of ``t``, in blocks of
    [block_n, D] (a plan makes each call's with the BLOCK_N that its first call launched)."""
    descriptor = triton_compat.host_tensor_descriptor()
    return descriptor(t, [rows, t.shape[3]], [t.stride(2), 1], [block_n, t.shape[3]])


def fit_kv_blocks(args: tuple, meta: dict) -> None:
    """Give the K and V descriptors of a forward launch (``args[1:3]``) the launch's BLOCK_N."""
    block_n = meta["BLOCK_N"]
    args[1].block_shape[0] = block_n
    args[2].block_shape[0] = block_n


def _fit_kv_hook(nargs: dict) -> None:  # triton.Config pre_hook: the autotuner's own launches
    fit_kv_blocks((None, nargs["K"], nargs["V"]), nargs)


# The dense path's candidates (masks whose blocks are all full), as _GPU_CONFIGS. Measured on an
# H200 (docs/decisions.md#dense-warp-specialization): at D=64 three stages win on the dense loop.
_DENSE_CONFIGS = {
    64: [(128, 128, 4, 3), (128, 128, 4, 2), (64, 64, 4, 2)],
    128: [(128, 64, 4, 2), (128, 128, 8, 2), (128, 64, 4, 3)],
}
# Warp-specialized candidates of the dense path (triton's `tl.range(..., warp_specialize=True)`),
# tried by the autotuner beside _DENSE_CONFIGS where q_rows_descriptor allows (the policy's
# forward.warp_spec; docs/decisions.md#dense-warp-specialization).
_DENSE_WS_CONFIGS = {128: [(128, 128, 4, 2)]}


def q_rows_descriptor(q: torch.Tensor, tma: bool) -> int:
    """The row count of a descriptor over every row of ``q`` (B, H, L, D) (see _all_rows) when the
    warp-specialized loops may read it that way (K/V read through descriptors, q's rows aligned for
    them); 0 otherwise."""
    rows = _all_rows(q) if tma else 0
    return rows if rows and use_tma((q,), True, "on") else 0


# Candidates over 64x64 mask blocks (the finer tables of flexcore.kernels.tables, or a mask built with
# BLOCK_SIZE=64), where only 64x64 tiles fit: the autotuner picks between two and three stages, since
# each wins on some masks (docs/decisions.md#finer-tables).
_FINE_CONFIGS = {64: [(64, 64, 4, 2), (64, 64, 4, 3)], 128: [(64, 64, 4, 3), (64, 64, 4, 2)]}


# FP8 candidates (both products on the FP8 tensor cores; K/V tiles take half the shared memory of
# 16-bit ones, so three stages fit): a 128x128 tile needs 8 warps for the two float32 tiles (scores
# and accumulator) to stay in registers, a 128x64 one fits 4 (docs/decisions.md#fp8-forward).
_FP8_CONFIGS = {
    64: [(128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)],
    128: [(128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
}


def _candidates(head_dim_pad: int, itemsize: int, dense: bool,
                sparse: tuple[int, int] = (128, 128), fp8: bool = False) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) candidates, best first."""
    if fp8:
        if tuple(sparse) == (64, 64):
            return [(64, 64, 4, 3), (64, 64, 4, 2)]
        return _FP8_CONFIGS[min((k for k in _FP8_CONFIGS if k >= head_dim_pad), default=256)]
    if dense and itemsize == 2 and head_dim_pad in _DENSE_CONFIGS:
        return _DENSE_CONFIGS[head_dim_pad]
    if tuple(sparse) == (64, 64) and itemsize == 2 and head_dim_pad in _FINE_CONFIGS:
        return _FINE_CONFIGS[head_dim_pad]
    return gpu_configs(head_dim_pad, itemsize)


def _fixed_tiles(config: tuple[int, int, int, int], sparse: tuple[int, int], opts: KernelOptions) -> dict:
    """BLOCK_M, BLOCK_N, num_warps and num_stages of one candidate ``config``, fitted to the mask's
    ``sparse`` blocks; the options' own values, where given, take precedence (checked)."""
    m, n, w, s = config
    sparse_q, sparse_kv = sparse
    bm = check_tile(opts.BLOCK_M, sparse_q, "BLOCK_M", "query") if opts.BLOCK_M else fit_tile(m, sparse_q, "query")
    bn = check_tile(opts.BLOCK_N, sparse_kv, "BLOCK_N", "key") if opts.BLOCK_N else fit_tile(n, sparse_kv, "key")
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=opts.num_warps or w, num_stages=opts.num_stages or s)


def _interpreter_tiles(sparse: tuple[int, int], opts: KernelOptions) -> dict:
    """BLOCK_M and BLOCK_N under the interpreter, for the eager and the inline forward alike: 64 (it
    costs the same per loop step whatever the tile), fitted to the mask's ``sparse`` blocks; the
    options' own values, where given, take precedence (checked). A row's products may round
    otherwise with BLOCK_M (numpy's matmul of a (BLOCK_M, D) tile, per BLAS kernel), so both
    forwards take the same tiles and the backwards that read their row statistics agree bit for bit."""
    sparse_q, sparse_kv = sparse
    bm = check_tile(opts.BLOCK_M, sparse_q, "BLOCK_M", "query") if opts.BLOCK_M else fit_tile(64, sparse_q, "query")
    bn = check_tile(opts.BLOCK_N, sparse_kv, "BLOCK_N", "key") if opts.BLOCK_N else fit_tile(64, sparse_kv, "key")
    return dict(BLOCK_M=bm, BLOCK_N=bn)


def _launcher(module, head_dim_pad, dtype, sparse, opts: KernelOptions, q_len: int,
              dense: bool = False, warp_spec: bool = False, kv_rows: bool = False):
    """Return (kernel, fixed_meta) where fixed_meta holds the tile constexprs when not autotuning.
    ``warp_spec``: the dense path may use the warp-specialized candidates (q_rows_descriptor).
    ``kv_rows``: K and V are host descriptors (kv_rows_descriptor), whose blocks follow each
    configuration."""
    kernel = module.flex_forward_kernel
    sparse_q, sparse_kv = sparse
    warp_spec = dense and warp_spec  # forward() passes it only where the policy allows it
    ws_only = warp_spec and opts.dispatch.forward.warp_spec == "on"
    if use_interpreter():
        return kernel, dict(_interpreter_tiles(sparse, opts), **({"WARP_SPEC": True} if ws_only else {}))
    itemsize = torch.empty((), dtype=dtype).element_size()
    # ((BLOCK_M, BLOCK_N, num_warps, num_stages), warp-specialized), best first.
    candidates = [(c, False) for c in _candidates(head_dim_pad, itemsize, dense, sparse, dtype == FP8_DTYPE)]
    if warp_spec and itemsize == 2:
        ws = [(c, True) for c in _DENSE_WS_CONFIGS.get(head_dim_pad, [])]
        candidates = ws if ws_only and ws else candidates + ws
    if opts.BLOCK_M or opts.BLOCK_N or not opts.autotune:
        config, ws = candidates[0]
        return kernel, dict(_fixed_tiles(config, sparse, opts), **({"WARP_SPEC": True} if ws else {}))
    import triton

    length_bucket = min(max(q_len, 1).bit_length(), 15)
    key = (module.__name__, head_dim_pad, dtype, sparse, length_bucket, opts.num_warps, opts.num_stages,
           tuple(candidates), kv_rows)
    tuner = _autotuners.get(key)
    if tuner is None:
        configs = []
        for (m, n, w, s), ws in candidates:
            if sparse_q % m or sparse_kv % n:
                continue
            configs.append(triton.Config({"BLOCK_M": m, "BLOCK_N": n, **({"WARP_SPEC": True} if ws else {})},
                                         num_warps=opts.num_warps or w, num_stages=opts.num_stages or s,
                                         pre_hook=_fit_kv_hook if kv_rows else None))
        if not configs:
            m, n = fit_tile(128, sparse_q, "query"), fit_tile(64, sparse_kv, "key")
            configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=2)]
        tuner = (Tuned(triton.autotune(configs=configs, key=[])(kernel), fit_kv_blocks if kv_rows else None)
                 if len(configs) > 1 else None)
        _autotuners[key] = tuner or configs[0]
        tuner = _autotuners[key]
    if isinstance(tuner, triton.Config):
        return kernel, dict(tuner.kwargs, num_warps=tuner.num_warps, num_stages=tuner.num_stages)
    return tuner, {}


# Launch order of the forward's tiles (the policy's forward.schedule_group): longest rows first within
# groups of mask rows, so that the grid's last programs are short; rows of a few blocks keep the
# natural order, which shares K/V in L2 better (docs/decisions.md#launch-order).
# The Gluon masked kernel keeps the mask's own tables unless their rows are skewed (the policy's
# forward.refine_skew): there the template over the finer tables, launched longest first, is faster
# (docs/decisions.md#finer-tables). At head dim 64 the finer tables come first wherever they are
# taken (gluon.union_yields, docs/decisions.md#gluon-union-lists).


def refined(blocks: BlockTensors, q, k, v, score_lowered, mask_lowered, scale: float,
            opts: KernelOptions) -> BlockTensors:
    """The tables the forward kernel reads: ``blocks`` or the same mask over finer blocks (see
    the policy's forward.refine and forward.refine_skew)."""
    def serves_own():
        if not hopper.applies_masked(q, k, v, score_lowered, blocks, False, scale, opts):
            return False
        policy = opts.dispatch
        if policy.gluon.masked == "on":  # forced: the Gluon kernel reads the mask's own tables
            return True
        tiles = hopper.MASKED_TILES.get(q.shape[3])
        if policy.gluon.union_yields and tiles is not None and tiles.num_wg == 3:  # head dim 64
            return False
        rows = math.ceil(q.shape[2] / blocks.sparse_block[0])
        stats = blocks.stats(rows)
        entries = blocks.num_blocks[..., :rows].numel()
        return stats is None or stats[1] * entries <= policy.forward.refine_skew * stats[2]

    found = finer_tables(blocks, q.shape[2], mask_lowered, opts, serves_own)
    return blocks if found is None else found[0]


def forward(q, k, v, score_lowered, mask_lowered, blocks: BlockTensors, scale: float,
            opts: KernelOptions, descales=None, sinks=None):
    """Run the forward kernel.

    Args:
        descales: a :class:`flexcore.fp8.Descales` for float8_e4m3fn q, k, v (None otherwise):
            the FP8 path, whose output is bfloat16; V is read key-major (flexcore.fp8.key_major).
        sinks: (Hq,) floating tensor on q's device, one finite logit per query head, or None:
            each joins its rows' softmax denominator in the kernels' epilogue (flexcore.sinks).

    Returns:
        out (B, Hq, L, Dv) in q's dtype (bfloat16 for FP8) and q's stride order (as torch's
        flex_attention); lse (B, Hq, L) float32 (float64 for float64 inputs, computed in float64
        throughout), natural log, -inf on rows without a kept key and +inf on rows with a +inf score; row_stats
        (2, B, Hq, L) of lse's dtype: the row max of the modded, masked scores in log2 units
        (:func:`max_scores` gives it in natural units) and 1/(row sum of exp2(s - max)), which the
        backward recomputes probabilities from. With ``sinks``: lse includes the sink
        (``logaddexp(lse_of_scores, sinks[h])``), the row max stays the scores' own, and the
        second row is 2^(max - m')/l' (m' the larger of the row max and the sink in log2 units, l'
        the row sum with the sink, both relative to m'), so that exp2(s - max) times it is each
        key's probability with the sink in (the backward kernels need no change).
    """
    caps = (*score_lowered.kernel_args(), *mask_lowered.kernel_args())
    if descales is not None:
        v = key_major(v)
    if sinks is not None and sinks.stride(0) != 1:  # the kernels read sinks[h] at SINKS + h
        sinks = sinks.contiguous()
    key = _plan_key(q, k, v, score_lowered, mask_lowered, blocks, scale, opts, caps, descales, sinks)
    if key is None:
        used = refined(blocks, q, k, v, score_lowered, mask_lowered, scale, opts)
        return _forward(q, k, v, score_lowered, mask_lowered, used, scale, opts, caps, descales, sinks)[0]
    plan = get_plan(key)
    if plan is not None:  # it holds the tables that refined chose (the key has what it read)
        return plan(q, k, v, caps, descales, sinks)
    used = refined(blocks, q, k, v, score_lowered, mask_lowered, scale, opts)
    with recording() as record:
        result, fixed, kv_desc = _forward(q, k, v, score_lowered, mask_lowered, used, scale, opts, caps,
                                          descales, sinks)
    if fixed is None:  # a Gluon kernel served the call: a repeated call goes straight to it
        keep_plan(key, _HopperPlan(scale, kv_desc, opts.dispatch.launch), (blocks,))
        return result
    launches = direct_launches(record, 1)
    if launches is not None:
        keep_plan(key, _ForwardPlan(*launches[0], fixed, kv_desc, result), (blocks,))
    return result


def _plan_key(q, k, v, score_lowered, mask_lowered, blocks, scale, opts, caps, descales=None, sinks=None):
    """Everything the forward's host decisions read besides the mask tables' statistics (fixed
    for ``blocks``): see flexcore.kernels.launch's per-call plans. None where plans are off. The
    mods count by their sources and traits, not their captured tensors (which each call passes):
    a key never keeps a tensor alive; nor do the sinks, keyed by dtype and alignment (each call
    passes its own). ``opts`` carries the dispatch policy."""
    return plan_key(
        opts.dispatch.launch, "forward", score_lowered.source, mask_lowered.source, score_lowered.is_trivial,
        bool(score_lowered.captured), id(blocks), q.device, q.dtype, k.dtype, v.dtype,
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
        q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, scale, opts,
        arg_key(caps) if caps else (), refine_key(mask_lowered),
        None if descales is None else (descales.layout, arg_key(descales[:3])),
        None if sinks is None else arg_key((sinks,)))


class _ForwardPlan:
    """A repeated forward call (see flexcore.kernels.launch's per-call plans): its compiled
    kernel, grid and integer arguments, and the descriptors' layout where K and V are host
    descriptors."""

    __slots__ = ("entry", "grid", "fixed", "kv_desc", "out_shape", "out_strides", "lse_shape",
                 "stats_shape", "acc_dtype", "out_dtype")

    def __init__(self, entry, grid, fixed, kv_desc, result):
        out, lse, row_stats = result
        self.entry, self.grid, self.fixed, self.kv_desc = entry, grid, fixed, kv_desc
        self.out_shape, self.lse_shape, self.stats_shape = out.shape, lse.shape, row_stats.shape
        self.out_strides = out.stride()  # q's stride order; q's strides are in the plan's key
        self.acc_dtype, self.out_dtype = lse.dtype, out.dtype

    def __call__(self, q, k, v, caps, descales=None, sinks=None):
        device = q.device
        out = torch.empty_strided(self.out_shape, self.out_strides, dtype=self.out_dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=self.acc_dtype, device=device)
        row_stats = torch.empty(self.stats_shape, dtype=self.acc_dtype, device=device)
        if self.kv_desc is not None:
            (k_rows, v_rows), block_n = self.kv_desc
            k, v = _rows_descriptor(k, k_rows, block_n), _rows_descriptor(v, v_rows, block_n)
        ensure_tma_allocator()  # per thread; cheap where set (use_tma set it on the first call)
        scales = (lse, lse, lse) if descales is None else descales[:3]
        self.entry.launch(self.grid, (q, k, v, out, lse, row_stats, *scales, lse if sinks is None else sinks,
                                      *self.fixed, *caps))
        return out, lse, row_stats


class _HopperPlan:
    """A repeated forward call that flexcore.kernels.hopper serves (the key fixes everything its
    choice read: shapes, strides, alignments, dtypes, device, mask, mods, scale and options)."""

    __slots__ = ("scale", "masked", "policy")

    def __init__(self, scale, masked, policy):
        self.scale = scale
        self.masked = masked  # the masked kernel's launch with the mask's tables, or None (dense)
        self.policy = policy  # the LaunchPolicy of the dense kernel's launch

    def __call__(self, q, k, v, caps, descales=None, sinks=None):
        if self.masked is not None:
            return self.masked(q, k, v, caps=caps, sinks=sinks, descales=descales)
        return hopper.forward(q, k, v, self.scale, sinks, descales, self.policy)


class TemplateChoice(NamedTuple):
    """What the Triton forward template runs for a call (:func:`template_choice`)."""

    dense: bool          # all-full mask: every key tile, no tables
    tma: bool            # K/V through tensor descriptors
    full_runs: bool      # runs of full blocks stepped over from their first index
    q_desc_rows: int     # > 0: the warp-specialized dense candidates may run
    k_desc: object       # host descriptors over all rows of K and V, or None
    v_desc: object
    kernel: object       # the kernel or its autotuner
    meta: dict           # fixed tile constexprs and launch knobs ({} where autotuned)
    order: object        # the launch order (longest rows first) or None


def is_dense(blocks: BlockTensors, q_len: int, kv_len: int, opts: KernelOptions) -> bool:
    """Whether the forward takes the dense path: the policy allows it and every block is full."""
    sparse_q, sparse_kv = blocks.sparse_block
    return opts.dispatch.forward.dense and blocks.all_full(math.ceil(q_len / sparse_q),
                                                           math.ceil(kv_len / sparse_kv))


def gluon_choice(q, k, v, score_lowered, mask_lowered, blocks: BlockTensors, dense: bool, scale: float,
                 opts: KernelOptions):
    """Which Gluon forward may serve the call: ("dense", None), ("masked", (module, table
    arguments, has full blocks)) or None (the Triton template)."""
    if hopper.applies(q, k, v, score_lowered, dense, scale, opts):
        return "dense", None
    if hopper.applies_masked(q, k, v, score_lowered, blocks, dense, scale, opts):
        module = hopper.masked_module(mask_lowered)
        found = None if module is None else hopper.masked_tables(blocks, q.shape[2], k.shape[2], q.shape[3],
                                                                  opts)
        if found is not None:
            return "masked", (module, *found)
    return None


def template_choice(q, k, v, score_lowered, module, blocks: BlockTensors, dense: bool,
                    opts: KernelOptions) -> TemplateChoice:
    """The Triton template's paths, descriptors, tiles and launch order for the call (no launch)."""
    L, D = q.shape[2], q.shape[3]
    S, Dv = k.shape[2], v.shape[3]
    policy = opts.dispatch.forward
    sparse_q, sparse_kv = blocks.sparse_block
    q_rows = math.ceil(L / sparse_q)
    head_dim_pad, head_dim_v_pad = pad_head_dim(D), pad_head_dim(Dv)
    # FP8 reads V key-major (flexcore.fp8.key_major): its descriptor runs over V's transpose.
    v_rows = v.transpose(2, 3) if q.dtype == FP8_DTYPE else v
    tma = use_tma((k, v_rows), head_dim_pad == D and head_dim_v_pad == Dv, tma_rule(q, k, v, policy))
    runs = policy.full_runs and not dense and blocks.full_runs(q_rows)
    # Warp specialization only without captured tensors: a score_mod that loads from one inside
    # the loop (a relative-position table) gives wrong results under it (docs/decisions.md#dense-warp-specialization).
    q_desc_rows = (q_rows_descriptor(q, tma) if dense and policy.warp_spec != "off"
                   and not score_lowered.captured else 0)
    even_kv = S % sparse_kv == 0  # tiles divide the mask blocks: no tile passes KV_LEN
    k_desc = v_desc = None
    if policy.kv_rows == "on" or (policy.kv_rows == "auto"
                                  and max(head_dim_pad, head_dim_v_pad) in policy.kv_rows_head_dims):
        k_desc, v_desc = kv_rows_descriptor(k, tma, even_kv), kv_rows_descriptor(v, tma, even_kv)
        if k_desc is None or v_desc is None:
            k_desc = v_desc = None
    kernel, meta = _launcher(module, max(head_dim_pad, head_dim_v_pad), q.dtype, blocks.sparse_block,
                             opts, L, dense, q_desc_rows > 0, k_desc is not None)
    group = policy.schedule_group
    order = None if group is None or dense else blocks.schedule(q_rows, group, policy.schedule_min_blocks)
    return TemplateChoice(dense, tma, runs, q_desc_rows, k_desc, v_desc, kernel, meta, order)


def _forward(q, k, v, score_lowered, mask_lowered, blocks: BlockTensors, scale: float,
             opts: KernelOptions, caps: tuple, descales=None, sinks=None):
    """forward's decisions and launch: ((out, lse, row_stats), the integer arguments between the
    tensors and the captures, ((K rows, V rows), BLOCK_N) of host descriptors or None). Where
    flexcore.kernels.hopper serves the call: (its result, None, None for the dense kernel or the
    masked kernel's launch with the mask's tables bound). ``sinks``: see :func:`forward`."""
    B, Hq, L, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    sparse_q = blocks.sparse_block[0]
    dense = is_dense(blocks, L, S, opts)
    gluon = gluon_choice(q, k, v, score_lowered, mask_lowered, blocks, dense, scale, opts)
    sink_note = "" if sinks is None else ", sinks in the epilogue"
    if gluon is not None and gluon[0] == "dense":
        result = hopper.forward(q, k, v, scale, sinks, descales, opts.dispatch.launch)
        if result is not None:
            _log.debug("forward: Gluon dense kernel (head dim %d, %s%s)", D, q.dtype, sink_note)
            return result, None, None
    elif gluon is not None:
        module, table_args, has_full = gluon[1]
        run = functools.partial(hopper.forward_masked, module=module, table_args=table_args,
                                has_full=has_full, scale=scale, policy=opts.dispatch.launch,
                                key=hopper.masked_forward_key(mask_lowered, q.dtype, D, sinks is not None))
        result = run(q, k, v, caps=caps, sinks=sinks, descales=descales)
        if result is not None:
            _log.debug("forward: Gluon masked kernel (head dim %d, %s%s)", D, q.dtype, sink_note)
            return result, None, run
    module = load_kernel_module("forward.py.tmpl", score_lowered, mask_lowered)
    fp8 = descales is not None
    out, lse, row_stats = _outputs(q, Dv, fp8)
    choice = template_choice(q, k, v, score_lowered, module, blocks, dense, opts)
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("forward: Triton template, tables %s, dense=%s full_runs=%s tma=%s kv_rows=%s "
                   "warp_spec_candidates=%s ordered=%s tiles=%s%s", blocks.sparse_block, choice.dense,
                   choice.full_runs, choice.tma, choice.k_desc is not None, choice.q_desc_rows > 0,
                   choice.order is not None, choice.meta or "autotuned", sink_note)
    tma, runs, q_desc_rows, order = choice.tma, choice.full_runs, choice.q_desc_rows, choice.order
    k_desc, v_desc, kernel, meta = choice.k_desc, choice.v_desc, choice.kernel, choice.meta
    kv_rows = k_desc is not None
    args, fixed, constexprs = _template_args(
        q, k, v, out, lse, row_stats, blocks, order, q_desc_rows, score_lowered, scale, opts, caps,
        descales, sinks, stand_in=lse, dense=dense, tma=tma, runs=runs, k_desc=k_desc, v_desc=v_desc)
    if order is not None:
        def grid(bm, _bn):  # one program per tile, in the order's order
            return (order.numel() * (sparse_q // bm), 1)
    else:
        def grid(bm, _bn):
            return (math.ceil(L / bm), B * Hq)
    if meta:  # one fixed configuration: fall back to smaller tiles if it does not fit the GPU
        meta = dict(meta)
        bm, bn = meta.pop("BLOCK_M"), meta.pop("BLOCK_N")
        launch(kernel, grid, args, bm, bn, meta, constexprs, pinned=opts.pins_tiles,
               fit=fit_kv_blocks if kv_rows else None, policy=opts.dispatch.launch)
    else:  # the autotuner skips configurations that do not fit
        kernel.launch(lambda meta_: grid(meta_["BLOCK_M"], meta_["BLOCK_N"]), args, constexprs,
                      policy=opts.dispatch.launch)
    kv_desc = None
    if kv_rows:  # the rows and the BLOCK_N that the launch gave them (fit_kv_blocks)
        kv_desc = ((k_desc.shape[0], v_desc.shape[0]), k_desc.block_shape[0])
    return (out, lse, row_stats), fixed, kv_desc


def _outputs(q, head_dim_v: int, fp8: bool):
    """Fresh (out, lse, row_stats) of the forward kernel (see :func:`forward`)."""
    B, Hq, L = q.shape[:3]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = empty_output(q, head_dim_v, OUTPUT_DTYPE if fp8 else None)
    lse = torch.empty((B, Hq, L), dtype=acc_dtype, device=q.device)
    row_stats = torch.empty((2, B, Hq, L), dtype=acc_dtype, device=q.device)  # see RowStats
    return out, lse, row_stats


def _template_args(q, k, v, out, lse, row_stats, blocks: BlockTensors, order, q_desc_rows: int,
                   score_lowered, scale: float, opts: KernelOptions, caps: tuple, descales, sinks,
                   *, stand_in, dense: bool, tma: bool, runs: bool, k_desc=None, v_desc=None):
    """(arguments, fixed, constexprs) of the Triton template: the arguments are (tensors of the
    call, fixed, captures), and a plan keeps ``fixed``. ``k_desc``/``v_desc``: host descriptors
    that the kernel reads K and V through, or None; ``stand_in`` takes the place of the pointers
    the call does not read (descales without FP8, sinks without sinks)."""
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    sparse_q, sparse_kv = blocks.sparse_block
    fp8 = descales is not None
    full_n, full_i = blocks.full_tables()
    fixed = (
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        blocks.num_blocks, blocks.indices, full_n, full_i,
        *table_strides(blocks.num_blocks), *table_strides(blocks.indices)[:3],
        *table_strides(full_n), *table_strides(full_i)[:3],
        order if order is not None else blocks.num_blocks, math.ceil(L / sparse_q), q_desc_rows,
        B * Hq * L, L, S, Hq, *scale_args(scale, q.dtype),
        *(descales.layout if fp8 else (0,) * 7),
    )
    # The descale tensors and the sinks are per call, as the captures (a plan passes each call's).
    scales = descales[:3] if fp8 else (stand_in,) * 3
    args = (q, k if k_desc is None else k_desc, v if v_desc is None else v_desc, out, lse, row_stats,
            *scales, stand_in if sinks is None else sinks, *fixed, *caps)
    upcast = use_interpreter() and q.dtype in (torch.float16, torch.bfloat16, FP8_DTYPE)
    constexprs = dict(
        GQA_GROUP=Hq // Hkv,
        HEAD_DIM=D, HEAD_DIM_PAD=pad_head_dim(D), HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=pad_head_dim(Dv),
        SPARSE_Q_BLOCK=sparse_q, SPARSE_KV_BLOCK=sparse_kv,
        HAS_FULL_BLOCKS=blocks.full_num_blocks is not None,
        EVEN_Q=L % sparse_q == 0,  # tiles divide mask blocks, so this covers every BLOCK_M
        EVEN_KV=S % sparse_kv == 0,
        # The trivial path folds the scale into the row max, which needs scale > 0.
        SCORE_IS_TRIVIAL=score_lowered.is_trivial and scale > 0, UPCAST_DOT=upcast,
        INPUT_PRECISION="tf32" if (opts.allow_tf32 and not use_interpreter()) else "ieee",
        ACC_FP64=q.dtype == torch.float64,
        USE_TMA=tma, USE_ORDER=order is not None, DENSE=dense, FULL_RUNS=runs,
        KV_ROWS=k_desc is not None, FP8=fp8, HAS_SINKS=sinks is not None,
    )
    return args, fixed, constexprs


# The key-block tables of a call without a mask on the inline path: DENSE visits every key tile
# and reads no table, so one int32 zero stands in for each.
_DENSE_SPARSE_BLOCK = (128, 128)


def forward_inline(q, k, v, score_lowered, mask_lowered, blocks: BlockTensors | None, scale: float,
                   opts: KernelOptions):
    """(out, lse, row_stats) of the Triton template launched through ``torch.library.wrap_triton``,
    for the compiled call that Inductor launches itself (flexcore.ops, "inline" forward). Every
    decision reads shapes, dtypes and options only (no table statistics, timings or host
    descriptors), so that it can be traced with fake tensors: natural launch order, pointer loads,
    the first tile candidate (under the interpreter, the eager forward's: _interpreter_tiles).
    ``blocks`` None: no mask (the dense path)."""
    from torch.library import wrap_triton

    B, Hq, L, D = q.shape
    Dv = v.shape[3]
    dense = blocks is None
    if dense:
        zero = torch.empty((1, 1, 1), dtype=torch.int32, device=q.device)  # never read (DENSE)
        blocks = BlockTensors(zero, zero.unsqueeze(-1), None, None, _DENSE_SPARSE_BLOCK)
    out, lse, row_stats = _outputs(q, Dv, False)
    caps = (*score_lowered.kernel_args(), *mask_lowered.kernel_args())
    # The unread descale and sinks pointers: a table the kernel only reads (a tensor the kernel
    # writes would be a second, aliased output to Inductor), not an allocation per call.
    args, _, constexprs = _template_args(q, k, v, out, lse, row_stats, blocks, None, 0, score_lowered,
                                         scale, opts, caps, None, None, stand_in=blocks.num_blocks,
                                         dense=dense, tma=False, runs=False)
    kernel = load_kernel_module("forward.py.tmpl", score_lowered, mask_lowered).flex_forward_kernel
    tiles = (_interpreter_tiles(blocks.sparse_block, opts) if use_interpreter() else
             _fixed_tiles(_candidates(max(pad_head_dim(D), pad_head_dim(Dv)), q.element_size(), dense,
                                      blocks.sparse_block)[0], blocks.sparse_block, opts))
    # torch's kernel wrapper binds arguments by name without the signature's defaults: pass every
    # constexpr.
    for name, default in _constexpr_defaults(kernel).items():
        constexprs.setdefault(name, default)
    wrap_triton(kernel)[((L + tiles["BLOCK_M"] - 1) // tiles["BLOCK_M"], B * Hq, 1)](*args, **constexprs, **tiles)
    return out, lse, row_stats


@functools.lru_cache(maxsize=64)
def _constexpr_defaults(kernel) -> dict:
    import inspect

    return {name: p.default for name, p in inspect.signature(kernel.fn).parameters.items()
            if p.default is not inspect.Parameter.empty}
