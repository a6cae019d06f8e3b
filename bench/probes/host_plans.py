"""Per-call plans (bench/NOTES.md entry 36): host time per call with plans off and on, and the
wall time per call of a loop that the GPU runs, for forward+backward and the forward alone.
Host time: the GPU is kept busy by a long sleep kernel so that the host never waits on it (as in
host_fb.py). Wall time: a loop of calls on an idle GPU, timed by events (the larger of host and
GPU time). bf16, H=16, S=4096, D=128 and D=64, document mask (8 documents) and sliding window.
Usage: PYTHONPATH=. python3 bench/probes/host_plans.py [--calls=50] [--rounds=5]"""
import statistics
import sys
import time

import torch

from flexcore import create_block_mask, flex_attention
from flexcore.kernels import launch as L

ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
CALLS, ROUNDS = int(ARGS.get("calls", 50)), int(ARGS.get("rounds", 5))
B, H, S = 4, 16, 4096
doc = torch.arange(S, device="cuda") // (S // 8)


def document(b, h, qi, kv):
    return doc[qi] == doc[kv]


def sliding(b, h, qi, kv):
    return (qi >= kv) & (qi - kv <= 1024)


def host_us(fn):
    per = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return min(per), statistics.median(per)


def wall_us(fn):
    per = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        torch.cuda.synchronize()
        per.append(start.elapsed_time(end) / CALLS * 1e3)
    return min(per), statistics.median(per)


for D in (128, 64):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn_like(q)
    for name, mm in (("document", document), ("sliding", sliding)):
        mask = create_block_mask(mm, None, None, S, S)
        cases = {
            "fwd+bwd": lambda: torch.autograd.grad(flex_attention(q, k, v, block_mask=mask), (q, k, v), g),
            "fwd": lambda: flex_attention(q.detach(), k.detach(), v.detach(), block_mask=mask),
        }
        for tag, fn in cases.items():
            for plans in (False, True, False, True):
                L.PLANS = plans
                for _ in range(3):
                    fn()
                h_lo, h_med = host_us(fn)
                w_lo, w_med = wall_us(fn)
                print(f"D={D} {name:9s} {tag:8s} plans={'on ' if plans else 'off'} host {h_lo:6.1f} "
                      f"(median {h_med:6.1f}) us   wall {w_lo:6.1f} (median {w_med:6.1f}) us", flush=True)
L.PLANS = True
