"""Host side of the forward kernel: tile choice, autotuning and the launch."""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field

import torch

from flexcore._runtime import capturing, use_interpreter
from flexcore.errors import InputError
from flexcore.kernels import hopper
from flexcore.kernels.codegen import load_kernel_module
from flexcore.kernels.launch import (Tuned, arg_key, direct_launches, get_plan, keep_plan, launch, plan_key,
                                     recording)
from flexcore.options import KernelOptions

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
    return tuple(struct.unpack("<q", struct.pack("<d", x))[0] for x in (scale, scaled))


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


def empty_output(q: torch.Tensor, head_dim_v: int) -> torch.Tensor:
    """An uninitialised (B, Hq, L, head_dim_v) output of q's dtype in q's stride order."""
    shape = (*q.shape[:3], head_dim_v)
    return torch.empty_strided(shape, output_strides(shape, tuple(q.stride())), dtype=q.dtype, device=q.device)


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


@dataclass(frozen=True)
class BlockTensors:
    """The BlockMask tensors a kernel reads, expanded to (B, H, ...) (stride 0 where broadcast)."""

    num_blocks: torch.Tensor
    indices: torch.Tensor
    full_num_blocks: torch.Tensor | None
    full_indices: torch.Tensor | None
    sparse_block: tuple[int, int]  # (rows, cols) of one mask block along this iteration

    # Schedules computed for these tables (see schedule). ``expanded`` may share one dict that
    # lives as long as the BlockMask, so that a CUDA graph that captured an order keeps it.
    _orders: dict = field(default_factory=dict, compare=False, repr=False)
    # ``refine(captured, compute)``: the same mask's tables over finer blocks, their transpose and
    # their cost relative to these ((BlockTensors, BlockTensors, ratio), see finer_tables), or
    # None; ``compute`` False answers
    # only what is already known (inside a CUDA graph capture). Set by flexcore.attention.
    refine: object = field(default=None, compare=False, repr=False)

    @classmethod
    def expanded(cls, num_blocks, indices, full_num_blocks, full_indices, sparse_block,
                 B: int, H: int, orders: dict | None = None, refine=None) -> "BlockTensors":
        """Tables of shape (1 or B, 1 or H, ...) viewed as (B, H, ...) without a copy. ``orders``:
        where to keep the schedules (a new dict by default); ``refine``: see the field."""
        def expand(t):
            return None if t is None else t.expand(B, H, *t.shape[2:])

        return cls(expand(num_blocks), expand(indices), expand(full_num_blocks),
                   expand(full_indices), tuple(sparse_block), {} if orders is None else orders, refine)

    def full_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(full_num_blocks, full_indices); for tables without full blocks, the partial ones stand in
        as the kernels' pointer arguments (HAS_FULL_BLOCKS is then False and they are not read)."""
        if self.full_num_blocks is None:
            return self.num_blocks, self.indices
        return self.full_num_blocks, self.full_indices

    def schedule(self, rows: int, group: int, min_mean_blocks: float = 0.0) -> torch.Tensor | None:
        """int32 launch order of the (batch·head, mask row) tiles of the first ``rows`` mask rows,
        flattened as ``bh * rows + row``, or None where the natural order serves as well.

        Tiles are taken ``group`` at a time in their natural order (neighbouring heads and rows
        share key and value blocks in L2); within each group the longest run first, so that the
        last programs of the grid are short and no SM idles behind a long one. Length counts
        partial blocks 5/4 of a full one (:meth:`row_cost`). None when every row has the same work
        (nothing to reorder) or when rows visit fewer than ``min_mean_blocks`` blocks on average.
        Cached per (B, H, rows, group, min_mean_blocks); computing it needs :meth:`stats`, so
        inside a CUDA graph capture it answers None until a call outside one has computed them.
        """
        key = (*self.num_blocks.shape[:2], rows, group, min_mean_blocks)
        if key not in self._orders:
            stats = self.stats(rows)
            if stats is None:
                return None
            low, high = stats[:2]
            order = None
            if low != high and self.visits_on_average(rows, min_mean_blocks):
                order = longest_first(self.row_cost(rows).reshape(-1), group).to(torch.int32)
            self._orders[key] = order
        return self._orders[key]

    def visits_on_average(self, rows: int, blocks: float) -> bool:
        """Whether the first ``rows`` mask rows of every batch and head visit ``blocks`` key blocks
        or more on average, counted as :meth:`row_cost` does (a partial block 5/4 of a full one).
        False inside a CUDA graph capture until a call outside one has computed :meth:`stats`."""
        stats = self.stats(rows)
        return stats is not None and stats[2] >= 4 * blocks * self.num_blocks[..., :rows].numel()

    def stats(self, rows: int) -> tuple[int, int, int, int, int, int] | None:
        """Over the first ``rows`` mask rows of every batch and head: the least, most and total
        :meth:`row_cost`, the total partial blocks, the least full blocks, and the number of rows
        whose full blocks are not one ascending run of consecutive blocks; all 0 when there are
        none. One read-back from the device (shared with other tables by :func:`gather_stats`),
        cached per (B, H, rows) as long as the schedules are; None inside a CUDA graph capture when
        not computed yet (a read-back would break the capture)."""
        key = self._stats_key(rows)
        if key not in self._orders:
            if capturing():
                return None
            gather_stats([(self, rows)])
        return self._orders[key]

    def _stats_key(self, rows: int) -> tuple:
        return ("stats", *self.num_blocks.shape[:2], rows)

    def _stat_terms(self, rows: int) -> torch.Tensor:
        """:meth:`stats` as a device tensor of six int64 values (no read-back)."""
        cost = self.row_cost(rows)
        if not cost.numel():
            return torch.zeros(6, dtype=torch.int64, device=cost.device)
        full_low = broken = cost.new_zeros(())
        if self.full_num_blocks is not None:
            # Listed indices increase strictly (BlockMask checks it): a row is one run when its last
            # listed index is its first plus the count less one.
            # Only (B, H, rows) values are gathered: the tables may be broadcast views.
            n = self.full_num_blocks[..., :rows].to(torch.int64)
            idx = self.full_indices[..., :rows, :]
            last = idx.gather(-1, (n - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1).to(torch.int64)
            broken = ((n > 0) & (last - idx[..., 0].to(torch.int64) != n - 1)).sum()
            full_low = n.min()
        return torch.stack([cost.min(), cost.max(), cost.sum(),
                            self.num_blocks[..., :rows].sum().to(torch.int64), full_low, broken])

    def full_runs(self, rows: int) -> bool:
        """Whether the full blocks of each of the first ``rows`` mask rows are one ascending run
        of consecutive blocks (causal, sliding-window, prefix and document masks): the forward
        then steps over them from the first index instead of reading one index per tile. False
        inside a CUDA graph capture until a call outside one has computed :meth:`stats`."""
        if self.full_num_blocks is None:
            return False
        stats = self.stats(rows)
        return stats is not None and stats[5] == 0

    def all_full(self, rows: int, kv_blocks: int) -> bool:
        """Whether each of the first ``rows`` mask rows lists all ``kv_blocks`` key blocks as full
        blocks and none as partial (no mask, noop_mask): the forward's dense path then visits
        every key tile without reading the tables. False inside a CUDA graph capture until a call
        outside one has computed :meth:`stats`."""
        if self.full_num_blocks is None or kv_blocks <= 0:
            return False
        stats = self.stats(rows)
        return stats is not None and stats[3] == 0 and stats[4] == kv_blocks and rows > 0

    def row_cost(self, rows: int) -> torch.Tensor:
        """(B, H, rows) int64: the work of each of the first ``rows`` mask rows, in quarter blocks:
        a full block counts 4 and a partial one 5 (its mask hook runs per element)."""
        cost = self.num_blocks[..., :rows].to(torch.int64) * 5
        if self.full_num_blocks is not None:
            cost = cost + self.full_num_blocks[..., :rows].to(torch.int64) * 4
        return cost


def _read_back(values: torch.Tensor) -> list:
    """The host's copy of ``values`` (a synchronising read-back; one per call)."""
    return values.tolist()


def gather_stats(pairs) -> None:
    """Compute :meth:`BlockTensors.stats` of several ``(blocks, rows)`` pairs with one read-back
    (e.g. the forward's key-block tables and the backward's transposed tables of a new mask, so
    that a training step with a new mask waits on the GPU once, not twice). Pairs already computed
    are skipped; nothing is computed inside a CUDA graph capture."""
    todo = [(blocks, rows) for blocks, rows in pairs if blocks._stats_key(rows) not in blocks._orders]
    if not todo or capturing():
        return
    values = _read_back(torch.stack([blocks._stat_terms(rows) for blocks, rows in todo]))
    for (blocks, rows), row in zip(todo, values):
        blocks._orders[blocks._stats_key(rows)] = tuple(int(x) for x in row)


def longest_first(cost: torch.Tensor, group: int) -> torch.Tensor:
    """Indices that order the 1-d int64 ``cost`` longest first within consecutive groups of
    ``group`` entries (all of them if ``group`` <= 0; ties keep their order); the groups stay in
    their order."""
    if not cost.numel():
        return torch.zeros(0, dtype=torch.int64, device=cost.device)
    chunk = torch.arange(cost.numel(), device=cost.device) // (group if group > 0 else cost.numel())
    key = chunk * (1 << 40) - cost  # costs stay far below 2**40: no read-back of the maximum
    return torch.argsort(key, stable=True)


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


def _check_tile(tile: int, block: int, name: str, what: str) -> int:
    if block % tile:
        raise InputError(f"kernel_options[{name!r}] = {tile} does not divide the BlockMask's {what} "
                         f"BLOCK_SIZE {block}; use a power of two that divides it")
    return tile


# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim for 2-byte dtypes, best
# first. Measured on an H200 with triton 3.6 (docs/decisions.md): 4 warps and 2 stages win at D=128
# and D=64 (at D=64 128x128 tiles, 1-3% ahead of 3 stages).
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

# Tensor descriptors (TMA) for the K/V tiles: None decides by the GPU and the layout (see
# use_tma); True/False force them (benchmarks, tests).
TMA: bool | None = None


@functools.lru_cache(maxsize=8)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _tma_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_tma(tensors, head_dims_padded: bool, force: bool | None = None) -> bool:
    """Whether a kernel may read ``tensors`` (B, H, rows, head dim) through tensor descriptors
    (TMA): on Hopper and later, for 2-byte dtypes whose rows are contiguous and 16-byte aligned, at
    power-of-two head dims. ``force`` True/False overrides the GPU check (benchmarks, tests); the
    layout is checked either way. Sets triton's scratch allocator (device-side descriptors live in
    global scratch)."""
    first = tensors[0]
    if force is not None:
        wanted = force
    else:
        wanted = (not use_interpreter() and first.is_cuda and all(t.element_size() == 2 for t in tensors)
                  and _capability_major(first.device.index or 0) >= 9)
    if not wanted or not head_dims_padded:
        return False
    for t in tensors:
        if (t.stride(-1) != 1 or t.stride(-2) <= 0 or t.data_ptr() % 16
                or any(st * t.element_size() % 16 for st in t.stride()[:-1])):
            return False
    ensure_tma_allocator()
    return True


def ensure_tma_allocator() -> None:
    """Set triton's scratch allocator where none is set: device-side descriptors live in global
    scratch, which each launch allocates through it. The setting is per thread (a context variable),
    so each launch that may need it makes sure of it (the backward runs in autograd's thread)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        import triton

        triton.set_allocator(_tma_allocator)


# K and V through descriptors made on the host over all their rows (kv_rows_descriptor) instead of
# descriptors built by each program, at these padded head dims (docs/decisions.md#kv-descriptors: at D=128
# short rows gain, document masks 4k +9%; at D=64 the 64x64 tiles that sliding windows pick lost
# 7-8%, so D=64 keeps the per-program descriptors). None applies that rule; True/False force it
# wherever the layout allows / never (tests, benchmarks).
KV_ROWS_HEAD_DIMS = {128}
KV_ROWS: bool | None = None


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
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, [rows, t.shape[3]], [t.stride(2), 1], [block_n, t.shape[3]])


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
# tried by the autotuner beside _DENSE_CONFIGS where q_rows_descriptor allows (docs/decisions.md entry
# 30). WARP_SPEC: None autotunes them in on Hopper; True gives the dense path only these (also under
# the interpreter, which runs the loop unspecialized: tests); False never.
_DENSE_WS_CONFIGS = {128: [(128, 128, 4, 2)]}
WARP_SPEC: bool | None = None
# False keeps all-full masks on the block-table path (benchmarks, tests).
DENSE = True
# False reads one index per full tile even where a mask's full blocks are consecutive.
FULL_RUNS = True


def q_rows_descriptor(q: torch.Tensor, tma: bool) -> int:
    """The row count of a descriptor over every row of ``q`` (B, H, L, D) (see _all_rows) when the
    warp-specialized loops may read it that way (K/V read through descriptors, q's rows aligned for
    them); 0 otherwise."""
    rows = _all_rows(q) if tma else 0
    return rows if rows and use_tma((q,), True, True) else 0


# Candidates over 64x64 mask blocks (the finer tables of REFINE, or a mask built with
# BLOCK_SIZE=64), where only 64x64 tiles fit. Measured on an H200 (docs/decisions.md#finer-tables): three
# stages gain up to 6% on document masks, two up to 9% on sliding windows at D=64.
_FINE_CONFIGS = {64: [(64, 64, 4, 2), (64, 64, 4, 3)], 128: [(64, 64, 4, 3), (64, 64, 4, 2)]}


def _candidates(head_dim_pad: int, itemsize: int, dense: bool,
                sparse: tuple[int, int] = (128, 128)) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) candidates, best first."""
    if dense and itemsize == 2 and head_dim_pad in _DENSE_CONFIGS:
        return _DENSE_CONFIGS[head_dim_pad]
    if tuple(sparse) == (64, 64) and itemsize == 2 and head_dim_pad in _FINE_CONFIGS:
        return _FINE_CONFIGS[head_dim_pad]
    return gpu_configs(head_dim_pad, itemsize)


def _launcher(module, head_dim_pad, dtype, sparse, opts: KernelOptions, q_len: int,
              dense: bool = False, warp_spec: bool = False, kv_rows: bool = False):
    """Return (kernel, fixed_meta) where fixed_meta holds the tile constexprs when not autotuning.
    ``warp_spec``: the dense path may use the warp-specialized candidates (q_rows_descriptor).
    ``kv_rows``: K and V are host descriptors (kv_rows_descriptor), whose blocks follow each
    configuration."""
    kernel = module.flex_forward_kernel
    sparse_q, sparse_kv = sparse
    warp_spec = dense and warp_spec  # forward() passes it only when WARP_SPEC is not False
    ws_only = warp_spec and WARP_SPEC is True
    if use_interpreter():
        bm = _check_tile(opts.BLOCK_M, sparse_q, "BLOCK_M", "query") if opts.BLOCK_M else fit_tile(64, sparse_q, "query")
        bn = _check_tile(opts.BLOCK_N, sparse_kv, "BLOCK_N", "key") if opts.BLOCK_N else fit_tile(64, sparse_kv, "key")
        return kernel, dict(BLOCK_M=bm, BLOCK_N=bn, **({"WARP_SPEC": True} if ws_only else {}))
    itemsize = torch.empty((), dtype=dtype).element_size()
    # ((BLOCK_M, BLOCK_N, num_warps, num_stages), warp-specialized), best first.
    candidates = [(c, False) for c in _candidates(head_dim_pad, itemsize, dense, sparse)]
    if warp_spec and itemsize == 2:
        ws = [(c, True) for c in _DENSE_WS_CONFIGS.get(head_dim_pad, [])]
        candidates = ws if ws_only and ws else candidates + ws
    if opts.BLOCK_M or opts.BLOCK_N or not opts.autotune:
        (m, n, w, s), ws = candidates[0]
        bm = _check_tile(opts.BLOCK_M, sparse_q, "BLOCK_M", "query") if opts.BLOCK_M else fit_tile(m, sparse_q, "query")
        bn = _check_tile(opts.BLOCK_N, sparse_kv, "BLOCK_N", "key") if opts.BLOCK_N else fit_tile(n, sparse_kv, "key")
        return kernel, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=opts.num_warps or w,
                            num_stages=opts.num_stages or s, **({"WARP_SPEC": True} if ws else {}))
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


