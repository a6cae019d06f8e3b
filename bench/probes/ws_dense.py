"""Warp-specialized dense path (bench/NOTES.md entry 30): forward TFLOP/s (4*B*H*S*S*D) with
WARP_SPEC False (the unspecialized candidates), True (only the specialized one) and None (all
autotuned), and the max difference to the table path; bf16 H=16, anchors shapes, D=128."""
import torch
from flexcore import flex_attention
import flexcore.kernels.forward as F
from bench.probes.dense_probe import H, MODS, bench

D = 128
for B, S in ((4, 4096), (1, 16384)):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D
    for name, mod in MODS.items():
        F.DENSE = False; F._autotuners.clear()
        ref = flex_attention(q, k, v, score_mod=mod)
        line = [f"S={S} {name:8s}"]
        F.DENSE = True
        for ws in (False, True, None, False, True):
            F.WARP_SPEC = ws; F._autotuners.clear()
            out = flex_attention(q, k, v, score_mod=mod)
            err = (out.float() - ref.float()).abs().max().item()
            ms = bench(lambda: flex_attention(q, k, v, score_mod=mod))
            line.append(f"ws={ws} {flops / ms / 1e9:4.0f} ({err:.0e})")
        print(" | ".join(line), flush=True)
F.WARP_SPEC = None
