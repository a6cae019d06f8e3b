"""The Gluon forwards (dense and masked, flexcore/kernels/hopper.py) at head dim 64, against the
Triton template that serves head dim 64 and torch's compiled flex_attention: bf16, H=16, the
anchors' noop, causal, sliding window and prefix LM, forward under no_grad, do_bench median ms,
two alternating rounds, and the largest output difference to the template.
Usage: PYTHONPATH=. python3 bench/probes/gluon_d64.py [spec,...]"""
import sys

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask as t_cbm
from torch.nn.attention.flex_attention import flex_attention as t_flex

from bench.mods import resolve
from flexcore import create_block_mask, flex_attention
from flexcore.kernels import hopper

SPECS = sys.argv[1].split(";") if len(sys.argv) > 1 else [
    "noop", "causal", "sliding_window(window_size=1024)", "prefix_lm(prefix_fraction=0.25)"]
H, D = 16, 64
t_compiled = torch.compile(t_flex)


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def set_gluon(on: bool):
    hopper.HEAD_DIMS = frozenset({64, 128}) if on else frozenset({128})
    hopper.HOPPER_DENSE = hopper.HOPPER_MASKED = True if on else False


for B, S in ((4, 4096), (1, 16384)):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for spec in SPECS:
        mods = resolve(spec, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda")
        bm = None if mods.mask_mod is None else create_block_mask(mods.mask_mod, B, None, S, S, device="cuda")
        tbm = None if mods.mask_mod is None else t_cbm(mods.mask_mod, B, None, S, S, device="cuda")
        with torch.no_grad():
            set_gluon(False)
            ref = flex_attention(q, k, v, block_mask=bm)
            set_gluon(True)
            try:
                out = flex_attention(q, k, v, block_mask=bm)
                err = f"{(out.float() - ref.float()).abs().max().item():.1e}"
            except Exception as e:
                print(f"{spec} B={B} S={S}: Gluon failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            cells = []
            for _ in range(2):
                for tag, on in (("template", False), ("gluon", True)):
                    set_gluon(on)
                    cells.append((tag, ms(lambda: flex_attention(q, k, v, block_mask=bm))))
            torch_ms = ms(lambda: t_compiled(q, k, v, block_mask=tbm))
            set_gluon(False)
        tmpl = min(t for tag, t in cells if tag == "template")
        gl_ = min(t for tag, t in cells if tag == "gluon")
        print(f"{spec} B={B} S={S}: template {tmpl:.4f} ms ({torch_ms / tmpl:.3f}x torch) | gluon {gl_:.4f} ms "
              f"({torch_ms / gl_:.3f}x torch, {tmpl / gl_:.3f}x template, max diff {err}) | torch flex {torch_ms:.4f} ms "
              f"| rounds {' '.join(f'{t:.4f}' for _, t in cells)}", flush=True)
