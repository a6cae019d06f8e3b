"""Backward tiles and stages of the one-launch backward at head dim 128 (bench/NOTES.md entry 34):
the default pair against a dQ tile of 128x64 at 2 and 3 stages, forward+backward, min over
alternating rounds of do_bench medians, the backward's TFLOP/s (2.5x the forward's density-scaled
FLOPs, the forward timed alone), the compiled backward kernel's registers and spills, and the max
difference of the gradients to the default's. bf16, H=16, anchors shapes.
Usage: PYTHONPATH=. python3 bench/probes/bwd_fused_tiles.py [--variants=a,b] [--configs=a,b] [--rounds=N]"""
import sys

import torch
import triton

import flexcore.kernels.backward as BW
import flexcore.kernels.codegen as C
from flexcore import create_block_mask, flex_attention
from variants.bias import alibi_slopes

H, D = 16, 128
ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
DEFAULT = (BW._DKDV_CONFIGS[128], BW._DQ_CONFIGS[128])
# name: (dK/dV tile, dQ tile, FUSED)
CONFIGS = {
    "default": (DEFAULT[0], DEFAULT[1], None),
    "default_one": (DEFAULT[0], DEFAULT[1], True),
    "dq128x64_s3": ((64, 128, 8, 3), (128, 64, 8, 3), True),
    "dq128x64_s2": ((64, 128, 8, 2), (128, 64, 8, 2), True),
    "dq128x64_s3_two": ((64, 128, 8, 3), (128, 64, 8, 3), False),
    "dq128x64_s4": ((64, 128, 8, 4), (128, 64, 8, 4), True),
    "default_two": (DEFAULT[0], DEFAULT[1], False),
}
slopes = alibi_slopes(H, "cuda")


def alibi(s, b, h, q, kv):
    return s + slopes[h] * (kv - q)


def alibi_nocap(s, b, h, q, kv):  # no captured tensor: the dense path is warp-specialized
    return s - (h + 1).to(s.dtype) * 0.05 * (q - kv).abs()


def softcap(s, b, h, q, kv):
    return 30.0 * torch.tanh(s / 30.0)


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 1024)


def variant(name, S):
    doc = torch.arange(S, device="cuda") // (S // 8)

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    def prefix(b, h, q, kv):
        return (kv < S // 4) | (q >= kv)

    return {"noop": (None, None), "causal": (None, causal), "alibi_causal": (alibi, causal),
            "sliding": (None, sliding), "prefix": (None, prefix), "document": (None, document),
            "softcap_causal": (softcap, causal), "alibi_dense": (alibi_nocap, None),
            "softcap_dense": (softcap, None)}[name]


def regs():
    found = set()
    for mod in list(C._modules.values()):
        kern = getattr(mod, "flex_bwd_kernel", None)
        for cache in (kern.device_caches.values() if kern is not None else ()):
            for ck in cache[0].values():
                found.add((ck.n_regs, ck.n_spills))
    return found


def set_config(name):
    dkdv, dq, fused = CONFIGS[name]
    BW._DKDV_CONFIGS[128], BW._DQ_CONFIGS[128], BW.FUSED = dkdv, dq, fused


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


names = ARGS.get("variants", "noop,causal,alibi_causal,sliding,prefix,document,softcap_causal").split(",")
configs = ARGS.get("configs", ",".join(CONFIGS)).split(",")
rounds = int(ARGS.get("rounds", 2))
for B, S in ((4, 4096), (1, 16384)):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    for name in names:
        sm, mm = variant(name, S)
        bm = create_block_mask(mm, None, None, S, S) if mm else None
        dens = 1.0 if bm is None else 1.0 - bm.sparsity() / 100
        flops = 4 * B * H * S * S * D * dens

        def step():
            return torch.autograd.grad(flex_attention(q, k, v, score_mod=sm, block_mask=bm), (q, k, v), g)

        fwd = bench(lambda: flex_attention(q, k, v, score_mod=sm, block_mask=bm))
        set_config("default")
        ref = step()
        res, err, rr = {}, {}, {}
        for c in configs:
            set_config(c)
            before = regs()
            got = step()
            torch.cuda.synchronize()
            err[c] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
            rr[c] = sorted(regs() - before)
            res[c] = []
        for _ in range(rounds):
            for c in configs:
                set_config(c)
                res[c].append(bench(step))
        line = [f"S={S:5d} {name:14s} fwd {fwd:.3f}"]
        for c in configs:
            t = min(res[c])
            line.append(f"{c} {t:.3f}ms {2.5 * flops / (t - fwd) / 1e9:4.0f} ({err[c]:.0e}) {rr[c] or ''}")
        print(" | ".join(line), flush=True)
set_config("default")
