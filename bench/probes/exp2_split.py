"""Part of the forward's exp2 computed on the FMA units (bench/NOTES.md entry 32, not kept).

The forward's p = exp2(s * S_SCALE - m) is replaced, in the generated source only, by inline PTX
that sends 1 of every PACK elements through a polynomial (Cody-Waite split: 2^x = 2^round(x) ·
p(x - round(x)), p of degree 3 with p(0) = 1, max relative error 1.0e-4, -inf -> 0 exactly) and
the rest through MUFU.EX2; "fake" replaces exp2 by two FMA-pipe instructions (wrong results: the
upper bound of removing the exp2). Forward TFLOP/s (density-scaled) per variant, two alternating
rounds, and at 4k the max error against a float32 run of the unmodified kernel.
Usage: PYTHONPATH=. python3 bench/probes/exp2_split.py base,mufu1,e25,e50,fake 64,128 noop,causal
"""
import os
import struct
import sys

import torch
import triton

import flexcore.kernels.codegen as C
import flexcore.kernels.forward as F
from flexcore import create_block_mask, flex_attention


def _f32(f):
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", f))[0]


C1, C2, C3 = _f32(0.6932829022407532), _f32(0.24221068620681763), _f32(0.05500871315598488)
POLY = (".reg .f32 xc, t, n, r, p;\n.reg .b32 ti, pi;\n"
        "max.NaN.f32 xc, {x}, 0fC2FE0000;\n"              # clamp at -127: 2^-127 -> exactly 0 below
        "add.rn.f32 t, xc, 0f4B400000;\nsub.rn.f32 n, t, 0f4B400000;\nsub.rn.f32 r, xc, n;\n"
        f"fma.rn.f32 p, r, {C3}, {C2};\nfma.rn.f32 p, p, r, {C1};\nfma.rn.f32 p, p, r, 0f3F800000;\n"
        "mov.b32 ti, t;\nmov.b32 pi, p;\nshl.b32 ti, ti, 23;\nadd.s32 pi, pi, ti;\nmov.b32 {y}, pi;\n")


def _asm(pack, npoly):
    body = []
    for j in range(pack):
        x, y = f"${pack + j}", f"${j}"
        body.append("{\n" + POLY.format(x=x, y=y) + "}" if j >= pack - npoly else f"ex2.approx.ftz.f32 {y}, {x};")
    return "\n".join(body), ",".join(["=f"] * pack + ["f"] * pack)


HELPERS = ""
for _name, _pack, _npoly in (("mufu1", 1, 0), ("e50", 2, 1), ("e25", 4, 1), ("e100", 1, 1)):
    _a, _c = _asm(_pack, _npoly)
    HELPERS += (f'\n@triton.jit\ndef _exp2_{_name}(x):\n    return tl.inline_asm_elementwise("""{_a}""", '
                f'"{_c}", [x], dtype=tl.float32, is_pure=True, pack={_pack})\n')
HELPERS += "\n@triton.jit\ndef _exp2_fake(x):\n    return tl.maximum(x * 0.0078125 + 1.0, 0.0)\n"
LINE = "p = tl.math.exp2(s * S_SCALE - m_safe[:, None])"


def patch(src: str) -> str:
    variant = os.environ.get("EXPV", "base")
    if variant == "base" or not src.count(LINE):
        return src
    src = src.replace(LINE, f"p = _exp2_{variant}(s * S_SCALE - m_safe[:, None])")
    return src.replace("\n@triton.jit\ndef _load_tile", HELPERS + "\n\n@triton.jit\ndef _load_tile", 1)


_build = C.build_kernel_source
C.build_kernel_source = lambda name, s, m: patch(_build(name, s, m))


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 1024)


MODS = {"noop": (None, None), "causal": (None, causal), "sliding": (None, sliding),
        "softcap": (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), causal)}

if __name__ == "__main__":
    variants, dims, names = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")], sys.argv[3].split(",")
    H = 16
    torch.manual_seed(0)
    for D in dims:
        for B, S in ((4, 4096), (1, 16384)):
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for name in names:
                sm, mm = MODS[name]
                bm = create_block_mask(mm, None, None, S, S) if mm else None
                density = 1.0
                if bm is not None:
                    counts = bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None else 0)
                    density = counts.item() / bm.kv_num_blocks.numel() / bm.kv_num_blocks.shape[-1]
                flops = 4 * B * H * S * S * D * density
                small = [t[:1, :4].float() for t in (q, k, v)]
                ref, res = None, {}
                for rnd in range(2):
                    for var in variants:
                        os.environ["EXPV"] = var
                        C._by_key.clear(); F._autotuners.clear()
                        fn = lambda: flex_attention(q, k, v, score_mod=sm, block_mask=bm)
                        fn()
                        if rnd == 0 and S == 4096:
                            if ref is None:
                                os.environ["EXPV"] = "base"; C._by_key.clear()
                                ref = flex_attention(*small, score_mod=sm, block_mask=bm).float()
                                os.environ["EXPV"] = var; C._by_key.clear()
                            out = flex_attention(*(t.bfloat16() for t in small), score_mod=sm, block_mask=bm).float()
                            res.setdefault(var, []).append(f"err {(out - ref).abs().max().item():.1e}")
                        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                        res.setdefault(var, []).append(f"{flops / ms / 1e9:4.0f}")
                print(f"D={D} S={S} {name:8s} " + " | ".join(f"{v} " + " ".join(r) for v, r in res.items()), flush=True)
