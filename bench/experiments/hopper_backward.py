"""On a Hopper GPU, how does the Gluon backward compare with the Triton template's backward and with
torch's compiled flex_attention, and do the two flexcore backwards give the same gradients?

Prints a markdown table per mask and size: forward+backward and forward alone (do_bench medians,
min over rounds), their difference as the backward, the ratios to torch flex, and the largest
difference between the two flexcore backwards' gradients (0 when they are bit-identical, as they
should be). With --profile, also each kernel's GPU time per call. bf16, H=16, D=128, B = 16384 / S.
Needs an sm_90 GPU.

It chooses the backward with the dispatch policy's gluon.backward, passed in kernel_options
("auto": by the rule, "off": the template); each choice keys its own per-call plans.

Usage: PYTHONPATH=. python3 bench/experiments/hopper_backward.py [--rounds=2] [--sizes=4096,16384]
       [--masks=noop,causal,sliding,prefix,document] [--profile]
See docs/decisions.md#gluon-backward.
"""
import sys

import torch
from torch.nn.attention import flex_attention as tf
from triton.testing import do_bench

from flexcore import KernelOptions, create_block_mask, flex_attention
from flexcore.kernels.policy import DispatchPolicy

def backward_options(gluon: str) -> KernelOptions:
    """Kernel options with the Gluon backward by the rule ("auto") or off (the template's)."""
    return KernelOptions(policy=DispatchPolicy().replace(gluon={"backward": gluon}))


ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
ROUNDS = int(ARGS.get("rounds", 2))
SIZES = [int(s) for s in ARGS.get("sizes", "4096,16384").split(",")]
MASKS = ARGS.get("masks", "noop,causal,sliding,prefix,document").split(",")
PROFILE = "--profile" in sys.argv
torch._dynamo.config.cache_size_limit = 1000
torch_flex = torch.compile(tf.flex_attention, dynamic=False)


def mask_of(name, S):
    if name == "noop":
        return None
    if name == "causal":
        return lambda b, h, q, kv: q >= kv
    if name == "sliding":
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024)
    if name == "prefix":
        return lambda b, h, q, kv: (q >= kv) | (kv < S // 4)
    gen = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(S - 1, generator=gen)[:7] + 1).values
    doc = torch.zeros(S, dtype=torch.int32)
    doc[cuts] = 1
    doc = doc.cumsum(0).to("cuda")
    return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)


print(f"{torch.cuda.get_device_name()}; ms, median of do_bench; bwd = fwd+bwd - fwd")
print("| mask | S | fwd+bwd gluon | fwd+bwd template | fwd+bwd torch | bwd gluon | bwd template | bwd torch"
      " | fb gluon/torch | fb template/torch | max |dgrad| |")
for S in SIZES:
    B = 16384 // S
    q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    for name in MASKS:
        mod = mask_of(name, S)
        bm = None if mod is None else create_block_mask(mod, None, None, S, S, device="cuda")
        tbm = None if mod is None else tf.create_block_mask(mod, None, None, S, S, device="cuda")

        def ours(opts=None):
            return torch.autograd.grad(flex_attention(q, k, v, block_mask=bm, kernel_options=opts), (q, k, v), go)

        def ours_fwd():
            with torch.no_grad():
                return flex_attention(q, k, v, block_mask=bm)

        def theirs():
            return torch.autograd.grad(torch_flex(q, k, v, block_mask=tbm), (q, k, v), go)

        def theirs_fwd():
            with torch.no_grad():
                return torch_flex(q, k, v, block_mask=tbm)

        grads = {}
        times = {key: [] for key in ("g", "t", "x", "gf", "xf")}
        for r in range(ROUNDS):
            for key, gluon in (("g", "auto"), ("t", "off")):
                opts = backward_options(gluon)
                grads[key] = ours(opts)
                times[key].append(do_bench(lambda: ours(opts), warmup=10, rep=200, return_mode="median"))
            times["gf"].append(do_bench(ours_fwd, warmup=10, rep=200, return_mode="median"))
            theirs()
            times["x"].append(do_bench(theirs, warmup=10, rep=200, return_mode="median"))
            times["xf"].append(do_bench(theirs_fwd, warmup=10, rep=200, return_mode="median"))
        t = {key: min(val) for key, val in times.items()}
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads["g"], grads["t"]))
        if PROFILE:
            for gluon in ("auto", "off"):
                opts = backward_options(gluon)
                ours(opts)
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        ours(opts)
                    torch.cuda.synchronize()
                rows = [(e.key[:40], e.device_time_total / 5 / 1000) for e in prof.key_averages()]
                print(f"  {name} {S} {'gluon' if gluon == 'auto' else 'template'} kernels (ms per call): "
                      + ", ".join(f"{k} {t:.3f}" for k, t in sorted(rows, key=lambda r: -r[1])[:5]))
        print(f"| {name} | {S} | {t['g']:.3f} | {t['t']:.3f} | {t['x']:.3f} | {t['g'] - t['gf']:.3f} | "
              f"{t['t'] - t['gf']:.3f} | {t['x'] - t['xf']:.3f} | {t['x'] / t['g']:.3f} | {t['x'] / t['t']:.3f} | "
              f"{diff:.2e} |", flush=True)
