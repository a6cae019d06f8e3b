"""How far a hand-scheduled forward goes on Hopper (bench/NOTES.md entry 40): dense attention
forwards (no mask, no score_mod, bf16) written in Gluon, triton's explicit-layout dialect, against
flexcore's forward and SDPA cuDNN, TFLOP/s over two alternating rounds and the max error of a slice
against float32 SDPA. The variants, in the order they were tried:
- `gluon_attention_fwd` (names without "s"/"o"): 8 warps, both warpgroups issue the TMA loads of
  two K and two V slots themselves (a CTA barrier before each reuse); in iteration j it issues
  S(j+1) = Q K(j+1)^T, runs the softmax of S(j), waits for P(j-1) V(j-1), rescales O, issues
  P(j) V(j) and waits for S(j+1);
- `gluon_attention_fwd_ws` ("ws"): the same loop, the loads from one loader warp (ready/empty
  mbarriers per slot);
- `gluon_attention_fwd_pp` ("g{BLOCK_N}s{slots}o{schedule}"): two compute warpgroups as separate
  partitions of 64 rows each, one loader warp; schedule 0 is the loop above, 1 is
  FlashAttention-3's order (both products issued back to back, the softmax of S(j) under
  P(j-1) V(j-1)), 2 is that order with the two warpgroups taking turns to issue.
Schedule 1 with 128-key tiles and 3 slots is what landed as flexcore.kernels.hopper (its softmax
step is taken from there: the dense module of templates/forward_hopper.py.tmpl).
Usage (GPU): PYTHONPATH=. python3 bench/probes/gluon_fwd.py [64,128]
"""
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

LOG2E = 1.4426950408889634

from flexcore.kernels import hopper  # noqa: E402

_softmax_step = hopper.dense_module()._softmax_step  # the kernel that landed (forward_hopper.py.tmpl)