# Launch order of the forward's tiles. None launches them in their natural order (query tiles of
# each batch and head in turn); an integer G launches BlockTensors.schedule(rows, G): longest
# first within groups of G mask rows (all of them if G <= 0), for masks whose rows differ in length
# and visit at least SCHEDULE_MIN_BLOCKS blocks on average. Measured on an H200 (docs/decisions.md#launch-order): G=256 gains 3-7% on causal, prefix LM and softcap masks; on short rows (document
# masks at 4k, 4 blocks per row) every longest-first order lost 6-11%, so they keep the natural one.
SCHEDULE_GROUP: int | None = 256
SCHEDULE_MIN_BLOCKS = 8.0


# Finer tables for the template: where a mask's partial blocks hide empty and full sub-blocks
# (documents a few blocks long: a query block that straddles a document boundary makes every block
# of the previous document partial), the forward reads tables over REFINE_BLOCK x REFINE_BLOCK
# blocks (flexcore.blockmask.refine_block_map, computed once per mask and kept with it) and runs
# tiles of that size: it skips the empty sub-blocks and runs the mask_mod on the partial ones only.
# Taken where the finer tables' cost (BlockTensors.row_cost, in units of the finer blocks) is at
# most REFINE_MAX_COST of the mask's own, and the Gluon masked kernel does not serve the call.
# Measured on an H200 (docs/decisions.md#finer-tables). REFINE: None by that rule; True wherever the
# tables divide (tests, benchmarks); False never.
REFINE: bool | None = None
REFINE_BLOCK = 64
REFINE_MAX_COST = 0.95


