"""The forward over finer block tables (flexcore.kernels.forward.REFINE, bench/NOTES.md entry 48):
the anchors' masks at head dims 128 and 64, bf16, H=16, forward and forward+backward, with the
mask's own tables (REFINE=False), by the rule (None: which tables it took) and forced (True, at
1-3 stages), beside torch's compiled flex_attention; do_bench median ms and ratios. Also the time
the finer tables take once per mask. Usage: PYTHONPATH=. python3 bench/probes/refine_probe.py
[spec;spec...] [128,64] [fwd,fwd_bwd]"""
import sys
import time

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask as t_cbm
from torch.nn.attention.flex_attention import flex_attention as t_flex

import flexcore.attention as attention
from bench.mods import resolve
from flexcore import create_block_mask, flex_attention
from flexcore.kernels import forward as fwd

SPECS = (sys.argv[1].split(";") if len(sys.argv) > 1 else
         ["document(num_documents=8)", "sliding_window(window_size=1024)", "causal",
          "prefix_lm(prefix_fraction=0.25)"])
DIMS = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
PASSES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["fwd", "fwd_bwd"]
H = 16
t_compiled = torch.compile(t_flex)


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def taken(bm, B, q):
    """Which tables the rule gives this call."""
    blocks = attention._kv_blocks(bm, B, H)
    from flexcore.lowering import lower_mask_mod, lower_score_mod
    chosen = fwd.refined(blocks, q, q, q, lower_score_mod(None), lower_mask_mod(bm.mask_mod), 0.1,
                         fwd.KernelOptions())
    return "fine" if chosen is not blocks else "own"


for D in DIMS:
    for spec in SPECS:
        for B, S in ((4, 4096), (1, 16384)):
            mods = resolve(spec, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda")
            bm = create_block_mask(mods.mask_mod, B, None, S, S, device="cuda")
            tbm = t_cbm(mods.mask_mod, B, None, S, S, device="cuda")
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            found = attention._kv_blocks(bm, B, H).refine(
                __import__("flexcore.lowering", fromlist=["x"]).lower_mask_mod(bm.mask_mod).captured, True)
            torch.cuda.synchronize()
            ratio = found[1] if found else float("nan")
            once = (time.perf_counter() - t0) * 1e3
            rule = taken(bm, B, q)
            for pass_ in PASSES:
                grad = pass_ == "fwd_bwd"
                qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
                dout = torch.randn_like(q)

                def run(f, mask):
                    if not grad:
                        with torch.no_grad():
                            return f(qq, kk, vv, block_mask=mask)
                    out = f(qq, kk, vv, block_mask=mask)
                    out.backward(dout)
                    return out

                rows = []
                for tag, mode, opts in (("own", False, None), ("rule", None, None), ("fine s2", True, None),
                                        ("fine s1", True, {"num_stages": 1}), ("fine s3", True, {"num_stages": 3})):
                    if grad and tag in ("fine s1", "fine s3"):
                        continue
                    fwd.REFINE = mode
                    f = (lambda *a, **kw: flex_attention(*a, **kw, kernel_options=opts)) if opts else flex_attention
                    try:
                        out = run(f, bm)
                        rows.append((tag, ms(lambda: run(f, bm)), out.detach()))
                    except Exception as e:  # noqa: BLE001
                        rows.append((f"{tag} {type(e).__name__}", float("nan"), None))
                fwd.REFINE = None
                out_t = run(t_compiled, tbm)
                t_ms = ms(lambda: run(t_compiled, tbm))
                base = rows[0][2].float()
                cells = " | ".join(
                    f"{tag} {t:.4f} ({t_ms / t:.3f}x torch"
                    + (f", d {(o.float() - base).abs().max().item():.0e})" if o is not None else ")")
                    for tag, t, o in rows)
                print(f"D={D} {spec} B={B} S={S} {pass_}: torch {t_ms:.4f} | {cells} | rule took {rule}, "
                      f"finer cost {ratio:.3f}, tables once {once:.1f} ms", flush=True)
