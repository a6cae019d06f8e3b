"""Host side of the split-KV decoding kernel: tile packing, split count and the launches."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from flexcore._runtime import use_interpreter
from flexcore.errors import InputError
from flexcore.kernels.codegen import load_kernel_module
from flexcore.kernels.forward import empty_output, fit_tile, forward, max_scores, pad_head_dim
from flexcore.kernels.launch import Tuned, run
from flexcore.kernels.tables import BlockTensors
from flexcore.options import KernelOptions

_LOG2E = 1.4426950408889634
#: flex_attention picks the decode kernel by itself up to this query length.
DECODE_MAX_Q_LEN = 16
#: Most rows (query heads x query positions) one program packs into its tile.
MAX_TILE_ROWS = 64
#: Most key splits per tile (the reduction holds NUM_SPLITS x Dv partials in one program).
MAX_SPLITS = 64
#: Without a GPU (interpreter) the split count only needs to exercise the reduction.
_INTERPRETER_SPLITS = 3


def use_decode_kernel(q_len: int, opts: KernelOptions) -> bool:
    """Whether flex_attention should run the split-KV decode kernel: ``opts.decode``, else q_len <= 16."""
    return opts.decode if opts.decode is not None else q_len <= DECODE_MAX_Q_LEN


@dataclass(frozen=True)
class DecodePlan:
    """How one decode call is tiled (also what the tests and the bench report)."""

    heads_per_tile: int  # query heads of one GQA group packed into one tile
    q_per_tile: int      # query positions per tile
    q_chunks: int        # tiles along the query positions
    block_m: int         # tile rows: heads_per_tile * q_per_tile padded to a power of two >= 16
    num_splits: int      # programs along the key blocks of one tile


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _largest_pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def _heads_share_blocks(blocks: BlockTensors) -> bool:
    # The tables come expanded to (B, Hq, ...); stride 0 along heads means one mask for all heads.
    tables = [blocks.num_blocks, blocks.indices, blocks.full_num_blocks, blocks.full_indices]
    return all(t is None or t.shape[1] == 1 or t.stride(1) == 0 for t in tables)


def plan_decode(B: int, Hq: int, Hkv: int, L: int, S: int, blocks: BlockTensors, device: torch.device,
                num_splits: int | None = None) -> DecodePlan:
    """Choose the tile packing and the number of key splits for one decode call."""
    group = Hq // Hkv
    sparse_q, sparse_kv = blocks.sparse_block
    if L <= min(sparse_q, MAX_TILE_ROWS):
        q_per_tile = L
    else:
        # Every tile must stay inside one mask block row: chunk by a power of two dividing it.
        q_per_tile = _largest_pow2_divisor(sparse_q, MAX_TILE_ROWS)
    heads = 1
    if _heads_share_blocks(blocks):
        heads = max(d for d in range(1, group + 1) if group % d == 0 and d * q_per_tile <= MAX_TILE_ROWS)
    q_chunks = math.ceil(L / q_per_tile)
    block_m = max(16, 1 << (heads * q_per_tile - 1).bit_length())
    kv_blocks = math.ceil(S / sparse_kv)
    if num_splits is None:
        if use_interpreter() or device.type != "cuda":
            num_splits = _INTERPRETER_SPLITS
        else:
            tiles = B * Hkv * (group // heads) * q_chunks
            num_splits = choose_num_splits(tiles, min(kv_blocks, MAX_SPLITS), _sm_count(device.index or 0))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise InputError(f"num_splits = {num_splits!r}: expected a positive int")
    num_splits = max(1, min(num_splits, kv_blocks))
    return DecodePlan(heads, q_per_tile, q_chunks, block_m, num_splits)


@functools.lru_cache(maxsize=256)
def choose_num_splits(tiles: int, max_splits: int, sms: int) -> int:
    """Key splits per tile so that ``tiles * splits`` programs keep every SM streaming the cache.

    The kernel is bandwidth-bound and its programs are equal in size, so the time is about
    ``ceil(tiles * s / sms)`` rounds of ``1 / s`` of a tile's work. Among the splits within 5% of the
    best, take the first that puts about two programs on every SM (more loads in flight per SM),
    else the cheapest; fewer splits mean fewer partial results to merge.
    """
    costs = {s: math.ceil(tiles * s / sms) / s for s in range(1, max(1, max_splits) + 1)}
    best = min(costs.values())
    near = [s for s, c in costs.items() if c <= 1.05 * best]
    for s in near:
        if tiles * s >= 1.9 * sms:
            return s
    return min(near, key=lambda s: (costs[s], s))


# (BLOCK_N, num_warps, num_stages) candidates on the GPU; the first is the default without autotune.
# The kernel streams K/V once, so the candidates differ in bytes in flight per SM (tile x stages).
# With several splits, the last split of each tile to finish combines the partial results (one
# launch per call: a decoding step's host time is most of its cost at short caches).
_counters: dict = {}


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per tile, kept per device and stream: the kernel leaves them at
    zero again, so no call clears them."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _counters.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _counters[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return buf


_GPU_CONFIGS = [(64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (64, 2, 3), (32, 4, 5)]
_autotuners: dict = {}


_launchers: dict = {}


def _launcher(module, sparse_kv: int, head_dim_pad: int, itemsize: int, opts: KernelOptions):
    """Return (kernel, fixed_meta); fixed_meta holds BLOCK_N and launch knobs when not autotuning.
    Remembered per module and arguments: decoding calls it at every step."""
    key = (module.__name__, sparse_kv, head_dim_pad, itemsize, opts, use_interpreter())
    found = _launchers.get(key)
    if found is None:
        found = _launchers[key] = _make_launcher(module, sparse_kv, head_dim_pad, itemsize, opts)
    return found


def _make_launcher(module, sparse_kv: int, head_dim_pad: int, itemsize: int, opts: KernelOptions):
    kernel = module.flex_decode_kernel
    if opts.BLOCK_N:
        if sparse_kv % opts.BLOCK_N:
            raise InputError(f"kernel_options['BLOCK_N'] = {opts.BLOCK_N} does not divide the "
                             f"BlockMask's key BLOCK_SIZE {sparse_kv}; use a power of two that divides it")
    if use_interpreter():
        return kernel, dict(BLOCK_N=opts.BLOCK_N or fit_tile(64, sparse_kv, "key"))
    configs = []
    for n, w, s in _GPU_CONFIGS:
        if head_dim_pad > 128 or itemsize == 4:  # bigger tiles: fewer stages fit in shared memory
            n, s = min(n, 64), min(s, 2)
        n = opts.BLOCK_N or fit_tile(n, sparse_kv, "key")
        configs.append((n, opts.num_warps or w, opts.num_stages or s))
    configs = list(dict.fromkeys(configs))
    if opts.BLOCK_N or not opts.autotune or len(configs) == 1:
        n, w, s = configs[0]
        return kernel, dict(BLOCK_N=n, num_warps=w, num_stages=s)
    import triton

    key = (module.__name__, sparse_kv, head_dim_pad, itemsize, opts.num_warps, opts.num_stages)
    tuner = _autotuners.get(key)
    if tuner is None:
        # The best tile depends on how long each split runs: keyed on a power-of-two size class.
        tuner = Tuned(triton.autotune(
            configs=[triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in configs],
            key=["TUNE_BUCKET", "NUM_SPLITS", "Q_LEN"])(kernel))
        _autotuners[key] = tuner
    return tuner, {}


def decode(q, k, v, score_lowered, mask_lowered, blocks: BlockTensors, scale: float,
           opts: KernelOptions, *, num_splits: int | None = None, return_max_scores: bool = False):
    """Split-KV decoding attention with lowered mods.

    Meant for short queries (1 to 16 positions) against a long cache. float64 inputs run
    :func:`flexcore.kernels.forward.forward` instead, which computes in float64 throughout (this
    kernel accumulates in float32).

    Args:
        q: (B, Hq, L, D). k: (B or 1, Hkv, S, D), v: (B or 1, Hkv, S, Dv); a batch of 1 is shared by
            every query batch (a paged cache).
        score_lowered, mask_lowered: :class:`flexcore.lowering.LoweredMod` of the score and mask mods.
        blocks: the BlockMask tables expanded to (B, Hq, ...).
        scale: multiplies q·k.
        opts: kernel options; BLOCK_N, num_warps, num_stages and autotune apply, BLOCK_M does not
            (the tile rows are the query heads of a GQA group times the query positions).
        num_splits: force the number of key splits (default: enough programs to fill the GPU).
        return_max_scores: also return each row's max of the modded, masked scores.

    Returns:
        out (B, Hq, L, Dv) in q's dtype and q's stride order; lse (B, Hq, L) float32 (float64 for
        float64 inputs), natural log; with ``return_max_scores`` also max_scores (B, Hq, L) of
        lse's dtype, natural units (torch's ``AuxOutput.max_scores``). Rows with every key masked
        give out 0, lse -inf and max -inf; rows with a +inf score give lse and max +inf.
    """
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape[0] not in (1, B) or v.shape[0] != k.shape[0]:
        raise InputError(f"key batch {k.shape[0]} / value batch {v.shape[0]} must equal the query "
                         f"batch {B}, or be 1 (a cache shared by the batch)")
    if Hq % Hkv:
        raise InputError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)  # batch 1 -> stride 0
    if q.dtype == torch.float64:
        out, lse, row_stats = forward(q, k, v, score_lowered, mask_lowered, blocks, scale, opts)
        return (out, lse, max_scores(row_stats)) if return_max_scores else (out, lse)
    sparse_q, sparse_kv = blocks.sparse_block
    plan = plan_decode(B, Hq, Hkv, L, S, blocks, q.device, num_splits)
    module = load_kernel_module("decode.py.tmpl", score_lowered, mask_lowered)
    head_dim_pad, head_dim_v_pad = pad_head_dim(D), pad_head_dim(Dv)
    kernel, meta = _launcher(module, sparse_kv, max(head_dim_pad, head_dim_v_pad), q.element_size(), opts)

    out = empty_output(q, Dv)
    lse = torch.empty((B, Hq, L), dtype=torch.float32, device=q.device)
    row_max = torch.empty((B, Hq, L), dtype=torch.float32, device=q.device) if return_max_scores else lse
    split = plan.num_splits > 1
    tiles = B * Hkv * (Hq // Hkv // plan.heads_per_tile) * plan.q_chunks
    counters = lse  # unused without splits
    if split:
        # PART_OUT (B, Hq, L, splits, Dv), PART_LSE (B, Hq, L, splits) and with max scores
        # PART_MAX (B, Hq, L, splits) in one allocation.
        n = B * Hq * L * plan.num_splits
        part = torch.empty(n * (Dv + 1 + return_max_scores), dtype=torch.float32, device=q.device)
        part_out, part_lse = part[:n * Dv], part[n * Dv:n * (Dv + 1)]
        part_max = part[n * (Dv + 1):] if return_max_scores else part_lse
        counters = _split_counters(q.device, tiles)
    else:
        part_out, part_lse, part_max = out, lse, lse  # unused: the kernel writes the result itself
    full_n, full_i = blocks.full_tables()
    upcast = use_interpreter() and q.dtype != torch.float32
    precision = "tf32" if (opts.allow_tf32 and not use_interpreter()) else "ieee"

    tune_bucket = math.ceil(S / sparse_kv).bit_length()
    args = (
        q, k, v, out, lse, part_out, part_lse, counters, row_max, part_max,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        blocks.num_blocks, blocks.indices, full_n, full_i,
        *blocks.num_blocks.stride(), *blocks.indices.stride()[:3],
        *full_n.stride(), *full_i.stride()[:3],
        L, S, Hq, Hkv, plan.q_chunks, plan.num_splits, tune_bucket,
        scale, scale * _LOG2E,
        *score_lowered.kernel_args(), *mask_lowered.kernel_args(),
    )
    constexprs = dict(
        GQA_GROUP=Hq // Hkv, HEADS_PER_TILE=plan.heads_per_tile, Q_PER_TILE=plan.q_per_tile,
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=head_dim_v_pad,
        BLOCK_M=plan.block_m, SPARSE_Q_BLOCK=sparse_q, SPARSE_KV_BLOCK=sparse_kv,
        HAS_FULL_BLOCKS=blocks.full_num_blocks is not None,
        EVEN_KV=S % sparse_kv == 0, SPLIT_OUTPUT=split,
        SCORE_IS_TRIVIAL=score_lowered.is_trivial, UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        WRITE_MAX=return_max_scores,
    )
    grid = (plan.num_splits, tiles)
    if isinstance(kernel, Tuned):
        kernel.launch(grid, args, constexprs, key=(tune_bucket, plan.num_splits, L), policy=opts.dispatch.launch)
    else:
        run(kernel, grid, args, {**constexprs, **meta}, opts.dispatch.launch)
    return (out, lse, row_max) if return_max_scores else (out, lse)
