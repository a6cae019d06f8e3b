"""Triton helpers that generated mod functions call (torch semantics where Triton's differ).

Imported only by generated kernel modules (after ``prepare_triton()``), never by
``flexcore.lowering`` itself, because the ``@triton.jit`` decorators run at import.
Integer ``//`` and ``%`` in Triton truncate toward zero and float ``%`` is C's ``fmod``; torch's
``floor_divide`` and ``remainder`` round toward negative infinity, so the helpers correct the sign.
"""
import os

import triton
import triton.language as tl

# libdevice's tanh/expm1/log1p are exact and fast on GPUs but fail under the interpreter, which
# gets portable versions instead (same results to a few ulp).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not _INTERPRET:
    from triton.language.extra import libdevice

__all__ = ["fl_div_trunc_int", "fl_div_floor_int", "fl_remainder_int", "fl_div_floor_float",
           "fl_remainder_float", "fl_trunc", "fl_round_half_even", "fl_expm1", "fl_log1p",
           "fl_tanh", "fl_tanh_approx", "fl_sign", "fl_pow_float", "fl_pow_int", "fl_to_bfloat16"]


@triton.jit
def fl_div_trunc_int(a, b):
    # Work on magnitudes so that the result never depends on how `//` rounds negatives.
    q = tl.abs(a) // tl.abs(b)
    return tl.where((a < 0) != (b < 0), -q, q)


@triton.jit
def fl_div_floor_int(a, b):
    q = fl_div_trunc_int(a, b)
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def fl_remainder_int(a, b):
    r = a - fl_div_trunc_int(a, b) * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def fl_remainder_float(a, b):
    r = a % b  # fmod: sign of a
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def fl_div_floor_float(a, b):
    # torch's div_floor for floating types: exact fmod, then fix the rounding of (a - mod) / b.
    mod = a % b
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    # b == 0 gives a / b (+-inf or nan), as torch does.
    return tl.where(b == 0, a / b, tl.where(div == 0, 0.0 * (a / b), fl))


@triton.jit
def fl_trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def fl_round_half_even(x):
    f = tl.floor(x)
    d = x - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0
    up = (d > 0.5) | ((d == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _expm1_portable(x):
    # Kahan: (u - 1) * x / log(u) is accurate near 0 where exp(x) - 1 cancels.
    u = tl.exp(x)
    um1 = u - 1.0
    # Lanes the wheres below replace get u = 2, so no 0/0 or inf/inf is ever evaluated.
    safe = tl.where((u == 1.0) | (um1 == -1.0) | (x > 80.0), 2.0, u)
    r = um1 * x / tl.log(safe)
    r = tl.where(u == 1.0, x, r)
    r = tl.where(um1 == -1.0, -1.0, r)
    return tl.where(x > 80.0, u - 1.0, r)


@triton.jit
def _log1p_portable(x):
    # Goldberg: log(u) * x / (u - 1) with u = 1 + x recovers the bits lost in 1 + x.
    u = 1.0 + x
    um1 = u - 1.0
    safe = tl.where(um1 == 0.0, 1.0, um1)
    r = tl.log(u) * (x / safe)
    r = tl.where(um1 == 0.0, x, r)
    return tl.where((u == float("inf")) | (u <= 0.0), tl.log(u), r)


@triton.jit
def _tanh_portable(x):
    # tanh(|x|) = -expm1(-2|x|) / (2 + expm1(-2|x|)); libdevice tanh fails under the interpreter.
    e = _expm1_portable(-2.0 * tl.abs(x))
    t = -e / (2.0 + e)
    return tl.where(x < 0, -t, t)


if _INTERPRET:
    @triton.jit
    def fl_expm1(x):
        return _expm1_portable(x)

    @triton.jit
    def fl_log1p(x):
        return _log1p_portable(x)

    @triton.jit
    def fl_tanh(x):
        return _tanh_portable(x)

    @triton.jit
    def fl_tanh_approx(x):
        return _tanh_portable(x)
else:
    @triton.jit
    def fl_expm1(x):
        return libdevice.expm1(x)

    @triton.jit
    def fl_log1p(x):
        return libdevice.log1p(x)

    @triton.jit
    def fl_tanh(x):
        return libdevice.tanh(x)

    @triton.jit
    def fl_tanh_approx(x):
        # One MUFU instruction (max relative error about 2^-11), against libdevice's ~20: used for
        # float16/bfloat16 inputs, whose own rounding (2^-8) is far coarser (softcapping).
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def fl_sign(x):
    return tl.where(x > 0, 1, 0).to(x.dtype) - tl.where(x < 0, 1, 0).to(x.dtype)


@triton.jit
def fl_pow_float(x, y):
    # x ** y via exp2(y * log2|x|), with torch's rules for negative bases and signed zeros.
    y = y + x * 0.0  # a literal exponent becomes a tensor of x's type
    ax = tl.abs(x)
    r = tl.exp2(y * tl.log2(tl.where(ax == 0, 1.0, ax)))
    y_int = tl.floor(y) == y
    y_odd = y_int & ((y - 2.0 * tl.floor(y * 0.5)) != 0)
    r = tl.where((x < 0) & y_odd, -r, r)
    r = tl.where((x < 0) & (~y_int), float("nan"), r)
    neg_zero = (ax == 0) & ((1.0 / tl.where(ax == 0, x, 1.0)) < 0)
    inf_at_zero = tl.where(y_odd & neg_zero, float("-inf"), float("inf"))
    at_zero = tl.where(y > 0, tl.where(y_odd, x, 0.0), inf_at_zero)
    r = tl.where(ax == 0, at_zero, r)
    r = tl.where(ax == float("inf"), tl.exp2(y * tl.log2(ax)), r)
    r = tl.where((x == float("-inf")) & y_odd & (y > 0), float("-inf"), r)
    return tl.where(y == 0, 1.0, r)


@triton.jit
def fl_pow_int(x, y):
    # Integer power by squaring over the 31 low bits of a non-negative exponent.
    zero = x * 0 + (y * 0).to(x.dtype)
    result = zero + 1
    base = x + zero
    e = y + zero.to(y.dtype)
    for _ in tl.static_range(31):
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    return result


@triton.jit
def fl_to_bfloat16(x):
    # Round to nearest even explicitly: the interpreter's float32 -> bfloat16 cast truncates.
    x = x.to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    r = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    return r.to(tl.bfloat16)
