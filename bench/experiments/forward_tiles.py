"""Is the forward autotuner leaving speed on the table for a given variant: which pinned tile
configuration is fastest?

Each (BLOCK_M, BLOCK_N, num_warps, num_stages) is pinned through kernel_options, one at a time,
against the autotuned default and torch's compiled flex_attention; it prints each one's do_bench
median (ms), its speed relative to the autotuned default and its largest output difference to it.
A configuration that does not fit the GPU prints the error's name. bf16, H=16, D=128, the anchors'
shapes (B=4 S=4096, B=1 S=16384). Needs a CUDA GPU. Uses only flexcore's public API.

Usage: PYTHONPATH=. python3 bench/experiments/forward_tiles.py [VARIANT [MxNwWsS,...]]
  VARIANT: a registry spec as the bench takes it (default "document(num_documents=8)");
  e.g. forward_tiles.py "sliding_window(window_size=1024)" 128x64w4s2,64x64w4s3
See docs/decisions.md#forward-tiles.
"""
import sys

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask as t_cbm
from torch.nn.attention.flex_attention import flex_attention as t_flex

from bench.mods import resolve
from flexcore import create_block_mask, flex_attention

SPEC = sys.argv[1] if len(sys.argv) > 1 else "document(num_documents=8)"
CONFIGS = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2),
           (128, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 4, 3)]
if len(sys.argv) > 2:  # e.g. 64x64w4s1,128x64w4s1
    CONFIGS = [tuple(int(x) for x in c.replace("x", " ").replace("w", " ").replace("s", " ").split())
               for c in sys.argv[2].split(",")]
H, D = 16, 128
t_compiled = torch.compile(t_flex)


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


for B, S in ((4, 4096), (1, 16384)):
    mods = resolve(SPEC, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda")
    bm = create_block_mask(mods.mask_mod, B, None, S, S, device="cuda")
    tbm = t_cbm(mods.mask_mod, B, None, S, S, device="cuda")
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        ref = flex_attention(q, k, v, block_mask=bm)
        rows = [("autotuned", ms(lambda: flex_attention(q, k, v, block_mask=bm))),
                ("torch flex", ms(lambda: t_compiled(q, k, v, block_mask=tbm)))]
        for m, n, w, s in CONFIGS:
            opts = {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
            try:
                out = flex_attention(q, k, v, block_mask=bm, kernel_options=opts)
                err = (out.float() - ref.float()).abs().max().item()
                rows.append((f"{m}x{n} w{w} s{s} (err {err:.0e})",
                             ms(lambda: flex_attention(q, k, v, block_mask=bm, kernel_options=opts))))
            except Exception as e:  # a configuration that does not fit
                rows.append((f"{m}x{n} w{w} s{s} {type(e).__name__}", float("nan")))
    base = rows[0][1]
    print(f"{SPEC} B={B} S={S}: " + " | ".join(f"{tag} {t:.4f} ms ({base / t:.3f}x)" for tag, t in rows), flush=True)
