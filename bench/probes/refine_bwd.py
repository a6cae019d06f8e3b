"""The backward over the finer 64x64 tables too (bench/NOTES.md entry 48): forward+backward of the
anchors' document mask at head dim 128, bf16, H=16, with the backward's tables swapped for the finer
ones (and its transposes) at several tiles, against the mask's own tables; do_bench median
ms. Usage: PYTHONPATH=. python3 bench/probes/refine_bwd.py"""
import torch
import triton

from bench.mods import resolve
from flexcore import create_block_mask, flex_attention
from flexcore.blockmask import BlockMask, refine_block_map
from flexcore.kernels.backward import q_block_tensors
from flexcore.kernels import backward as bwd
from flexcore.kernels.forward import BlockTensors
from flexcore.kernels.launch import clear_plans

import sys

SPECS = sys.argv[1].split(";") if len(sys.argv) > 1 else ["document(num_documents=8)"]
DIMS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128]
H = 16
real_backward = bwd.backward
swap = {}


def swapped(q, k, v, out, row_stats, grad_out, sl, sbl, ml, kv_blocks, q_blocks, scale, opts):
    if swap:
        kv_blocks, q_blocks = swap["kv"], swap["q"]
    return real_backward(q, k, v, out, row_stats, grad_out, sl, sbl, ml, kv_blocks, q_blocks, scale, opts)


bwd.backward = swapped


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


for D, spec, (B, S) in [(D, spec, bs) for D in DIMS for spec in SPECS for bs in ((4, 4096), (1, 16384))]:
    mods = resolve(spec, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda")
    bm = create_block_mask(mods.mask_mod, B, None, S, S, device="cuda")
    fine = refine_block_map(bm, (64, 64))
    finer = BlockMask._from_block_map(fine, (64, 64), (S, S), bm.mask_mod)
    kv_fine = BlockTensors.expanded(finer.kv_num_blocks, finer.kv_indices, finer.full_kv_num_blocks,
                                    finer.full_kv_indices, (64, 64), B, H)
    q_fine = q_block_tensors(finer, B, H)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def step(f, mask):
        out = f(q, k, v, block_mask=mask)
        return torch.autograd.grad(out, (q, k, v), dout)

    ref = step(flex_attention, bm)
    rows = [("own", ms(lambda: step(flex_attention, bm)), 0.0)]
    saved = dict(dkdv=bwd._DKDV_CONFIGS[D], dq=bwd._DQ_CONFIGS[D])
    for tag, dkdv, dq in (("fine default", None, None), ("fine w4 s3/s2", (64, 64, 4, 3), (64, 64, 4, 2)),
                          ("fine w4 s2/s2", (64, 64, 4, 2), (64, 64, 4, 2)),
                          ("fine w4 s3/s3", (64, 64, 4, 3), (64, 64, 4, 3))):
        swap.update(kv=kv_fine, q=q_fine)
        if dkdv:
            bwd._DKDV_CONFIGS[D], bwd._DQ_CONFIGS[D] = dkdv, dq
        bwd._layout_choice.clear()
        clear_plans()
        try:
            got = step(flex_attention, bm)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
            rows.append((tag, ms(lambda: step(flex_attention, bm)), err))
        except Exception as e:  # noqa: BLE001
            rows.append((f"{tag} {type(e).__name__}: {e}"[:120], float("nan"), 0.0))
        swap.clear()
        bwd._DKDV_CONFIGS[D], bwd._DQ_CONFIGS[D] = saved["dkdv"], saved["dq"]
    base = rows[0][1]
    print(f"D={D} {spec} B={B} S={S} fwd_bwd: " + " | ".join(
        f"{tag} {m:.4f} ({base / m:.3f}x own, d {e:.0e})" for tag, m, e in rows), flush=True)
