"""Backward run path on/off, alternating rounds: fwd+bwd ms (median), bf16 H=16, D=128 and 64."""
import torch, triton
from flexcore import flex_attention, create_block_mask
import flexcore.kernels.backward as BW

H = 16
def causal(b, h, q, kv): return q >= kv
def alibi(s, b, h, q, kv): return s - (h + 1).to(s.dtype) * 0.05 * (q - kv)
for D in (128, 64):
    for B, S in ((4, 4096), (1, 16384)):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        def prefix(b, h, qi, kv): return (qi >= kv) | (kv < S // 4)
        for name, sm, mm in (("causal", None, causal), ("alibi_causal", alibi, causal), ("prefix", None, prefix), ("noop", None, None)):
            bm = None if mm is None else create_block_mask(mm, None, None, S, S, device="cuda")
            def step():
                flex_attention(q, k, v, score_mod=sm, block_mask=bm).backward(g)
            res = {True: [], False: []}
            for r in range(3):
                for flag in (True, False):
                    BW.FULL_RUNS = flag
                    res[flag].append(triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median"))
            on, off = min(res[True]), min(res[False])
            print(f"D={D} S={S} {name:13s} runs {on:.3f} ms  tables {off:.3f} ms  gain {off / on:.3f}", flush=True)
