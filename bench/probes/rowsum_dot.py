"""The forward's row sums l on the tensor cores instead of the FP32 pipe (bench/NOTES.md entry 39).

The online softmax adds each key tile's probabilities per row, `l_i = l_i * alpha + tl.sum(p, 1)`:
at 128x128 tiles and 4 warps that is about 128 FADDs per thread per tile, a fifth of the FP32-pipe
instructions of a loop that entry 32 found bound by them at head dim 64. Variants, patched into the
generated source only:
- base: the loop as it is;
- dotmax: each tile's sums as `max(dot(p16, ones[BLOCK_N, 16]), 1)` (every column of the product
  is the row sum; the max over 16 columns replaces the sum over BLOCK_N);
- dotacc: the sums accumulate in a [BLOCK_M, 16] dot accumulator rescaled by alpha with the output
  accumulator, and l is read from it once after the loop.
Both sum the 16-bit probabilities that the PV product uses, in float32 on the tensor cores.
Forward TFLOP/s (density-scaled), alternating rounds, and at 4k the max error of each variant and of
base against float64 on a slice (heads 0-3 of batch 0).
Usage: PYTHONPATH=. python3 bench/probes/rowsum_dot.py base,dotmax,dotacc 64,128 noop,causal,sliding
"""
import os
import sys

import torch
import triton

import flexcore.kernels.codegen as C
import flexcore.kernels.forward as F
from flexcore import create_block_mask, flex_attention
from flexcore.kernels import launch as L
from flexcore.reference import flex_attention_reference

OLD_SUM = "        l_i = l_i * alpha + tl.sum(p, 1)\n"
OLD_DOT = "        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)\n"
LOOP = "    for i in tl.range(begin, end,"
RET = "    return acc, l_i, m_i\n"

DOTMAX = ("        p16 = p.to(v.dtype)\n"
          "        acc = tl.dot(p16, v, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)\n"
          "        l_i = l_i * alpha + tl.max(tl.dot(p16, tl.full([BLOCK_N, 16], 1.0, v.dtype), out_dtype=ACC_DTYPE), 1)\n")
DOTACC = ("        p16 = p.to(v.dtype)\n"
          "        acc = tl.dot(p16, v, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)\n"
          "        l16 = tl.dot(p16, tl.full([BLOCK_N, 16], 1.0, v.dtype), l16 * alpha[:, None], out_dtype=ACC_DTYPE)\n")


def patch(src: str) -> str:
    variant = os.environ.get("ROWSUM", "base")
    if variant == "base" or OLD_SUM not in src:
        return src
    assert OLD_DOT in src and LOOP in src and RET in src
    src = src.replace(OLD_SUM, "", 1)
    if variant == "dotmax":
        return src.replace(OLD_DOT, DOTMAX, 1)
    src = src.replace(OLD_DOT, DOTACC, 1)
    src = src.replace(LOOP, "    l16 = tl.broadcast_to(l_i[:, None], [l_i.shape[0], 16])\n" + LOOP, 1)
    return src.replace(RET, "    l_i = tl.max(l16, 1)\n" + RET, 1)


_build = C.build_kernel_source
C.build_kernel_source = lambda name, s, m: patch(_build(name, s, m))


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 1024)


def document(b, h, q, kv):
    return (DOC[q] == DOC[kv]) & (q >= kv)


MODS = {"noop": (None, None), "causal": (None, causal), "sliding": (None, sliding), "document": (None, document),
        "alibi": (lambda s, b, h, q, kv: s - (h + 1) * 0.0625 * (q - kv), causal),
        "softcap": (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), causal)}
DOC = None


def _fresh(variant):
    os.environ["ROWSUM"] = variant
    C._by_key.clear()
    F._autotuners.clear()
    L.clear_plans()


if __name__ == "__main__":
    variants, dims, names = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")], sys.argv[3].split(",")
    H = 16
    torch.manual_seed(0)
    for D in dims:
        for B, S in ((4, 4096), (1, 16384)):
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            # documents of 1/16 to 1/4 of the sequence, as the anchors' document variant
            lengths = torch.randint(S // 16, S // 4, (64,), generator=torch.Generator().manual_seed(1))
            DOC = torch.repeat_interleave(torch.arange(64), lengths)[:S].to("cuda")
            for name in names:
                sm, mm = MODS[name]
                bm = create_block_mask(mm, None, None, S, S) if mm else None
                density = 1.0
                if bm is not None:
                    counts = bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None else 0)
                    density = counts.item() / bm.kv_num_blocks.numel() / bm.kv_num_blocks.shape[-1]
                flops = 4 * B * H * S * S * D * density
                res = {}
                if S == 4096:
                    sl = [t[:1, :4] for t in (q, k, v)]
                    bm1 = create_block_mask(mm, 1, 4, S, S) if mm else None
                    ref = flex_attention_reference(*(t.double() for t in sl), score_mod=sm, block_mask=bm1)
                    for var in variants:
                        _fresh(var)
                        out = flex_attention(*sl, score_mod=sm, block_mask=bm1).double()
                        res.setdefault(var, []).append(f"err {(out - ref).abs().max().item():.1e}")
                for rnd in range(2):
                    for var in variants:
                        _fresh(var)
                        fn = lambda: flex_attention(q, k, v, score_mod=sm, block_mask=bm)
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")
                        res.setdefault(var, []).append(f"{flops / ms / 1e9:4.0f}")
                print(f"D={D} S={S} {name:8s} " + " | ".join(f"{v} " + " ".join(r) for v, r in res.items()), flush=True)
