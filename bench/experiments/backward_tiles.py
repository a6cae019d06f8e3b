"""Which dK/dV tile is fastest for a score_mod's backward at head dim 128?

Offline, the 64x128 (8 warps) dK/dV tile spills 88-176 bytes for softcap and for mods that write
captured gradients, and a 32-row tile does not (bench/experiments/backward_sass.py,
docs/decisions.md#bf16-captured-rounding). This times forward+backward with each dK/dV
configuration in turn (the backward's table entry for head dim 128 replaced, per-call plans and
layout choices cleared), in interleaved rounds, and prints each one's median (ms), its speed
against the current table's and its largest gradient difference to it. bf16, H=16, D=128, the
anchors' shapes (B=4 S=4096, B=1 S=16384). Needs a CUDA GPU. Reaches into
flexcore.kernels.backward (_DKDV_CONFIGS, _layout_choice, _split) and launch.clear_plans: update
those names when they move.

Usage: PYTHONPATH=. python3 bench/experiments/backward_tiles.py [VARIANT [MxNwWsS,...]]
  VARIANT: a registry spec as the bench takes it (default "softcap_causal(softcap=30)"); a variant
  with learnable tensors (e.g. "relative_bias+causal") times their gradients too.
  e.g. backward_tiles.py "softcap_causal(softcap=30)" 64x128w8s3,32x128w8s3,64x64w8s3
"""
import statistics
import sys

import torch
import triton

from bench.mods import resolve
from flexcore import create_block_mask, flex_attention
from flexcore.kernels import backward, launch

SPEC = sys.argv[1] if len(sys.argv) > 1 else "softcap_causal(softcap=30)"
CURRENT = backward._DKDV_CONFIGS[128]
CONFIGS = [CURRENT, (32, 128, 8, 3), (64, 64, 8, 3), (32, 128, 4, 3)]
if len(sys.argv) > 2:  # e.g. 64x128w8s3,32x128w8s3
    CONFIGS = [tuple(int(x) for x in c.replace("x", " ").replace("w", " ").replace("s", " ").split())
               for c in sys.argv[2].split(",")]
H, D, ROUNDS = 16, 128, 5


def use(config) -> None:
    backward._DKDV_CONFIGS[128] = config
    launch.clear_plans()
    backward._layout_choice.clear()
    backward._split.clear()


for B, S in ((4, 4096), (1, 16384)):
    mods = resolve(SPEC, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda", dtype=torch.bfloat16)
    bm = None if mods.mask_mod is None else create_block_mask(mods.mask_mod, B, None, S, S, device="cuda")
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    learnable = [t for t in mods.captured.values() if t.requires_grad]
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    def step():
        out = flex_attention(q, k, v, score_mod=mods.score_mod, block_mask=bm)
        return torch.autograd.grad(out, [q, k, v, *learnable], dout)

    grads, times = {}, {c: [] for c in CONFIGS}
    for config in CONFIGS:
        use(config)
        try:
            grads[config] = step()  # compiles, and the layout tuner decides
        except Exception as e:  # a configuration that does not fit
            grads[config] = type(e).__name__
    for _ in range(ROUNDS):
        for config in CONFIGS:
            if isinstance(grads[config], tuple):
                use(config)
                step()
                times[config].append(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))
    use(CURRENT)
    base = statistics.median(times[CURRENT])
    rows = []
    for config in CONFIGS:
        m, n, w, s = config
        if not isinstance(grads[config], tuple):
            rows.append(f"{m}x{n} w{w} s{s} {grads[config]}")
            continue
        t = statistics.median(times[config])
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[config], grads[CURRENT]))
        rows.append(f"{m}x{n} w{w} s{s} {t:.4f} ms ({base / t:.3f}x, grad diff {err:.1e})")
    print(f"{SPEC} B={B} S={S} fwd+bwd: " + " | ".join(rows), flush=True)
