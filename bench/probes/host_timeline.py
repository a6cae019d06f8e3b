"""Where the host's time of one forward+backward call goes (bench/NOTES.md entry 35): flexcore's
functions wrapped with perf_counter stamps, the GPU kept busy by a sleep kernel so that the host
never waits, mean microseconds of each segment over N calls (median of rounds). bf16, H=16, D=128,
B=4, S=4096, document mask.
Usage: PYTHONPATH=. python3 bench/probes/host_timeline.py [--calls=50] [--rounds=5] [--mask=document|sliding|causal|none]"""
import statistics
import sys
import time
from collections import defaultdict

import torch

import flexcore.attention as A
import flexcore.kernels.backward as BW
from flexcore import create_block_mask, flex_attention

ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
CALLS, ROUNDS = int(ARGS.get("calls", 50)), int(ARGS.get("rounds", 5))
B, H, S, D = 4, 16, 4096, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn_like(q)
doc = torch.arange(S, device="cuda") // (S // 8)
MASKS = {"document": lambda b, h, qi, kv: doc[qi] == doc[kv],
         "sliding": lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= 1024),
         "causal": lambda b, h, qi, kv: qi >= kv, "none": None}
mm = MASKS[ARGS.get("mask", "document")]
bm = create_block_mask(mm, None, None, S, S) if mm else None
stamps = []


def stamp(name):
    stamps.append((name, time.perf_counter()))


def wrap(owner, attr, name, static=False):
    real = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        stamp(name + " >")
        try:
            return real(*args, **kwargs)
        finally:
            stamp(name + " <")

    setattr(owner, attr, staticmethod(wrapped) if static else wrapped)


wrap(A, "_run_kernels", "fwd host")
wrap(A._FlexAttention, "backward", "Function.backward", static=True)
wrap(BW, "backward", "kernels.backward")
wrap(BW, "run", "run")  # preprocessing and one-launch backward
wrap(BW, "launch", "launch")  # two-launch backward


def call():
    stamp("call >")
    out = flex_attention(q, k, v, block_mask=bm)
    stamp("flex_attention <")
    torch.autograd.grad(out, (q, k, v), g)
    stamp("call <")


for _ in range(5):
    call()
seg_rounds = defaultdict(list)
for _ in range(ROUNDS):
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    stamps.clear()
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    seg = defaultdict(float)
    for (a, ta), (b, tb) in zip(stamps, stamps[1:]):
        if a == "call <":
            continue
        seg[f"{a:22s} -> {b}"] += (tb - ta) / CALLS * 1e6
    for key, us in seg.items():
        seg_rounds[key].append(us)
total = 0.0
for key, values in seg_rounds.items():
    med = statistics.median(values)
    total += med
    print(f"{med:8.1f} us  {key}", flush=True)
print(f"{total:8.1f} us  per call (sum of medians)", flush=True)
