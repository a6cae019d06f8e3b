"""How much host (CPU) time does one forward+backward call cost, flexcore against torch's compiled
flex_attention, and which Python functions hold it?

The GPU is kept busy by a long sleep kernel queued first, so the host never waits on it and a loop
of N calls measures the host's own time per call (min and median over rounds). Cases: flexcore
forward+backward, torch flex forward+backward, flexcore's forward with and without autograd. Then a
cProfile of flexcore's forward+backward calls, by own time and by cumulative time.
bf16, B=4, H=16, S=4096, D=128; the document mask (8 documents) and a 1024-token sliding window.
Needs a CUDA GPU. Compare the host time with the call's GPU time (kernel_times.py): a row whose
host time reaches its GPU time is host-bound.

Usage: PYTHONPATH=. python3 bench/experiments/host_time.py [--calls=50] [--rounds=7] [--profile=1]
See docs/decisions.md#host-bound-rows and #per-call-plans.
"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
from torch.nn.attention import flex_attention as tfa

from flexcore import create_block_mask, flex_attention

ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
CALLS, ROUNDS = int(ARGS.get("calls", 50)), int(ARGS.get("rounds", 7))
B, H, S, D = 4, 16, 4096, 128
torch_flex = torch.compile(tfa.flex_attention, dynamic=False)
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn_like(q)
doc = torch.arange(S, device="cuda") // (S // 8)


def document(b, h, qi, kv):
    return doc[qi] == doc[kv]


def sliding(b, h, qi, kv):
    return (qi >= kv) & (qi - kv <= 1024)


def host_us(fn):
    """Host microseconds per call with the GPU busy throughout (a sleep kernel queued first)."""
    per = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second at 2 GHz: longer than the loop
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return min(per), statistics.median(per)


for name, mm in (("document", document), ("sliding", sliding)):
    ours = create_block_mask(mm, None, None, S, S)
    theirs = tfa.create_block_mask(mm, None, None, S, S)
    cases = {
        "flexlab fwd+bwd": lambda: torch.autograd.grad(flex_attention(q, k, v, block_mask=ours), (q, k, v), g),
        "torch_flex fwd+bwd": lambda: torch.autograd.grad(torch_flex(q, k, v, block_mask=theirs), (q, k, v), g),
        "flexlab fwd (no grad)": lambda: flex_attention(q.detach(), k.detach(), v.detach(), block_mask=ours),
        "flexlab fwd (grad)": lambda: flex_attention(q, k, v, block_mask=ours),
    }
    for fn in cases.values():
        for _ in range(3):
            fn()
    for tag, fn in cases.items():
        lo, med = host_us(fn)
        print(f"{name:9s} {tag:22s} host {lo:7.1f} us (median {med:7.1f})", flush=True)
    if ARGS.get("profile", "1") == "1":
        fn = cases["flexlab fwd+bwd"]
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(28)
            lines = [ln for ln in out.getvalue().splitlines() if ln.strip()][-29:]
            print(f"--- {name}: by {key} (per {CALLS} calls)\n" + "\n".join(lines), flush=True)
