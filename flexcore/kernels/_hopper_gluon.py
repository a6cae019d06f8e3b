"""The Gluon kernel of flexcore.kernels.hopper (imported only on a CUDA machine whose triton has
Gluon's Hopper API; see that module for the schedule and where it is used)."""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.lru_cache(maxsize=None)
def _layout(block: int, head_dim: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([block, head_dim], _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int, block: int) -> TensorDescriptor:
    """A TMA descriptor over ``rows`` rows of ``t`` (B, H, N, D) of row stride t.stride(2), based
    at t's first element, read in blocks of ``block`` rows."""
    d = t.shape[-1]
    return TensorDescriptor(t, [rows, d], [t.stride(2), 1], [block, d], _layout(block, d, t.dtype))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale_log2):
    # The row max is kept in log2 units of the scaled scores, so "s * scale - m" is one FMA.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
    p = gl.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


# The partitions share one signature (a requirement of gl.warp_specialize's workers); each reads
# what it needs. WG: which compute warpgroup (the loader ignores it).
@gluon.jit
def _load(q_desc, k_desc, v_desc, o_desc, LSE, ROW_STATS, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
          v_ready, v_empty, q_row, k_row0, v_row0, o_row, stat_row, STATS_STRIDE, n_tiles, qk_scale_log2,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, WG: gl.constexpr):
    NS: gl.constexpr = k_smem.type.shape[0]
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * BLOCK_M, 0], q_bar.index(w), q_smem.index(w))
    for t in range(n_tiles):
        slot = t % NS
        phase = (t // NS) & 1
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row0 + t * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row0 + t * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _compute(q_desc, k_desc, v_desc, o_desc, LSE, ROW_STATS, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
             v_ready, v_empty, q_row, k_row0, v_row0, o_row, stat_row, STATS_STRIDE, n_tiles, qk_scale_log2,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, WG: gl.constexpr):
    NS: gl.constexpr = k_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    my_q = q_smem.index(WG)

    mbarrier.wait(q_bar.index(WG), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
    p16 = gl.convert_layout(p.to(v_desc.dtype), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    for j in range(1, n_tiles):
        sk = j % NS
        sv = (j - 1) % NS
        mbarrier.wait(k_ready.index(sk), (j // NS) & 1)
        mbarrier.wait(v_ready.index(sv), ((j - 1) // NS) & 1)
        # Both products of the iteration, back to back; then wait for S(j) only (the older group).
        s_new = warpgroup_mma(my_q, k_smem.index(sk).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc_new = warpgroup_mma(p16, v_smem.index(sv), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_new, ))
        mbarrier.arrive(k_empty.index(sk), count=1)
        # The softmax of S(j) runs while P(j-1) V(j-1) is on the tensor cores.
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
        p16 = gl.convert_layout(p.to(v_desc.dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_new, ))
        mbarrier.arrive(v_empty.index(sv), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]

    last = n_tiles - 1
    mbarrier.wait(v_ready.index(last % NS), (last // NS) & 1)
    acc = warpgroup_mma(p16, v_smem.index(last % NS), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    # Every row has keys (the dense case), so l > 0.
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    my_q.store(out.to(o_desc.dtype))  # this warpgroup's rows of Q: its last reader has completed
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [o_row + WG * BLOCK_M, 0], my_q)
    offs = stat_row + WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    gl.store(ROW_STATS + offs, m_i)
    gl.store(ROW_STATS + STATS_STRIDE + offs, 1.0 / l_i)
    tma.store_wait(pendings=0)


@gluon.jit
def flex_hopper_dense_fwd(q_desc, k_desc, v_desc, o_desc, LSE, ROW_STATS,
                          q_rb, q_rh, k_rb, k_rh, v_rb, v_rh, NUM_HEADS, GQA_GROUP, Q_LEN, KV_LEN, STATS_STRIDE,
                          qk_scale_log2,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                          NUM_STAGES: gl.constexpr, WG_REGS: gl.constexpr, num_warps: gl.constexpr):
    # BLOCK_M: rows per compute warpgroup; a program covers 2 * BLOCK_M query rows of one
    # (batch, head). Row indices are in rows of each tensor's (rows, HEAD_DIM) view.
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    off_b = off_bh // NUM_HEADS
    off_h = off_bh % NUM_HEADS
    off_hkv = off_h // GQA_GROUP
    q_row = off_b * q_rb + off_h * q_rh + start_m * 2 * BLOCK_M
    k_row0 = off_b * k_rb + off_hkv * k_rh
    v_row0 = off_b * v_rb + off_hkv * v_rh
    o_row = off_bh * Q_LEN + start_m * 2 * BLOCK_M
    stat_row = o_row
    n_tiles = KV_LEN // BLOCK_N

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a slot
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (_compute, (q_desc, k_desc, v_desc, o_desc, LSE, ROW_STATS, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                    v_ready, v_empty, q_row, k_row0, v_row0, o_row, stat_row, STATS_STRIDE, n_tiles, qk_scale_log2,
                    BLOCK_M, BLOCK_N, HEAD_DIM, 0)),
        (_compute, (q_desc, k_desc, v_desc, o_desc, LSE, ROW_STATS, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                    v_ready, v_empty, q_row, k_row0, v_row0, o_row, stat_row, STATS_STRIDE, n_tiles, qk_scale_log2,
                    BLOCK_M, BLOCK_N, HEAD_DIM, 1)),
        (_load, (q_desc, k_desc, v_desc, o_desc, LSE, ROW_STATS, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                 v_ready, v_empty, q_row, k_row0, v_row0, o_row, stat_row, STATS_STRIDE, n_tiles, qk_scale_log2,
                 BLOCK_M, BLOCK_N, HEAD_DIM, 1)),
    ], [4, 1], [WG_REGS, 24])