@gluon.jit
def gluon_attention_fwd(q_desc, k_desc, v_desc, o_desc, LSE, seq_len, qk_scale_log2,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                        num_warps: gl.constexpr):
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    row0 = off_bh * seq_len
    q_row = row0 + start_m * BLOCK_M
    n_tiles = seq_len // BLOCK_N  # the host checked: seq_len is a multiple of 128, at least 2 tiles

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(2):
        mbarrier.expect(k_bar.index(i), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, 0], k_bar.index(i), k_smem.index(i))
        mbarrier.expect(v_bar.index(i), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, 0], v_bar.index(i), v_smem.index(i))

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    # K(0)'s slot is free: K(2) goes there, one iteration ahead of its use.
    has2 = n_tiles > 2
    # Both warpgroups must be past their wait before one thread lets TMA overwrite a slot.
    gl.thread_barrier()
    mbarrier.expect(k_bar.index(0), k_desc.block_type.nbytes, pred=has2)
    tma.async_copy_global_to_shared(k_desc, [row0 + 2 * BLOCK_N, 0], k_bar.index(0), k_smem.index(0), pred=has2)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    # an asynchronous accumulator from the start: the loop carries the product in flight
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    for j in range(n_tiles - 1):
        nxt = (j + 1) % 2
        cur = j % 2
        # 1. S(j+1) on the tensor cores while the softmax of S(j) runs.
        mbarrier.wait(k_bar.index(nxt), ((j + 1) // 2) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # 2. softmax of S(j)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        # 3. P(j-1) V(j-1) done (the older of the two outstanding groups): its V slot takes V(j+1).
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        later = j >= 1
        gl.thread_barrier()
        mbarrier.expect(v_bar.index(nxt), v_desc.block_type.nbytes, pred=later)
        tma.async_copy_global_to_shared(v_desc, [row0 + (j + 1) * BLOCK_N, 0], v_bar.index(nxt), v_smem.index(nxt),
                                        pred=later)
        # 4. O = O * alpha + P(j) V(j), asynchronously.
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_bar.index(cur), (j // 2) & 1)
        acc = warpgroup_mma(p16, v_smem.index(cur), acc, is_async=True)
        # 5. wait for S(j+1) only; K(j+1)'s slot then takes K(j+3).
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        more = j + 3 < n_tiles
        gl.thread_barrier()
        mbarrier.expect(k_bar.index(nxt), k_desc.block_type.nbytes, pred=more)
        tma.async_copy_global_to_shared(k_desc, [row0 + (j + 3) * BLOCK_N, 0], k_bar.index(nxt), k_smem.index(nxt),
                                        pred=more)

    last = n_tiles - 1
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    mbarrier.wait(v_bar.index(last % 2), (last // 2) & 1)
    acc = warpgroup_mma(p16, v_smem.index(last % 2), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    q_smem.store(out.to(gl.bfloat16))  # Q's last reader (the last S) has completed
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    offs = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + row0 + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


# Warp-specialized variant: one loader warp issues every TMA load into NUM_STAGES slots of K and of
# V (ready/empty mbarriers per slot); the 8 compute warps run the same overlapped loop as above and
# release a slot once both warpgroups' products that read it have completed.
@gluon.jit
def _ws_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
             q_row, row0, n_tiles, BLOCK_N: gl.constexpr):
    NS: gl.constexpr = k_smem.type.shape[0]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for t in range(n_tiles):
        slot = t % NS
        ph = (t // NS) & 1
        mbarrier.wait(k_empty.index(slot), ph ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + t * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), ph ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + t * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_compute(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, LSE,
                q_row, row0, start_m, n_tiles, qk_scale_log2,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_WARPS: gl.constexpr):
    NS: gl.constexpr = k_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    gl.thread_barrier()
    mbarrier.arrive(k_empty.index(0), count=1)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    for j in range(n_tiles - 1):
        nxt = (j + 1) % NS
        cur = j % NS
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // NS) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        gl.thread_barrier()
        mbarrier.arrive(v_empty.index((j + NS - 1) % NS), count=1, pred=j >= 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_ready.index(cur), (j // NS) & 1)
        acc = warpgroup_mma(p16, v_smem.index(cur), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(nxt), count=1)

    last = n_tiles - 1
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    mbarrier.wait(v_ready.index(last % NS), (last // NS) & 1)
    acc = warpgroup_mma(p16, v_smem.index(last % NS), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    q_smem.store(out.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    offs = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + row0 + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_attention_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, seq_len, qk_scale_log2,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    row0 = off_bh * seq_len
    q_row = row0 + start_m * BLOCK_M
    n_tiles = seq_len // BLOCK_N
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    gl.warp_specialize([
        (_ws_compute, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, LSE,
                       q_row, row0, start_m, n_tiles, qk_scale_log2, BLOCK_M, BLOCK_N, HEAD_DIM, num_warps)),
        (_ws_load, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                    q_row, row0, n_tiles, BLOCK_N)),
    ], [1], [24])


# Two compute warpgroups as separate partitions (FlashAttention-3's consumer warpgroups): each owns
# 64 query rows of the program's 128 and runs the overlapped loop on its own, so neither waits for
# the other; a slot of K or V is released when both have arrived on its empty barrier (count 2).
# One loader warp as above. Worker partitions share one signature, hence the unused arguments.
@gluon.jit
def _pp_load(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
             v_empty, turn, q_row, row0, start_m, n_tiles, qk_scale_log2,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, WG: gl.constexpr,
             SCHED: gl.constexpr):
    NS: gl.constexpr = k_smem.type.shape[0]
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * BLOCK_M, 0], q_bar.index(w), q_smem.index(w))
    for t in range(n_tiles):
        slot = t % NS
        ph = (t // NS) & 1
        mbarrier.wait(k_empty.index(slot), ph ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + t * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), ph ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + t * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _pp_compute(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                v_empty, turn, q_row, row0, start_m, n_tiles, qk_scale_log2,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, WG: gl.constexpr,
                SCHED: gl.constexpr):
    if SCHED == 0:
        _pp_loop_overlap(o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                         q_row, row0, start_m, n_tiles, qk_scale_log2, BLOCK_M, BLOCK_N, HEAD_DIM, WG)
    else:
        _pp_loop_fa3(o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                     q_row, row0, start_m, n_tiles, qk_scale_log2, BLOCK_M, BLOCK_N, HEAD_DIM, WG, SCHED == 2)


@gluon.jit
def _pp_loop_overlap(o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                     q_row, row0, start_m, n_tiles, qk_scale_log2,
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
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    for j in range(n_tiles - 1):
        nxt = (j + 1) % NS
        cur = j % NS
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // NS) & 1)
        s_next = warpgroup_mma(my_q, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(v_empty.index((j + NS - 1) % NS), count=1, pred=j >= 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_ready.index(cur), (j // NS) & 1)
        acc = warpgroup_mma(p16, v_smem.index(cur), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        mbarrier.arrive(k_empty.index(nxt), count=1)

    last = n_tiles - 1
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    mbarrier.wait(v_ready.index(last % NS), (last // NS) & 1)
    acc = warpgroup_mma(p16, v_smem.index(last % NS), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    my_q.store(out.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + WG * BLOCK_M, 0], my_q)
    offs = start_m * 2 * BLOCK_M + WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + row0 + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


# FlashAttention-3's order: both products of an iteration issued back to back (S(j) = Q K(j)^T and
# O += P(j-1) V(j-1)), the softmax of S(j) under P(j-1) V(j-1); with PINGPONG the two warpgroups
# take turns to issue (an mbarrier per warpgroup), so one's products run under the other's softmax.
@gluon.jit
def _pp_loop_fa3(o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                 q_row, row0, start_m, n_tiles, qk_scale_log2,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, WG: gl.constexpr,
                 PINGPONG: gl.constexpr):
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
    if PINGPONG:
        if WG == 1:
            mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 issues first

    mbarrier.wait(q_bar.index(WG), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    for j in range(1, n_tiles):
        sk = j % NS
        sv = (j - 1) % NS
        mbarrier.wait(k_ready.index(sk), (j // NS) & 1)
        mbarrier.wait(v_ready.index(sv), ((j - 1) // NS) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (j - 1) & 1)
        s_new = warpgroup_mma(my_q, k_smem.index(sk).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc_new = warpgroup_mma(p16, v_smem.index(sv), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_new, ))
        mbarrier.arrive(k_empty.index(sk), count=1)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale_log2)
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_new, ))
        mbarrier.arrive(v_empty.index(sv), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]

    last = n_tiles - 1
    mbarrier.wait(v_ready.index(last % NS), (last // NS) & 1)
    acc = warpgroup_mma(p16, v_smem.index(last % NS), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    my_q.store(out.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + WG * BLOCK_M, 0], my_q)
    offs = start_m * 2 * BLOCK_M + WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + row0 + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_attention_fwd_pp(q_desc, k_desc, v_desc, o_desc, LSE, seq_len, qk_scale_log2,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           NUM_STAGES: gl.constexpr, WG_REGS: gl.constexpr, SCHED: gl.constexpr,
                           num_warps: gl.constexpr):
    # BLOCK_M: rows per warpgroup (64); a program covers 2 * BLOCK_M rows
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    row0 = off_bh * seq_len
    q_row = row0 + start_m * 2 * BLOCK_M
    n_tiles = seq_len // BLOCK_N
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (_pp_compute, (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                       v_empty, turn, q_row, row0, start_m, n_tiles, qk_scale_log2, BLOCK_M, BLOCK_N, HEAD_DIM, 0, SCHED)),
        (_pp_compute, (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                       v_empty, turn, q_row, row0, start_m, n_tiles, qk_scale_log2, BLOCK_M, BLOCK_N, HEAD_DIM, 1, SCHED)),
        (_pp_load, (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                    v_empty, turn, q_row, row0, start_m, n_tiles, qk_scale_log2, BLOCK_M, BLOCK_N, HEAD_DIM, 1, SCHED)),
    ], [4, 1], [WG_REGS, 24])


def attention(q, k, v, block_n=128, num_warps=8, stages=0, maxnreg=168, pingpong=False, wg_regs=240, sched=0):
    """Dense bf16 attention, (B, H, S, D) contiguous, S a multiple of 128 (at least 256)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, H, S, D = q.shape
    assert q.dtype == torch.bfloat16 and S % 128 == 0 and S >= 256 and D in (64, 128)
    q2, k2, v2 = (t.reshape(B * H * S, D) for t in (q, k, v))
    o = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    lay_m = gl.NVMMASharedLayout.get_default_for([128, D], gl.bfloat16)
    lay_n = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    q_desc = TensorDescriptor.from_tensor(q2, [128, D], lay_m)
    o_desc = TensorDescriptor.from_tensor(o.view(B * H * S, D), [128, D], lay_m)
    k_desc = TensorDescriptor.from_tensor(k2, [block_n, D], lay_n)
    v_desc = TensorDescriptor.from_tensor(v2, [block_n, D], lay_n)
    grid = (S // 128, B * H)
    if pingpong:  # two compute warpgroups of 64 rows as separate partitions, one loader warp
        lay_h = gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
        q_desc = TensorDescriptor.from_tensor(q2, [64, D], lay_h)
        o_desc = TensorDescriptor.from_tensor(o.view(B * H * S, D), [64, D], lay_h)
        gluon_attention_fwd_pp[grid](q_desc, k_desc, v_desc, o_desc, lse, S, D ** -0.5 * LOG2E,
                                     64, block_n, D, stages, wg_regs, sched, num_warps=4, maxnreg=maxnreg)
    elif stages:  # warp-specialized: stages slots of K and of V, one loader warp
        gluon_attention_fwd_ws[grid](q_desc, k_desc, v_desc, o_desc, lse, S, D ** -0.5 * LOG2E,
                                     128, block_n, D, stages, num_warps=num_warps, maxnreg=maxnreg)
    else:
        gluon_attention_fwd[grid](q_desc, k_desc, v_desc, o_desc, lse, S, D ** -0.5 * LOG2E,
                                  128, block_n, D, num_warps=num_warps)
    return o, lse


def _cudnn(q, k, v):
    import torch.nn.functional as Fn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return Fn.scaled_dot_product_attention(q, k, v)


if __name__ == "__main__":
    import torch
    import torch.nn.functional as Fn

    from flexcore import flex_attention

    # (BLOCK_N, stages, schedule): stages 0 is the kernel without warp specialization; schedules of
    # the two-partition kernel: 0 overlapped loop, 1 FlashAttention-3's order, 2 that order in turns
    CANDS = {128: [(128, 3, 0), (128, 3, 1), (128, 3, 2), (128, 2, 2), (64, 3, 2)],
             64: [(128, 3, 0), (128, 3, 1), (128, 3, 2), (64, 4, 2)]}
    dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "128,64").split(",")]
    H = 16
    torch.manual_seed(0)
    for D in dims:
        for B, S in ((4, 4096), (1, 16384)):
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * B * H * S * S * D
            ref = Fn.scaled_dot_product_attention(*(t[:1, :2].float() for t in (q, k, v)))
            res = []
            cands = [("flexcore", lambda: flex_attention(q, k, v)),
                     ("cudnn", lambda: _cudnn(q, k, v))]
            for bn, ns, sc in CANDS[D]:
                name = f"g{bn}s{ns}o{sc}"
                cands.append((name, lambda bn=bn, ns=ns, sc=sc: attention(q, k, v, bn, 8, ns, pingpong=True, sched=sc)))
            for rnd in range(2):
                for name, fn in cands:
                    try:
                        out = fn()
                        out = out[0] if isinstance(out, tuple) else out
                        if rnd == 0:
                            err = (out[:1, :2].float() - ref).abs().max().item()
                        ms = triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")
                        res.append(f"{name} {flops / ms / 1e9:4.0f}" + (f" (err {err:.1e})" if rnd == 0 else ""))
                    except Exception as exc:  # a probe: report and go on
                        res.append(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            print(f"D={D} S={S}: " + " | ".join(res), flush=True)

