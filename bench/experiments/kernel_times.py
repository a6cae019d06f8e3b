"""Where does a forward+backward call's GPU time go, kernel by kernel, for flexcore and for torch's
compiled flex_attention?

For each mask and size it prints the wall time per iteration, the sum of the GPU kernels' times
(torch.profiler, 20 iterations after 5 of warm-up) and the eight longest kernels. A gap between the
wall time and the kernels' sum is host time or launch gaps; a difference between two providers'
kernels of the same name says which kernel to work on. bf16, H=16, D=128, B = 16384 / S.
Needs a CUDA GPU. The bench times whole calls only; this splits them.

Usage: PYTHONPATH=. python3 bench/experiments/kernel_times.py [--variants=noop,causal,sliding,document]
       [--shapes=4096,16384]
See docs/decisions.md#backward-tiles (the measurement that found the backward kernels at parity).
"""
import sys
import time
from collections import defaultdict

import torch
from torch.nn.attention import flex_attention as tfa

from flexcore import create_block_mask, flex_attention

H, D, ITERS = 16, 128, 20
ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
torch_flex = torch.compile(tfa.flex_attention, dynamic=False)


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 1024)


def masks(name, S):
    doc = torch.arange(S, device="cuda") // (S // 8)

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    return {"noop": None, "causal": causal, "sliding": sliding, "document": document}[name]


def profile(fn):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / ITERS * 1e3
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time_total / ITERS / 1e3
    return wall, per


for S in [int(s) for s in ARGS.get("shapes", "4096,16384").split(",")]:
    B = 16384 // S
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    for name in ARGS.get("variants", "noop,causal,sliding,document").split(","):
        mm = masks(name, S)
        ours = create_block_mask(mm, None, None, S, S) if mm else None
        theirs = tfa.create_block_mask(mm, None, None, S, S) if mm else None
        for tag, fn in (("flexlab", lambda: torch.autograd.grad(
                            flex_attention(q, k, v, block_mask=ours), (q, k, v), g)),
                        ("torch_flex", lambda: torch.autograd.grad(
                            torch_flex(q, k, v, block_mask=theirs), (q, k, v), g))):
            wall, per = profile(fn)
            total = sum(per.values())
            print(f"S={S} {name:9s} {tag:10s} wall {wall:.3f} ms, kernels {total:.3f} ms", flush=True)
            for kname, ms in sorted(per.items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {ms:8.4f} ms  {kname}", flush=True)
