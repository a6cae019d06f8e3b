"""Does this triton still miscompile a warp-specialized attention loop when Q is read through a
tensor descriptor based at one head's rows?

A small dense forward (one loop over all keys, K/V through descriptors) with one constexpr per
feature of flexcore's loop. Each combination prints TFLOP/s and its largest error against SDPA;
a correct kernel shows about 5e-4. With triton 3.6 on an H200, warp specialization with a
per-head Q descriptor (the first combination) gave errors of 0.2-0.3 (NaN at 3 stages), and a
descriptor over all of Q's rows (GQ) was correct. flexcore's warp-specialized paths read Q that
way for this reason; rerun this after a triton upgrade to see whether the workaround is still
needed. B=4 H=16 S=4096, D=128 and 64, bf16. Needs a Hopper GPU.

Usage: PYTHONPATH=. python3 bench/experiments/ws_q_descriptor.py
See docs/decisions.md#dense-warp-specialization.
"""
import torch, triton, triton.language as tl

@triton.jit
def _inner(acc, l_i, m_i, q, desc_k, desc_v, KV_LEN, QK_SCALE_LOG2,
           BLOCK_N: tl.constexpr, WS: tl.constexpr, MSAFE: tl.constexpr, OFFS: tl.constexpr,
           RT_BEGIN: tl.constexpr, begin_rt, PLAIN_DOT: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    if RT_BEGIN:
        begin = begin_rt
    else:
        begin = 0
    for i in tl.range(begin, KV_LEN, BLOCK_N, warp_specialize=WS):
        start_n = i
        if OFFS:
            offs_n = start_n + offs_n0
            kv_ok = offs_n < KV_LEN
        kt = desc_k.load([start_n, 0]).T
        if PLAIN_DOT:
            qk = tl.dot(q, kt)
        else:
            qk = tl.dot(q, kt, input_precision="ieee", out_dtype=tl.float32)
        s = qk
        m_new = tl.maximum(m_i, tl.max(s, 1) * QK_SCALE_LOG2)
        if MSAFE:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(s * QK_SCALE_LOG2 - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([start_n, 0])
        if PLAIN_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee", out_dtype=tl.float32)
        m_i = m_new
    return acc, l_i, m_i

@triton.jit
def kern(Q, K, V, Out, LSE, ROW_STATS,
         stride_qb, stride_qh, stride_qm, stride_qd,
         stride_kb, stride_kh, stride_kn, stride_kd,
         stride_vb, stride_vh, stride_vn, stride_vd,
         stride_ob, stride_oh, stride_om, stride_od,
         STATS_STRIDE, Q_LEN, KV_LEN, NUM_HEADS, QK_SCALE_LOG2, zero_rt,
         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         WS: tl.constexpr, MSAFE: tl.constexpr, OFFS: tl.constexpr, RT_BEGIN: tl.constexpr,
         RT_STRIDES: tl.constexpr, EPI: tl.constexpr, QPTR: tl.constexpr, PLAIN_DOT: tl.constexpr,
         INLINE: tl.constexpr, GQ: tl.constexpr = False, GKV: tl.constexpr = False, NOMASK: tl.constexpr = False):
    LN2: tl.constexpr = 0.6931471805599453
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // NUM_HEADS
    off_h = off_bh % NUM_HEADS
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ok = offs_m < Q_LEN
    Q_bh = Q + off_b * stride_qb + off_h * stride_qh
    if QPTR:
        q = tl.load(Q_bh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    elif GQ:
        gq = tl.make_tensor_descriptor(Q, shape=[STATS_STRIDE, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
        q = gq.load([off_bh * Q_LEN + start_m * BLOCK_M, 0])
    else:
        if RT_STRIDES:
            desc_q = tl.make_tensor_descriptor(Q_bh, shape=[Q_LEN, HEAD_DIM], strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM])
        else:
            desc_q = tl.make_tensor_descriptor(Q_bh, shape=[Q_LEN, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
        q = desc_q.load([start_m * BLOCK_M, 0])
    K_bh = K + off_b * stride_kb + off_h * stride_kh
    V_bh = V + off_b * stride_vb + off_h * stride_vh
    if RT_STRIDES:
        desc_k = tl.make_tensor_descriptor(K_bh, shape=[KV_LEN, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM])
        desc_v = tl.make_tensor_descriptor(V_bh, shape=[KV_LEN, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    else:
        desc_k = tl.make_tensor_descriptor(K_bh, shape=[KV_LEN, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        desc_v = tl.make_tensor_descriptor(V_bh, shape=[KV_LEN, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
    kv_base = 0
    if GKV:
        desc_k = tl.make_tensor_descriptor(K, shape=[STATS_STRIDE, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        desc_v = tl.make_tensor_descriptor(V, shape=[STATS_STRIDE, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        kv_base = off_bh * KV_LEN
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if INLINE:
        for i in tl.range(0, KV_LEN, BLOCK_N, warp_specialize=WS):
            kt = desc_k.load([kv_base + i, 0]).T
            qk = tl.dot(q, kt)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * QK_SCALE_LOG2)
            p = tl.math.exp2(qk * QK_SCALE_LOG2 - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = desc_v.load([kv_base + i, 0])
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
            m_i = m_new
    else:
        acc, l_i, m_i = _inner(acc, l_i, m_i, q, desc_k, desc_v, KV_LEN, QK_SCALE_LOG2, BLOCK_N, WS, MSAFE,
                               OFFS, RT_BEGIN, zero_rt, PLAIN_DOT)
    if EPI:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
    else:
        out = acc / l_i[:, None]
    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    if NOMASK:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_ok[:, None])
    if EPI:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
        tl.store(LSE + off_bh * Q_LEN + offs_m, lse, mask=q_ok)
        tl.store(ROW_STATS + off_bh * Q_LEN + offs_m, m_i, mask=q_ok)
        tl.store(ROW_STATS + STATS_STRIDE + off_bh * Q_LEN + offs_m, tl.where(l_i == 0.0, 0.0, 1.0 / l_safe), mask=q_ok)

# Descriptors made inside a kernel live in global scratch memory, which triton allocates through this.
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
flags = ["MSAFE", "OFFS", "RT_BEGIN", "RT_STRIDES", "EPI", "QPTR", "PLAIN_DOT", "INLINE", "GQ", "GKV", "NOMASK"]
import sys
for D, cfgs in ((128, [(128, 128, 4, 2)]), (64, [(128, 128, 4, 2)])):
    B, H, S = 4, 16, 4096
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q); lse = torch.empty(B, H, S, device="cuda"); rs = torch.empty(2, B, H, S, device="cuda")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    flops = 4 * B * H * S * S * D
    combos = [dict(WS=True, INLINE=True), dict(WS=True, INLINE=True, GQ=True), dict(WS=True, INLINE=True, GKV=True),
              dict(WS=True, INLINE=True, NOMASK=True), dict(WS=True, INLINE=True, GQ=True, GKV=True),
              dict(WS=True, INLINE=True, GQ=True, GKV=True, NOMASK=True),
              dict(WS=False, INLINE=True, GQ=True, GKV=True, NOMASK=True)]
    for bm, bn, w, st in cfgs:
        for c in combos:
            kw = {f: c.get(f, False) for f in flags}
            fn = lambda: kern[(S // bm, B * H)](q, k, v, o, lse, rs, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                                               B * H * S, S, S, H, D ** -0.5 * 1.4426950408889634, 0,
                                               D, bm, bn, c["WS"], **kw, num_warps=w, num_stages=st)
            tag = f"D={D} {bm}x{bn}w{w}s{st} " + ",".join(k_ for k_, v_ in c.items() if v_ and k_ != "WS") + (" WS" if c["WS"] else " noWS")
            try:
                o.zero_(); fn(); torch.cuda.synchronize()
                err = (o.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                print(f"{tag}: {flops / ms / 1e9:.0f} TFLOP/s err {err:.0e}", flush=True)
            except Exception as e:
                print(f"{tag}: FAIL {type(e).__name__} {str(e).splitlines()[0][:80] if str(e) else ''}", flush=True)
