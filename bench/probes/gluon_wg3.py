"""The dense Gluon forward at head dim 64 with two or three compute warpgroups (128- or 192-row
programs; flexcore.kernels.hopper.DENSE_TILES), against the Triton template, SDPA cuDNN and torch's
compiled flex_attention: bf16, H=16, noop, forward under no_grad, do_bench median ms over alternating
rounds; each variant's output against float64 first (B=1 H=2, S=4096, 1280 and 8192: 21 x 192 + 64, 6 x 192 + 128 and 42 x 192 + 128 rows).
Usage: PYTHONPATH=. python3 bench/probes/gluon_wg3.py [rounds]"""
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention as t_flex

from flexcore import flex_attention
from flexcore.kernels import hopper

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
H, D = 16, 64
VARIANTS = {
    "template": None,
    "gluon 2wg s3": hopper.GluonTiles(2, 3, 240, 168),
    "gluon 3wg s2": hopper.GluonTiles(3, 2, 160, 128),
    "gluon 3wg s3": hopper.GluonTiles(3, 3, 160, 128),
    "gluon 3wg s4": hopper.GluonTiles(3, 4, 160, 128),
}
t_compiled = torch.compile(t_flex)


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def use(tiles):
    hopper.HOPPER_DENSE = tiles is not None
    if tiles is not None:
        hopper.DENSE_TILES[64] = tiles


for S in (4096, 1280, 8192):  # correctness first
    q, k, v = (torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / D ** 0.5, -1) @ v.double()
    for name, tiles in VARIANTS.items():
        use(tiles)
        out = flex_attention(q, k, v)
        err = (out.double() - ref).abs().max().item()
        print(f"check S={S} {name}: max abs err vs float64 {err:.2e}", flush=True)

for B, S in ((4, 4096), (1, 16384)):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D
    times = {name: [] for name in VARIANTS}
    with torch.no_grad():
        for _ in range(ROUNDS):
            for name, tiles in VARIANTS.items():
                use(tiles)
                times[name].append(ms(lambda: flex_attention(q, k, v)))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        torch_ms = ms(lambda: t_compiled(q, k, v))
    row = " | ".join(f"{n} {min(t):.4f} ms {flops / min(t) / 1e9:.0f}" for n, t in times.items())
    print(f"noop B={B} S={S}: {row} | cudnn {cudnn:.4f} ms {flops / cudnn / 1e9:.0f} | torch flex {torch_ms:.4f} ms "
          f"{flops / torch_ms / 1e9:.0f} (TFLOP/s)", flush=True)
    print("  rounds: " + "; ".join(f"{n} " + " ".join(f"{x:.4f}" for x in t) for n, t in times.items()), flush=True)
