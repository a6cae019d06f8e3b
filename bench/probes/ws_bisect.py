"""Which feature of flexcore's dense loop stops triton's warp specialization from compiling?
One kernel with a constexpr per feature; each feature alone, then all."""
import torch, triton, triton.language as tl

@triton.jit
def k_(Q, K, V, O, LSE, N_CTX, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
       TILE_IDX: tl.constexpr, MSAFE: tl.constexpr, PTR_Q: tl.constexpr, PERBH: tl.constexpr,
       DOTARGS: tl.constexpr, FUNC: tl.constexpr, LSE_ST: tl.constexpr, TRANS_AFTER: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    rows = off_hz * N_CTX
    TOTAL = tl.num_programs(1) * N_CTX
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if PERBH:
        dk = tl.make_tensor_descriptor(K + rows * HEAD_DIM, shape=[N_CTX, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        dv = tl.make_tensor_descriptor(V + rows * HEAD_DIM, shape=[N_CTX, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        base = 0
    else:
        dk = tl.make_tensor_descriptor(K, shape=[TOTAL, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        dv = tl.make_tensor_descriptor(V, shape=[TOTAL, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
        base = rows
    if PTR_Q:
        q = tl.load(Q + (rows + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
    else:
        dq = tl.make_tensor_descriptor(Q, shape=[TOTAL, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK_M, HEAD_DIM])
        q = dq.load([rows + start_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if FUNC:
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, dk, dv, base, N_CTX, qk_scale, BLOCK_N, TILE_IDX, MSAFE, DOTARGS, TRANS_AFTER)
    else:
        n_iter = tl.cdiv(N_CTX, BLOCK_N) if TILE_IDX else N_CTX
        step = 1 if TILE_IDX else BLOCK_N
        for i in tl.range(0, n_iter, step, warp_specialize=True):
            start_n = i * BLOCK_N if TILE_IDX else i
            if TRANS_AFTER:
                kt = dk.load([base + start_n, 0]).T
                qk = tl.dot(q, kt, input_precision="ieee", out_dtype=tl.float32) if DOTARGS else tl.dot(q, kt)
            else:
                k = dk.load([base + start_n, 0])
                qk = tl.dot(q, k.T, input_precision="ieee", out_dtype=tl.float32) if DOTARGS else tl.dot(q, k.T)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if MSAFE:
                m_s = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_s = m_new
            p = tl.math.exp2(qk * qk_scale - m_s[:, None])
            alpha = tl.math.exp2(m_i - m_s)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = dv.load([base + start_n, 0])
            if DOTARGS:
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(p.to(tl.bfloat16), v, acc)
            m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + (rows + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], out.to(tl.bfloat16))
    if LSE_ST:
        tl.store(LSE + rows + offs_m, m_i + tl.math.log2(l_i))

@triton.jit
def _loop(acc, l_i, m_i, q, dk, dv, base, N_CTX, qk_scale, BLOCK_N: tl.constexpr, TILE_IDX: tl.constexpr,
          MSAFE: tl.constexpr, DOTARGS: tl.constexpr, TRANS_AFTER: tl.constexpr):
    n_iter = tl.cdiv(N_CTX, BLOCK_N) if TILE_IDX else N_CTX
    step = 1 if TILE_IDX else BLOCK_N
    for i in tl.range(0, n_iter, step, warp_specialize=True):
        start_n = i * BLOCK_N if TILE_IDX else i
        k = dk.load([base + start_n, 0])
        qk = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([base + start_n, 0])
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new
    return acc, l_i, m_i

import flexcore.kernels.forward as F
F.use_tma((torch.empty(2, 2, 2, 64, device="cuda", dtype=torch.bfloat16),), True)  # sets the allocator
B, H, S, D = 4, 16, 4096, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
o = torch.empty_like(q); lse = torch.empty(B, H, S, device="cuda")
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
flags = ["TILE_IDX", "MSAFE", "PTR_Q", "PERBH", "DOTARGS", "FUNC", "LSE_ST", "TRANS_AFTER"]
combos = [{}] + [{f: True} for f in flags] + [{f: True for f in flags if f != "FUNC"}]
flops = 4 * B * H * S * S * D
for c in combos:
    kw = {f: c.get(f, False) for f in flags}
    try:
        fn = lambda: k_[(S // 128, B * H)](q, k, v, o, lse, S, D ** -0.5 * 1.4426950408889634, D, 128, 128, **kw, num_warps=4, num_stages=2)
        fn(); torch.cuda.synchronize()
        err = (o.float() - ref.float()).abs().max().item()
        ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
        print(f"{c}: {flops / ms / 1e9:.0f} TFLOP/s err {err:.0e}", flush=True)
    except Exception as e:
        print(f"{c}: FAIL {type(e).__name__}", flush=True)
