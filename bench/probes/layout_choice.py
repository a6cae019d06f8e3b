"""The backward's layout tuner (flexcore.kernels.backward._tune_layout) on the rows whose
forward+backward ratio moves between anchors runs (bench/NOTES.md entry 38): what it picks over
fresh tunings, and forward+backward with one launch and with two forced, in alternating rounds.
bf16, H=16, D=128, B=4 S=4096 and B=1 S=16384, causal and prefix LM (S/4) masks.
Usage: PYTHONPATH=. python3 bench/probes/layout_choice.py [--tunings=6] [--rounds=3]
"""
import sys

import torch
from triton.testing import do_bench

from flexcore import create_block_mask, flex_attention
from flexcore.kernels import backward as bwd
from flexcore.kernels import launch as L

ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
TUNINGS, ROUNDS = int(ARGS.get("tunings", 6)), int(ARGS.get("rounds", 3))


def causal(b, h, q, kv):
    return q >= kv


def prefix_of(n):
    def prefix(b, h, q, kv):
        return (q >= kv) | (kv < n)
    return prefix


for B, S in ((4, 4096), (1, 16384)):
    q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    go = torch.randn_like(q)
    for name, mod in (("causal", causal), ("prefix", prefix_of(S // 4))):
        bm = create_block_mask(mod, B, None, S, S, device="cuda")

        def step():
            torch.autograd.grad(flex_attention(q, k, v, block_mask=bm), (q, k, v), go)

        picks = []
        for _ in range(TUNINGS):
            bwd._layout_choice.clear()
            L.clear_plans()
            step()
            picks.append("one" if next(iter(bwd._layout_choice.values())) else "two")
        times = {True: [], False: []}
        for _ in range(ROUNDS):
            for fused in (True, False):
                bwd.FUSED = fused
                L.clear_plans()
                for _ in range(3):
                    step()
                times[fused].append(do_bench(step, warmup=25, rep=300, return_mode="median"))
        bwd.FUSED = None
        print(f"{name} B={B} S={S}: tuner picks {picks}; fwd+bwd ms one launch "
              + " ".join(f"{t:.3f}" for t in times[True]) + ", two launches "
              + " ".join(f"{t:.3f}" for t in times[False]))
