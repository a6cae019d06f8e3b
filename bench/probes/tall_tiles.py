"""Dense path with query tiles taller than a mask block (BLOCK_M=256 over 128-token blocks):
forward TFLOP/s (4*B*H*S*S*D) per tile configuration, bf16 H=16, anchors shapes, and the max
difference to the table path. Usage: PYTHONPATH=. python3 bench/probes/tall_tiles.py [mods...]

Entry 28 ran it with a host change that was not kept: `_launcher` accepted dense candidates whose
BLOCK_M is a multiple of the mask block, and EVEN_Q was taken against the largest candidate.
Without it the 256-row candidates are filtered out, and the probe prints "not run" for them."""
import sys, time
import torch, triton
from flexcore import flex_attention
import flexcore.kernels.forward as F

torch.manual_seed(0)
H = 16
MODS = {"noop": None, "alibi": lambda s, b, h, q, kv: s - (h + 1).to(s.dtype) * 0.05 * (q - kv).abs(),
        "softcap": lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)}
CANDS = {128: [(128, 64, 4, 2), (256, 64, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2), (128, 128, 8, 2)],
         64: [(128, 128, 4, 3), (256, 64, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2), (256, 128, 8, 3)]}
only = sys.argv[1:] or ["noop", "alibi"]
def bench(fn): return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
for D in (64, 128):
    for B, S in ((4, 4096), (1, 16384)):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * S * S * D
        for name in only:
            mod = MODS[name]
            F.DENSE = False; F._autotuners.clear()
            ref = flex_attention(q, k, v, score_mod=mod)
            base = bench(lambda: flex_attention(q, k, v, score_mod=mod))
            line = [f"D={D} S={S} {name:7s} table {flops / base / 1e9:4.0f}"]
            F.DENSE = True
            for cfg in CANDS[D]:
                F._DENSE_CONFIGS[D] = [cfg]; F._autotuners.clear()
                tag = "x".join(map(str, cfg[:2])) + f"w{cfg[2]}s{cfg[3]}"
                try:
                    t0 = time.time()
                    out = flex_attention(q, k, v, score_mod=mod); torch.cuda.synchronize()
                    ct = time.time() - t0
                    used = [c for c in F._autotuners.values() if isinstance(c, triton.Config)]
                    if not used or used[0].kwargs["BLOCK_M"] != cfg[0]:
                        line.append(f"{tag} not run"); continue
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = bench(lambda: flex_attention(q, k, v, score_mod=mod))
                    line.append(f"{tag} {flops / ms / 1e9:4.0f} ({err:.0e},{ct:.1f}s)")
                except Exception as e:
                    line.append(f"{tag} FAIL {type(e).__name__}:{str(e).splitlines()[0][:60] if str(e) else ''}")
            print(" | ".join(line), flush=True)
