"""The forward at pinned tiles and autotuned, with the compiled kernel's registers and spills
(bench/NOTES.md entry 33). Run it once with this checkout and once with an older one first on
PYTHONPATH, in alternating processes, to compare K/V descriptors made on the host over all rows
with descriptors built per program:
    git archive OLD flexcore variants | tar -x -C /tmp/old
    for i in 1 2; do PYTHONPATH=. python3 bench/probes/kv_rows_ab.py new 128 causal,alibi,sliding; \
                     PYTHONPATH=/tmp/old:. python3 bench/probes/kv_rows_ab.py old 128 causal,alibi,sliding; done
Arguments: a tag for the lines, the head dim, the mods (noop, causal, alibi, sliding). The pinned
tiles are 128x64 (4 warps, 2 stages) at D=128 and 128x128 (4 warps, 2 stages) at D=64."""
import sys

import torch
import triton

import flexcore.kernels.codegen as C
import flexcore.kernels.forward as F
from flexcore import create_block_mask, flex_attention
from variants.bias import alibi_slopes

TAG = sys.argv[1] if len(sys.argv) > 1 else "this"
D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
NAMES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["causal", "alibi", "sliding"]
H = 16
PINNED = dict(BLOCK_M=128, BLOCK_N=64 if D == 128 else 128, num_warps=4, num_stages=2)
slopes = alibi_slopes(H, "cuda")


def alibi(s, b, h, q, kv):
    return s + slopes[h] * (kv - q)


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv < 1024)


def spills():
    found = ""
    for mod in list(C._modules.values()):
        kern = getattr(mod, "flex_forward_kernel", None)
        for cache in (kern.device_caches.values() if kern is not None else ()):
            for ck in cache[0].values():
                found = f"regs {ck.n_regs} spills {ck.n_spills}"
    return found


for S, B in ((4096, 4), (16384, 1)):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in NAMES:
        sm, mm = {"noop": (None, None), "causal": (None, causal), "alibi": (alibi, causal),
                  "sliding": (None, sliding)}[name]
        bm = create_block_mask(mm, None, None, S, S) if mm else None
        row = [f"{TAG} S={S} {name:8s}"]
        for opts in (PINNED, None):
            F._autotuners.clear()
            fn = lambda: flex_attention(q, k, v, score_mod=sm, block_mask=bm, kernel_options=opts)
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            row.append(f"{'pinned' if opts else 'autotuned'} {ms * 1e3:6.0f}us" + (f" ({spills()})" if opts else ""))
        print(" | ".join(row), flush=True)
