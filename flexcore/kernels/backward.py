"""Host side of the backward kernels: tile choice, gradient buffers and the three launches.

dQ, dK and dV never use atomics (each program owns its rows), so they are bit-identical across runs.
Gradients of captured tensors are scattered by the dK/dV kernel with atomic adds:

- default: float32 atomics (float64 for float64 tensors). Fast; the summation order, hence the
  last bits, varies between runs on the GPU.
- ``KernelOptions(deterministic=True)``: each contribution is rounded to a multiple of
  2**-FIXED_POINT_BITS (2**-32, about 2.3e-10) and added as an int64. Integer addition is
  associative, so the result is bit-identical across runs. Trade-off: absolute resolution 2**-32 per
  contribution (a gradient summing N contributions is off by at most N * 2**-33; contributions that
  depend on b and h only are summed per tile in float32 first), and range |partial sums| < 2**31.
  int64 atomics are somewhat slower than float32 ones.
"""
from __future__ import annotations

import math

import torch

from flexcore._runtime import use_interpreter
from flexcore.kernels.codegen import HEADER, cached_module, fill_template, read_template
from flexcore.kernels.forward import BlockTensors, _check_tile, fit_tile, pad_head_dim
from flexcore.kernels.launch import launch
from flexcore.options import KernelOptions

_LOG2E = 1.4426950408889634
#: Captured-tensor gradients in deterministic mode are int64 multiples of 2**-FIXED_POINT_BITS.
FIXED_POINT_BITS = 32


def _cap_list(names) -> str:
    return "".join(", " + n for n in names)


def build_backward_source(score_lowered, score_bwd_lowered, mask_lowered) -> str:
    """The backward template filled with the forward mods and the score_mod's lowered VJP."""
    functions = "\n\n\n".join(m.source.rstrip() for m in (score_lowered, score_bwd_lowered, mask_lowered))
    values = {
        "MOD_FUNCTIONS": functions + "\n",
        "SCORE_CAPS": _cap_list(score_lowered.cap_params),
        "MASK_CAPS": _cap_list(mask_lowered.cap_params),
        "CAPS": _cap_list(tuple(score_lowered.cap_params) + tuple(mask_lowered.cap_params)),
        "GRAD_CAPS": _cap_list(score_bwd_lowered.grad_params),
    }
    return HEADER + fill_template(read_template("backward.py.tmpl"), values)


def backward_module(score_lowered, score_bwd_lowered, mask_lowered):
    """The compiled backward module for these mods, cached by their sources."""
    return cached_module(
        ("backward.py.tmpl", score_lowered.source, score_bwd_lowered.source, mask_lowered.source),
        lambda: build_backward_source(score_lowered, score_bwd_lowered, mask_lowered), "backward")


def q_block_tensors(block_mask, B: int, Hq: int) -> BlockTensors:
    """The BlockMask's transposed tables (q_*, full_q_*), expanded to (B, Hq, KV_BLOCKS[, Q_BLOCKS]).

    A BlockMask built with ``compute_q_blocks=False`` gets its transpose computed here.
    """
    if block_mask.q_indices is None:
        from flexcore.blockmask import BlockMask

        block_mask = BlockMask.from_kv_blocks(
            block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, BLOCK_SIZE=block_mask.BLOCK_SIZE,
            mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths)

    bq, bkv = block_mask.BLOCK_SIZE
    return BlockTensors.expanded(block_mask.q_num_blocks, block_mask.q_indices,
                                 block_mask.full_q_num_blocks, block_mask.full_q_indices,
                                 (bkv, bq), B, Hq)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim, 2-byte dtypes. dK/dV programs own
# BLOCK_N keys and step over BLOCK_M queries; dQ programs own BLOCK_M queries and step over BLOCK_N
# keys. Measured on an H200 (bf16, B=4, H=16, S=4096, D=128): about 345 TFLOP/s for the backward
# alone with a causal mask. A mod with many live values can exceed shared memory: see flexcore.kernels.launch.
_DKDV_CONFIGS = {64: (64, 64, 4, 3), 128: (64, 128, 8, 3), 256: (32, 64, 8, 1)}
_DQ_CONFIGS = {64: (64, 64, 4, 3), 128: (128, 128, 8, 2), 256: (64, 32, 4, 1)}