def finer_tables(blocks: BlockTensors, q_len: int, mask_lowered, opts: KernelOptions,
                 serves_own=None):
    """(key-block tables, transposed tables) of the mask of ``blocks`` over REFINE_BLOCK-sized
    blocks where REFINE takes them for a call with ``q_len`` queries, else None. ``serves_own()``:
    whether another kernel serves the mask's own tables (then kept), asked only where the finer
    ones would be taken. Cheap once decided: the finer tables live with the mask."""
    if REFINE is False or blocks.refine is None or opts.BLOCK_M or opts.BLOCK_N:
        return None
    sparse_q, sparse_kv = blocks.sparse_block
    fine = REFINE_BLOCK
    if sparse_q % fine or sparse_kv % fine or (sparse_q == fine and sparse_kv == fine):
        return None
    if REFINE is None:
        stats = blocks.stats(math.ceil(q_len / sparse_q))
        if stats is None or stats[3] == 0:  # unknown yet (graph capture), or no partial block
            return None
        # At best a partial block keeps one partial sub-block of its r: the saving's bound.
        r = (sparse_q // fine) * (sparse_kv // fine)
        if (stats[2] * r - stats[3] * (5 * r - 5)) > REFINE_MAX_COST * stats[2] * r:
            return None
        if serves_own is not None and serves_own():
            return None
    found = blocks.refine(mask_lowered.captured, not capturing())
    if found is None:
        return None
    kv_fine, q_fine, ratio = found
    return (kv_fine, q_fine) if REFINE or ratio <= REFINE_MAX_COST else None


def versions(tensors) -> tuple:
    """The identities and version counters of ``tensors``: equal while none is replaced or
    modified in place (the finer tables hold for a mask_mod's captured tensors as they were)."""
    return tuple((id(t), t._version) for t in tensors)


def refine_key(mask_lowered) -> tuple:
    """What finer_tables reads besides a plan key's call: its settings and the versions of the
    mask_mod's captured tensors."""
    return (REFINE, REFINE_BLOCK, REFINE_MAX_COST, REFINE_SKEW, versions(mask_lowered.captured))


# The Gluon masked kernel keeps the mask's own tables unless their rows are skewed: the longest row
# costs more than REFINE_SKEW times the mean (documents of very different lengths). There the
# template over the finer tables, launched longest first (SCHEDULE_GROUP), beat it on an H200
# (docs/decisions.md#finer-tables: document masks at 16k, +9%), while on rows alike (sliding windows) the
# Gluon kernel won by 14%. At head dim 64 the finer tables come first wherever they are taken
# (hopper.UNION_YIELDS: the three-warpgroup kernel measured behind them on sliding windows, docs/decisions.md#gluon-union-lists).
REFINE_SKEW = 2.0


def refined(blocks: BlockTensors, q, k, v, score_lowered, mask_lowered, scale: float,
            opts: KernelOptions) -> BlockTensors:
    """The tables the forward kernel reads: ``blocks`` or the same mask over finer blocks (see
    REFINE and REFINE_SKEW)."""
    def serves_own():
        if not hopper.applies_masked(q, k, v, score_lowered, blocks, False, scale, opts):
            return False
        if hopper.HOPPER_MASKED:  # forced (tests, probes): the Gluon kernel reads the mask's own tables
            return True
        tiles = hopper.MASKED_TILES.get(q.shape[3])
        if hopper.UNION_YIELDS and tiles is not None and tiles.num_wg == 3:  # head dim 64
            return False
        rows = math.ceil(q.shape[2] / blocks.sparse_block[0])
        stats = blocks.stats(rows)
        entries = blocks.num_blocks[..., :rows].numel()
        return stats is None or stats[1] * entries <= REFINE_SKEW * stats[2]

    found = finer_tables(blocks, q.shape[2], mask_lowered, opts, serves_own)
    return blocks if found is None else found[0]


def forward(q, k, v, score_lowered, mask_lowered, blocks: BlockTensors, scale: float,
            opts: KernelOptions):
    """Run the forward kernel.

    Returns:
        out (B, Hq, L, Dv) in q's dtype and q's stride order (as torch's flex_attention); lse
        (B, Hq, L) float32 (float64 for float64 inputs, computed in float64 throughout), natural
        log, -inf on rows without a kept key and +inf on rows with a +inf score; row_stats
        (2, B, Hq, L) of lse's dtype: the row max of the modded, masked scores in log2 units
        (:func:`max_scores` gives it in natural units) and 1/(row sum of exp2(s - max)), which the
        backward recomputes probabilities from.
    """
    caps = (*score_lowered.kernel_args(), *mask_lowered.kernel_args())
    key = _plan_key(q, k, v, score_lowered, mask_lowered, blocks, scale, opts, caps)
    if key is None:
        used = refined(blocks, q, k, v, score_lowered, mask_lowered, scale, opts)
        return _forward(q, k, v, score_lowered, mask_lowered, used, scale, opts, caps)[0]
    plan = get_plan(key)
    if plan is not None:  # it holds the tables that refined chose (the key has what it read)
        return plan(q, k, v, caps)
    used = refined(blocks, q, k, v, score_lowered, mask_lowered, scale, opts)
    with recording() as record:
        result, fixed, kv_desc = _forward(q, k, v, score_lowered, mask_lowered, used, scale, opts, caps)
    if fixed is None:  # a Gluon kernel served the call: a repeated call goes straight to it
        keep_plan(key, _HopperPlan(scale, kv_desc), (blocks,))
        return result
    launches = direct_launches(record, 1)
    if launches is not None:
        keep_plan(key, _ForwardPlan(*launches[0], fixed, kv_desc, result), (blocks,))
    return result


def _plan_key(q, k, v, score_lowered, mask_lowered, blocks, scale, opts, caps):
    """Everything the forward's host decisions read besides the mask tables' statistics (fixed
    for ``blocks``): see flexcore.kernels.launch's per-call plans. None where plans are off. The
    mods count by their sources and traits, not their captured tensors (which each call passes):
    a key never keeps a tensor alive."""
    return plan_key(
        "forward", score_lowered.source, mask_lowered.source, score_lowered.is_trivial,
        bool(score_lowered.captured), id(blocks), q.device, q.dtype, k.dtype, v.dtype,
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
        q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, scale, opts,
        TMA, KV_ROWS, frozenset(KV_ROWS_HEAD_DIMS), DENSE, hopper.HOPPER_DENSE, tuple(hopper.DENSE_TILES.items()),
        tuple(hopper.MASKED_TILES.items()), hopper.UNION_YIELDS,
        hopper.UNION_MAX_EXCLUSIVE, hopper.UNION_MIN_MEAN_BLOCKS,
        hopper.HOPPER_MASKED, hopper.MASKED_MIN_MEAN_BLOCKS, WARP_SPEC, FULL_RUNS, SCHEDULE_GROUP,
        SCHEDULE_MIN_BLOCKS, arg_key(caps) if caps else (), *refine_key(mask_lowered))


class _ForwardPlan:
    """A repeated forward call (see flexcore.kernels.launch's per-call plans): its compiled
    kernel, grid and integer arguments, and the descriptors' layout where K and V are host
    descriptors."""

    __slots__ = ("entry", "grid", "fixed", "kv_desc", "out_shape", "out_strides", "lse_shape",
                 "stats_shape", "acc_dtype")

    def __init__(self, entry, grid, fixed, kv_desc, result):
        out, lse, row_stats = result
        self.entry, self.grid, self.fixed, self.kv_desc = entry, grid, fixed, kv_desc
        self.out_shape, self.lse_shape, self.stats_shape = out.shape, lse.shape, row_stats.shape
        self.out_strides = out.stride()  # q's stride order; q's strides are in the plan's key
        self.acc_dtype = lse.dtype

    def __call__(self, q, k, v, caps):
        device = q.device
        out = torch.empty_strided(self.out_shape, self.out_strides, dtype=q.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=self.acc_dtype, device=device)
        row_stats = torch.empty(self.stats_shape, dtype=self.acc_dtype, device=device)
        if self.kv_desc is not None:
            (k_rows, v_rows), block_n = self.kv_desc
            k, v = _rows_descriptor(k, k_rows, block_n), _rows_descriptor(v, v_rows, block_n)
        ensure_tma_allocator()  # per thread; cheap where set (use_tma set it on the first call)
        self.entry.launch(self.grid, (q, k, v, out, lse, row_stats, *self.fixed, *caps))
        return out, lse, row_stats


class _HopperPlan:
    """A repeated forward call that flexcore.kernels.hopper serves (the key fixes everything its
    choice read: shapes, strides, alignments, dtypes, device, mask, mods, scale and options)."""

    __slots__ = ("scale", "masked")

    def __init__(self, scale, masked):
        self.scale = scale
        self.masked = masked  # the masked kernel's launch with the mask's tables, or None (dense)

    def __call__(self, q, k, v, caps):
        if self.masked is not None:
            return self.masked(q, k, v, caps=caps)
        return hopper.forward(q, k, v, self.scale)


def _forward(q, k, v, score_lowered, mask_lowered, blocks: BlockTensors, scale: float,
             opts: KernelOptions, caps: tuple):
    """forward's decisions and launch: ((out, lse, row_stats), the integer arguments between the
    tensors and the captures, ((K rows, V rows), BLOCK_N) of host descriptors or None). Where
    flexcore.kernels.hopper serves the call: (its result, None, None for the dense kernel or the
    masked kernel's launch with the mask's tables bound)."""
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    sparse_q, sparse_kv = blocks.sparse_block
    q_rows = math.ceil(L / sparse_q)
    dense = DENSE and blocks.all_full(q_rows, math.ceil(S / sparse_kv))
    if hopper.applies(q, k, v, score_lowered, dense, scale, opts):  # the Gluon kernels
        result = hopper.forward(q, k, v, scale)
        if result is not None:
            return result, None, None
    elif hopper.applies_masked(q, k, v, score_lowered, blocks, dense, scale, opts):
        module = hopper.masked_module(mask_lowered)
        found = None if module is None else hopper.masked_tables(blocks, L, S, D)
        if found is not None:
            table_args, has_full = found
            run = functools.partial(hopper.forward_masked, module=module, table_args=table_args,
                                    has_full=has_full, scale=scale,
                                    key=("forward_hopper.py.tmpl", mask_lowered.source, D))
            result = run(q, k, v, caps=caps)
            if result is not None:
                return result, None, run
    module = load_kernel_module("forward.py.tmpl", score_lowered, mask_lowered)
    out = empty_output(q, Dv)
    import triton.language as tl  # after prepare_triton(): see flexcore._runtime

    fp64 = q.dtype == torch.float64
    acc_dtype = torch.float64 if fp64 else torch.float32
    lse = torch.empty((B, Hq, L), dtype=acc_dtype, device=q.device)
    row_stats = torch.empty((2, B, Hq, L), dtype=acc_dtype, device=q.device)  # see RowStats
    head_dim_pad, head_dim_v_pad = pad_head_dim(D), pad_head_dim(Dv)
    tma = use_tma((k, v), head_dim_pad == D and head_dim_v_pad == Dv, TMA)
    runs = FULL_RUNS and not dense and blocks.full_runs(q_rows)
    # Warp specialization only without captured tensors: a score_mod that loads from one inside
    # the loop (a relative-position table) gives wrong results under it (docs/decisions.md#dense-warp-specialization).
    q_desc_rows = (q_rows_descriptor(q, tma) if dense and WARP_SPEC is not False
                   and not score_lowered.captured else 0)
    even_kv = S % sparse_kv == 0  # tiles divide the mask blocks: no tile passes KV_LEN
    k_desc = v_desc = None
    if KV_ROWS or (KV_ROWS is None and max(head_dim_pad, head_dim_v_pad) in KV_ROWS_HEAD_DIMS):
        k_desc, v_desc = kv_rows_descriptor(k, tma, even_kv), kv_rows_descriptor(v, tma, even_kv)
        if k_desc is None or v_desc is None:
            k_desc = v_desc = None
    kv_rows = k_desc is not None
    kernel, meta = _launcher(module, max(head_dim_pad, head_dim_v_pad), q.dtype, blocks.sparse_block,
                             opts, L, dense, q_desc_rows > 0, kv_rows)
    group = SCHEDULE_GROUP
    order = None if group is None or dense else blocks.schedule(q_rows, group, SCHEDULE_MIN_BLOCKS)
    full_n, full_i = blocks.full_tables()
    upcast = use_interpreter() and q.dtype in (torch.float16, torch.bfloat16)
    precision = "tf32" if (opts.allow_tf32 and not use_interpreter()) else "ieee"

    # The arguments are (tensors of the call, fixed, captures): a plan keeps ``fixed``.
    fixed = (
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        blocks.num_blocks, blocks.indices, full_n, full_i,
        *blocks.num_blocks.stride(), *blocks.indices.stride()[:3],
        *full_n.stride(), *full_i.stride()[:3],
        order if order is not None else blocks.num_blocks, q_rows, q_desc_rows,
        B * Hq * L, L, S, Hq, *scale_args(scale, q.dtype),
    )
    args = (q, k if k_desc is None else k_desc, v if v_desc is None else v_desc, out, lse, row_stats,
            *fixed, *caps)
    constexprs = dict(
        GQA_GROUP=Hq // Hkv,
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=head_dim_v_pad,
        SPARSE_Q_BLOCK=sparse_q, SPARSE_KV_BLOCK=sparse_kv,
        HAS_FULL_BLOCKS=blocks.full_num_blocks is not None,
        EVEN_Q=L % sparse_q == 0,  # tiles divide mask blocks, so this covers every BLOCK_M
        EVEN_KV=even_kv,
        # The trivial path folds the scale into the row max, which needs scale > 0.
        SCORE_IS_TRIVIAL=score_lowered.is_trivial and scale > 0, UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        ACC_DTYPE=tl.float64 if fp64 else tl.float32,
        USE_TMA=tma, USE_ORDER=order is not None, DENSE=dense, FULL_RUNS=runs, KV_ROWS=kv_rows,
    )
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
               fit=fit_kv_blocks if kv_rows else None)
    else:  # the autotuner skips configurations that do not fit
        kernel.launch(lambda meta_: grid(meta_["BLOCK_M"], meta_["BLOCK_N"]), args, constexprs)
    kv_desc = None
    if kv_rows:  # the rows and the BLOCK_N that the launch gave them (fit_kv_blocks)
        kv_desc = ((k_desc.shape[0], v_desc.shape[0]), k_desc.block_shape[0])
    return (out, lse, row_stats), fixed, kv_desc
