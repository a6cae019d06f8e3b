"""Dense path for all-full masks: candidate tile configurations against the block-table path,
bf16, H=16, anchors shapes; score-only mods (noop, alibi, softcap, captured bias). Prints TFLOP/s
(non-causal FLOPs 4*B*H*S*S*D) and the max difference to the table path.
Usage: PYTHONPATH=. python3 bench/probes/dense_probe.py [mods...]

`sweep` is shared with tall_tiles.py; MODS with ws_dense.py. Each candidate is measured alone:
the warp-specialized candidate of entry 30 is switched off (WARP_SPEC = False) so that the
autotuner cannot pick it instead."""
import sys, time
import torch, triton
from flexcore import flex_attention
import flexcore.kernels.forward as F

torch.manual_seed(0)
H = 16
bias_table = torch.randn(H, device="cuda")
MODS = {
    "noop": None,
    "alibi": lambda s, b, h, q, kv: s - (h + 1).to(s.dtype) * 0.05 * (q - kv).abs(),
    "softcap": lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0),
    "headbias": lambda s, b, h, q, kv: s + bias_table[h],
}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) as flexcore.kernels.forward._DENSE_CONFIGS. The
# warp-specialized candidates of bench/NOTES.md entry 26 ran on a kernel with a WARP_SPEC switch,
# which was not kept (wrong results).
CANDS = {128: [(128, 64, 4, 2), (128, 128, 8, 2), (128, 64, 4, 3)],
         64: [(128, 128, 4, 2), (128, 128, 4, 3), (64, 64, 4, 2)]}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def sweep(cands, names, dims=(128, 64)):
    """One line per (head dim, shape, mod): the table path, then each candidate of cands[D] alone
    on the dense path ("not run" where the host filtered it out)."""
    F.WARP_SPEC = False
    for D in dims:
        for B, S in ((4, 4096), (1, 16384)):
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * B * H * S * S * D
            for name in names:
                mod = MODS[name]
                F.DENSE = False; F._autotuners.clear()
                ref = flex_attention(q, k, v, score_mod=mod)
                base = bench(lambda: flex_attention(q, k, v, score_mod=mod))
                line = [f"D={D} S={S} {name:8s} table {flops / base / 1e9:4.0f}"]
                F.DENSE = True
                for cfg in cands[D]:
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
    F.WARP_SPEC = None


if __name__ == "__main__":
    sweep(CANDS, sys.argv[1:] or list(MODS))