def _tiles(opts: KernelOptions, head_dim_pad: int, itemsize: int, sparse_q: int, sparse_kv: int):
    """((BLOCK_M, BLOCK_N, meta) for dK/dV, (BLOCK_M, BLOCK_N, meta) for dQ)."""
    if use_interpreter():
        # The interpreter costs the same per loop step whatever the tile: use large tiles.
        bm = fit_tile(64, sparse_q, "query")
        bn = fit_tile(64, sparse_kv, "key")
        configs = [(bm, bn, {}), (bm, bn, {})]
    else:
        key = min((k for k in _DKDV_CONFIGS if k >= head_dim_pad), default=256)
        configs = []
        for table in (_DKDV_CONFIGS, _DQ_CONFIGS):
            m, n, w, s = table[key]
            if itemsize == 4:  # float32 tiles take twice the registers and shared memory
                m, n, s = max(16, m // 2), max(16, n // 2), max(1, s - 1)
            meta = dict(num_warps=opts.num_warps or w, num_stages=opts.num_stages or s)
            configs.append((fit_tile(m, sparse_q, "query"), fit_tile(n, sparse_kv, "key"), meta))
    if opts.BLOCK_M or opts.BLOCK_N:
        bm = _check_tile(opts.BLOCK_M, sparse_q, "BLOCK_M", "query") if opts.BLOCK_M else None
        bn = _check_tile(opts.BLOCK_N, sparse_kv, "BLOCK_N", "key") if opts.BLOCK_N else None
        configs = [(bm or m, bn or n, meta) for m, n, meta in configs]
    return configs[0], configs[1]


def backward(q, k, v, out, row_stats, grad_out, score_lowered, score_bwd_lowered, mask_lowered,
             kv_blocks: BlockTensors, q_blocks: BlockTensors, scale: float, opts: KernelOptions):
    """Gradients of flex_attention's output with respect to q, k, v and the score_mod's captures.

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

    Returns:
        (dq, dk, dv, captured_grads): dq, dk, dv in the dtypes and shapes of q, k, v;
        ``captured_grads[i]`` is the gradient of ``score_lowered.captured[i]`` (same shape and
        dtype), or None where that tensor does not require grad.
    """
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    module = backward_module(score_lowered, score_bwd_lowered, mask_lowered)
    row_stats = row_stats.contiguous()
    head_dim_pad, head_dim_v_pad = pad_head_dim(D), pad_head_dim(Dv)
    sparse_q, sparse_kv = kv_blocks.sparse_block
    if q_blocks.sparse_block != (sparse_kv, sparse_q):
        raise ValueError(f"q_blocks.sparse_block {q_blocks.sparse_block} is not the transpose of "
                         f"kv_blocks.sparse_block {kv_blocks.sparse_block}")
    itemsize = q.element_size()
    (bm1, bn1, meta1), (bm2, bn2, meta2) = _tiles(
        opts, max(head_dim_pad, head_dim_v_pad), itemsize, sparse_q, sparse_kv)
    pinned = opts.pins_tiles
    upcast = use_interpreter() and q.dtype in (torch.float16, torch.bfloat16)
    precision = "tf32" if (opts.allow_tf32 and not use_interpreter()) else "ieee"
    common = dict(HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=head_dim_v_pad,
                  SPARSE_Q_BLOCK=sparse_q, SPARSE_KV_BLOCK=sparse_kv,
                  HAS_FULL_BLOCKS=kv_blocks.full_num_blocks is not None,
                  EVEN_Q=L % sparse_q == 0, EVEN_KV=S % sparse_kv == 0,  # tiles divide mask blocks
                  SCORE_IS_TRIVIAL=score_lowered.is_trivial, FIXED_POINT_GRADS=opts.deterministic,
                  UPCAST_DOT=upcast, INPUT_PRECISION=precision)

    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    import triton.language as tl  # after load_module: the interpreter is set up by then

    common["ACC_DTYPE"] = tl.float64 if acc_dtype == torch.float64 else tl.float32
    delta = torch.empty((B, Hq, L), dtype=acc_dtype, device=q.device)
    pre_m = 64
    module.flex_bwd_preprocess[(math.ceil(L / pre_m), B * Hq)](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), L, Hq,
        HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=head_dim_v_pad, BLOCK_M=pre_m, ACC_DTYPE=common["ACC_DTYPE"])

    captured = list(score_lowered.captured)
    grad_buffers = {}
    for i in score_bwd_lowered.grad_of:
        if opts.deterministic:
            dtype = torch.int64
        else:  # float32 atomics, or float64 ones for float64 tensors
            dtype = torch.float64 if captured[i].dtype == torch.float64 else torch.float32
        grad_buffers[i] = torch.zeros(captured[i].shape, dtype=dtype, device=q.device)
    grad_args = []
    for i in score_bwd_lowered.grad_of:
        grad_args.append(grad_buffers[i])
        grad_args.extend(grad_buffers[i].stride())
    caps = [*score_lowered.kernel_args(), *mask_lowered.kernel_args()]

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)

    qn = q_blocks.full_num_blocks if q_blocks.full_num_blocks is not None else q_blocks.num_blocks
    qi = q_blocks.full_indices if q_blocks.full_indices is not None else q_blocks.indices
    launch(module.flex_bwd_dkdv_kernel, lambda bm, bn: (math.ceil(S / bn), B * Hkv), (
        q, k, v, grad_out, dk, dv, row_stats, delta,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
        q_blocks.num_blocks, q_blocks.indices, qn, qi,
        *q_blocks.num_blocks.stride(), *q_blocks.indices.stride()[:3],
        *qn.stride(), *qi.stride()[:3],
        B * Hq * L, L, S, Hq, Hkv, scale, scale * _LOG2E, *caps, *grad_args),
        bm1, bn1, meta1, dict(GQA_GROUP=Hq // Hkv, WRITE_CAPTURED_GRADS=bool(grad_buffers), **common),
        pinned=pinned)

    kn = kv_blocks.full_num_blocks if kv_blocks.full_num_blocks is not None else kv_blocks.num_blocks
    ki = kv_blocks.full_indices if kv_blocks.full_indices is not None else kv_blocks.indices
    launch(module.flex_bwd_dq_kernel, lambda bm, bn: (math.ceil(L / bm), B * Hq), (
        q, k, v, grad_out, dq, row_stats, delta,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(),
        kv_blocks.num_blocks, kv_blocks.indices, kn, ki,
        *kv_blocks.num_blocks.stride(), *kv_blocks.indices.stride()[:3],
        *kn.stride(), *ki.stride()[:3],
        B * Hq * L, L, S, Hq, scale, scale * _LOG2E, *caps, *grad_args),
        bm2, bn2, meta2, dict(GQA_GROUP=Hq // Hkv, **common), pinned=pinned)

    captured_grads = []
    for i, t in enumerate(captured):
        buf = grad_buffers.get(i)
        if buf is None:
            captured_grads.append(None)
        elif opts.deterministic:
            captured_grads.append((buf.double() * 2.0 ** -FIXED_POINT_BITS).to(t.dtype))
        else:
            captured_grads.append(buf.to(t.dtype))
    return dq, dk, dv, captured_grads
