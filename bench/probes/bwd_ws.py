"""Warp-specialized dense backward (bench/NOTES.md entry 31): forward+backward of all-full masks
with the block-table path, the dense path, and the dense path warp-specialized in the dK/dV
programs, the dQ programs or both; min over alternating rounds of do_bench medians, the backward's
TFLOP/s (2.5x the forward's FLOPs, forward time measured alone) and the max difference of the
gradients to the table path. bf16, H=16, anchors shapes.
Usage: PYTHONPATH=. python3 bench/probes/bwd_ws.py [D ...] [--variants=a,b,...] [--rounds=N] [--tiles [--dkdv]]
--tiles tries other tiles instead, noop only, one kind's tile at a time, each in its own process."""
import sys
import torch, triton
from flexcore import flex_attention
import flexcore.kernels.backward as BW

H = 16
MODS = {
    "noop": None,
    "alibi": lambda s, b, h, q, kv: s - (h + 1).to(s.dtype) * 0.05 * (q - kv).abs(),
    "softcap": lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0),
}
VARIANTS = {  # name: (DENSE, WARP_SPEC, WARP_SPEC_KINDS); "auto" is the default rule
    "table": (False, False, ()),
    "dense": (True, False, ()),
    "ws_dkdv": (True, True, ("dkdv",)),
    "ws_dq": (True, True, ("dq",)),
    "ws_both": (True, True, ("dkdv", "dq")),
    "auto": (None, None, ("dkdv", "dq")),
}
TILES = {128: {"dkdv": [(64, 128, 4, 2), (128, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 3),
                        (32, 128, 4, 2), (64, 64, 4, 3)],
               "dq": [(128, 128, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2)]},
         64: {"dkdv": [(64, 128, 4, 2), (128, 128, 8, 2)], "dq": [(128, 128, 4, 2), (128, 64, 4, 2)]}}


VARIANTS_TILES = ["dense", "ws_both"]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def set_variant(name):
    BW.DENSE, BW.WARP_SPEC, kinds = VARIANTS[name]
    BW.WARP_SPEC_KINDS = frozenset(kinds)


def run(D, B, S, name, mod, variants, rounds=2):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    flops = 4 * B * H * S * S * D
    fwd = bench(lambda: flex_attention(q, k, v, score_mod=mod))
    def step():
        return torch.autograd.grad(flex_attention(q, k, v, score_mod=mod), (q, k, v), g)
    set_variant("table")
    ref = step()
    res, err = {}, {}
    for vname in variants:
        set_variant(vname)
        try:
            got = step(); torch.cuda.synchronize()
            err[vname] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
            res[vname] = []
        except Exception as e:  # noqa: BLE001 - a probe reports what fails
            msg = str(e).strip().splitlines()
            print(f"  D={D} S={S} {name} {vname}: {type(e).__name__}: {msg[0][:160] if msg else ''}", flush=True)
    for _ in range(rounds):
        for vname in res:
            set_variant(vname)
            res[vname].append(bench(step))
    line = [f"D={D} S={S:5d} {name:8s}"]
    for vname, ts in res.items():
        t = min(ts)
        line.append(f"{vname} {t:.3f}ms {2.5 * flops / (t - fwd) / 1e9:4.0f} ({err[vname]:.0e})")
    print(" | ".join(line), flush=True)
    return res


if __name__ == "__main__":
    dims = [int(a) for a in sys.argv[1:] if a.isdigit()] or [128]
    if "--tile" in sys.argv:  # one tile of one kind, in its own process (a fault ends the process)
        at = sys.argv.index("--tile")
        kind, cfg = sys.argv[at + 1], tuple(int(x) for x in sys.argv[at + 2:at + 6])
        D = dims[0]
        (BW._DKDV_CONFIGS if kind == "dkdv" else BW._DQ_CONFIGS)[D] = cfg
        print(f"D={D} {kind} tile {cfg}", flush=True)
        for B, S in ((4, 4096), (1, 16384)):
            run(D, B, S, "noop", None, VARIANTS_TILES, rounds=1)
    elif "--tiles" in sys.argv:
        import subprocess
        for D in dims:
            for kind in ("dkdv",) if "--dkdv" in sys.argv else ("dkdv", "dq"):
                for cfg in TILES[D][kind]:
                    r = subprocess.run([sys.executable, __file__, str(D), "--tile", kind, *map(str, cfg)],
                                       capture_output=True, text=True)
                    lines = [ln for ln in (r.stdout + r.stderr).splitlines()
                             if ln.startswith(("D=", "  D=")) or "Error" in ln]
                    print("\n".join(lines[:6]), flush=True)
    else:
        chosen = list(VARIANTS)
        rounds = 2
        for a in sys.argv[1:]:
            if a.startswith("--variants="):
                chosen = a.split("=", 1)[1].split(",")
            if a.startswith("--rounds="):
                rounds = int(a.split("=", 1)[1])
        for D in dims:
            for B, S in ((4, 4096), (1, 16384)):
                for name, mod in MODS.items():
                    run(D, B, S, name, mod, chosen, rounds)
