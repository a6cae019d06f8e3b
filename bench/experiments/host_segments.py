"""Where does a host-bound forward+backward call's host time go, segment by segment, and how does
putting the process on one core change it?

Segments (perf_counter stamps): the forward call; from its return until flexcore's backward starts
on autograd's device thread; the backward's host code; from its return until autograd.grad returns
to the caller. Percentiles p20/p50/p80 over 300 calls, the GPU's queue kept behind with a sleep
kernel so that each segment is the host's own time. Each mode runs in a fresh process: plain; with
the garbage collector off; pinned to one core before autograd's threads start; and torch's compiled
flex_attention's whole call for comparison. D=64, B=4, H=16, S=4096, bf16, the anchors' document
and sliding-window masks. Needs a CUDA GPU (and a machine with at least 3 cores for the pinned mode).

It reaches into flexcore's autograd Function (flexcore.attention._FlexAttention.backward) to stamp
the backward; update that line if the Function moves.

Usage: PYTHONPATH=. python3 bench/experiments/host_segments.py
See docs/decisions.md#host-pinning (why the bench pins its host threads while timing).
"""
import subprocess
import sys

if len(sys.argv) == 1:
    for mode in ("plain", "nogc", "pinned", "torch"):
        print(subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True).stdout, end="", flush=True)
    sys.exit()

MODE = sys.argv[1]
import gc  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

if MODE == "pinned":
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[2]})
import torch  # noqa: E402

import flexcore.attention as A  # noqa: E402
from bench.mods import resolve  # noqa: E402
from flexcore import create_block_mask, flex_attention  # noqa: E402

B, H, S, D, N = 4, 16, 4096, 64, 300
stamps = []
real_backward = A._FlexAttention.backward


def backward(ctx, *grads):
    stamps.append(time.perf_counter())
    try:
        return real_backward(ctx, *grads)
    finally:
        stamps.append(time.perf_counter())


A._FlexAttention.backward = staticmethod(backward)
if MODE == "torch":
    from torch.nn.attention.flex_attention import create_block_mask as t_cbm
    from torch.nn.attention.flex_attention import flex_attention as t_flex
    fa, cbm = torch.compile(t_flex), t_cbm
else:
    fa, cbm = flex_attention, create_block_mask
if MODE == "nogc":
    gc.disable()


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e6


for spec in ("document(num_documents=8)", "sliding_window(window_size=1024)"):
    mods = resolve(spec, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda")
    bm = cbm(mods.mask_mod, B, None, S, S, device="cuda")
    sets = []
    for _ in range(2):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sets.append((q, k, v, torch.randn_like(q)))
    segs = {"forward": [], "engine in": [], "backward": [], "engine out": [], "whole": []}
    for rnd in range(2):
        for i in range(N):
            if i % 50 == 0:
                torch.cuda.synchronize()  # a bounded queue: at most 50 calls ahead
            torch.cuda._sleep(1_000_000)  # about 0.5 ms: the GPU stays behind the host
            q, k, v, do = sets[i % 2]
            stamps.clear()
            t0 = time.perf_counter()
            out = fa(q, k, v, block_mask=bm)
            t1 = time.perf_counter()
            torch.autograd.grad(out, [q, k, v], do)
            t2 = time.perf_counter()
            if rnd == 0:
                continue  # warm-up round
            segs["forward"].append(t1 - t0)
            segs["whole"].append(t2 - t0)
            if len(stamps) == 2:
                segs["engine in"].append(stamps[0] - t1)
                segs["backward"].append(stamps[1] - stamps[0])
                segs["engine out"].append(t2 - stamps[1])
        torch.cuda.synchronize()
    row = "; ".join(f"{k} {pct(v, .2):.0f}/{pct(v, .5):.0f}/{pct(v, .8):.0f}" for k, v in segs.items() if v)
    print(f"{MODE:7s} {spec.split('(')[0]:15s} us p20/p50/p80: {row}", flush=True)
