"""Full-block runs (FULL_RUNS) and the dense path (DENSE) against the table path: forward TFLOP/s
(density-scaled FLOPs), bf16 H=16, anchors shapes, D=128 and 64. Each kernel autotuned."""
import sys
import torch, triton
from flexcore import flex_attention, create_block_mask
import flexcore.kernels.forward as F

H = 16
def causal(b, h, q, kv): return q >= kv
def window(b, h, q, kv): return (q >= kv) & (q - kv < 1024)
def alibi(s, b, h, q, kv): return s - (h + 1).to(s.dtype) * 0.05 * (q - kv)
def softcap(s, b, h, q, kv): return 30.0 * torch.tanh(s / 30.0)
def variants(S):
    doc = (torch.arange(S, device="cuda") // (S // 8))
    def document(b, h, q, kv): return doc[q] == doc[kv]
    def prefix(b, h, q, kv): return (q >= kv) | (kv < S // 4)
    return {"noop": (None, None), "causal": (None, causal), "alibi_causal": (alibi, causal),
            "window": (None, window), "prefix": (None, prefix), "document": (None, document),
            "softcap_causal": (softcap, causal)}
def bench(fn): return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
for D in (128, 64):
    for B, S in ((4, 4096), (1, 16384)):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, (sm, mm) in variants(S).items():
            bm = None if mm is None else create_block_mask(mm, None, None, S, S, device="cuda")
            dens = 1.0 if bm is None else 1.0 - bm.sparsity() / 100
            flops = 4 * B * H * S * S * D * dens
            res = []
            for tag, dense, runs in (("table", False, False), ("new", True, True), ("table2", False, False)):
                F.DENSE, F.FULL_RUNS = dense, runs
                out = flex_attention(q, k, v, score_mod=sm, block_mask=bm)
                if tag == "table": ref = out
                err = (out.float() - ref.float()).abs().max().item()
                ms = bench(lambda: flex_attention(q, k, v, score_mod=sm, block_mask=bm))
                res.append(f"{tag} {flops / ms / 1e9:4.0f}" + (f" (err {err:.0e})" if tag == "new" else ""))
            print(f"D={D} S={S} {name:15s} " + " | ".join(res), flush=True)
