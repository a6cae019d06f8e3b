"""The masked Gluon forward at head dim 64 with three compute warpgroups (192-row programs over two
mask blocks, walking union lists: flexcore.kernels.hopper.union_tables), against the Triton template
over the mask's own tables and over the finer tables it takes by default (REFINE): bf16, D=64, H=16,
the anchors' masks (and causal at 2k and 3k: rows of 8.5 and 12.5 blocks), forward under no_grad, do_bench median ms, min over alternating rounds; each
path's output against float64 first (B=1 H=2 at S=4096, 1280 and 768).
Usage: PYTHONPATH=. python3 bench/probes/gluon_union.py [rounds]"""
import sys

import torch
import triton

from bench.mods import resolve
from flexcore import create_block_mask, flex_attention
from flexcore.kernels import forward as F
from flexcore.kernels import hopper
from flexcore.kernels.launch import clear_plans
from flexcore.reference import flex_attention_reference

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
H, D = 16, 64
SPECS = ["causal", "sliding_window(window_size=1024)", "prefix_lm(prefix_fraction=0.25)", "document(num_documents=8)"]
PATHS = {  # (HOPPER_MASKED, REFINE)
    "template own": (False, False),
    "template default": (False, None),
    "gluon 3wg own": (True, False),
}
served = []
real = hopper.forward_masked


def spy(*a, **k):
    r = real(*a, **k)
    served.append(r is not None)
    return r


hopper.forward_masked = spy


def use(path):
    hopper.HOPPER_MASKED, F.REFINE = PATHS[path]
    clear_plans()


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def mask_of(spec, B, S):
    mods = resolve(spec, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda")
    return create_block_mask(mods.mask_mod, B, None, S, S, device="cuda")


for S in ((4096, 1280) if len(sys.argv) < 3 else ()):  # correctness first (skipped with a second argument)
    for spec in SPECS:
        bm = mask_of(spec, 1, S)
        q, k, v = (torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = flex_attention_reference(q.double(), k.double(), v.double(), block_mask=bm)
        for path in PATHS:
            use(path)
            served.clear()
            out = flex_attention(q, k, v, block_mask=bm)
            err = (out.double() - ref).abs().max().item()
            print(f"check S={S} {spec} {path}: gluon {served} max abs err vs float64 {err:.2e}", flush=True)

for B, S, specs in ((4, 4096, SPECS), (1, 16384, SPECS), (8, 2048, ["causal"]), (4, 3072, ["causal"])):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for spec in specs:
        bm = mask_of(spec, B, S)
        times = {p: [] for p in PATHS}
        with torch.no_grad():
            for _ in range(ROUNDS):
                for path in PATHS:
                    use(path)
                    times[path].append(ms(lambda: flex_attention(q, k, v, block_mask=bm)))
        base = min(times["template default"])
        row = " | ".join(f"{p} {min(t):.4f} ({base / min(t):.3f})" for p, t in times.items())
        print(f"B={B} S={S} {spec}: {row}", flush=True)
