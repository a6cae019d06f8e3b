"""Backward probabilities from lse2 (P_FROM_LSE) against (m, 1/l), alternating rounds: median
forward+backward ms and the backward's TFLOP/s (2.5x the forward's density-scaled FLOPs, forward
time measured alone), bf16 H=16, anchors shapes, D=128 and 64."""
import torch, triton
from flexcore import flex_attention, create_block_mask
import flexcore.kernels.backward as BW

H = 16
def causal(b, h, q, kv): return q >= kv
def alibi(s, b, h, q, kv): return s - (h + 1).to(s.dtype) * 0.05 * (q - kv)
def softcap(s, b, h, q, kv): return 30.0 * torch.tanh(s / 30.0)
for D in (128, 64):
    for B, S in ((4, 4096), (1, 16384)):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        doc = torch.arange(S, device="cuda") // (S // 8)
        def document(b, h, qi, kv): return doc[qi] == doc[kv]
        for name, sm, mm in (("noop", None, None), ("causal", None, causal), ("alibi_causal", alibi, causal),
                             ("document", None, document), ("softcap_causal", softcap, causal)):
            bm = None if mm is None else create_block_mask(mm, None, None, S, S, device="cuda")
            dens = 1.0 if bm is None else 1.0 - bm.sparsity() / 100
            flops = 4 * B * H * S * S * D * dens
            def step():
                flex_attention(q, k, v, score_mod=sm, block_mask=bm).backward(g)
            fwd = triton.testing.do_bench(lambda: flex_attention(q, k, v, score_mod=sm, block_mask=bm),
                                          warmup=10, rep=100, return_mode="median")
            res = {True: [], False: []}
            for r in range(3):
                for flag in (True, False):
                    BW.P_FROM_LSE = flag
                    res[flag].append(triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median"))
            on, off = min(res[True]), min(res[False])
            tf = lambda ms: 2.5 * flops / (ms - fwd) / 1e9
            print(f"D={D} S={S} {name:15s} lse2 {on:.3f} ms ({tf(on):.0f})  row stats {off:.3f} ms "
                  f"({tf(off):.0f})  gain {off / on:.3f}", flush=True)
