"""Triton helpers that generated mod functions call (torch semantics where Triton's differ).

Imported only by generated kernel modules (after ``prepare_triton()``), never by
``flexcore.lowering`` itself, because the ``@triton.jit`` decorators run at import.
Integer ``//`` and ``%`` in Triton truncate toward zero and float ``%`` is C's ``fmod``; torch's
``floor_divide`` and ``remainder`` round toward negative infinity, so the helpers correct the sign.
Float comparisons are combined with nested ``tl.where``, never ``&``/``|``: under the interpreter
a comparison of a 0-d float (a value that depends on b and h only) cannot enter ``&``.
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
           "fl_tanh", "fl_tanh_approx", "fl_sign", "fl_pow_float", "fl_pow_int", "fl_to_bfloat16",
           "fl_tan", "fl_atan", "fl_atan2", "fl_asin", "fl_acos", "fl_sinh", "fl_cosh", "fl_asinh",
           "fl_acosh", "fl_atanh", "fl_erfc", "fl_erfinv", "fl_lgamma", "fl_hypot", "fl_signbit",
           "fl_copysign", "fl_fmax", "fl_fmin", "fl_gcd", "fl_angle", "fl_digamma",
           "fl_trigamma"]


@triton.jit
def fl_div_trunc_int(a, b):
    # `//` truncates on the GPU and floors under the interpreter: a floored quotient leaves a
    # remainder of the divisor's sign, which moves it one up. (Magnitudes overflow at INT_MIN.)
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (a < 0)), q + 1, q)


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
    return tl.where(r != 0, tl.where((r < 0) != (b < 0), r + b, r), r)


@triton.jit
def fl_div_floor_float(a, b):
    # torch's div_floor for floating types: exact fmod, then fix the rounding of (a - mod) / b.
    mod = a % b
    div = (a - mod) / b
    div = tl.where(mod != 0, tl.where((b < 0) != (mod < 0), div - 1.0, div), div)
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
    return tl.where(d > 0.5, f + 1.0, tl.where(d == 0.5, tl.where(f_is_odd, f + 1.0, f), f))


@triton.jit
def _expm1_portable(x):
    # Kahan: (u - 1) * x / log(u) is accurate near 0 where exp(x) - 1 cancels.
    u = tl.exp(x)
    um1 = u - 1.0
    # Lanes the wheres below replace get u = 2, so no 0/0 or inf/inf is ever evaluated.
    safe = tl.where(u == 1.0, 2.0, tl.where(um1 == -1.0, 2.0, tl.where(x > 80.0, 2.0, u)))
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
    return tl.where(u == float("inf"), tl.log(u), tl.where(u <= 0.0, tl.log(u), r))


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
    # 0/1 integer flags combine with & safely (see the module docstring).
    y_int = tl.where(tl.floor(y) == y, 1, 0)
    y_odd = y_int & tl.where((y - 2.0 * tl.floor(y * 0.5)) != 0, 1, 0)
    x_neg = tl.where(x < 0, 1, 0)
    r = tl.where((x_neg & y_odd) != 0, -r, r)
    r = tl.where((x_neg & (1 - y_int)) != 0, float("nan"), r)
    neg_zero = tl.where(ax == 0, 1, 0) & tl.where((1.0 / tl.where(ax == 0, x, 1.0)) < 0, 1, 0)
    inf_at_zero = tl.where((y_odd & neg_zero) != 0, float("-inf"), float("inf"))
    at_zero = tl.where(y > 0, tl.where(y_odd != 0, x, 0.0), inf_at_zero)
    r = tl.where(ax == 0, at_zero, r)
    r = tl.where(ax == float("inf"), tl.exp2(y * tl.log2(ax)), r)
    r = tl.where(x == float("-inf"), tl.where((y_odd & tl.where(y > 0, 1, 0)) != 0,
                                              float("-inf"), r), r)
    return tl.where(y == 0, 1.0, r)


@triton.jit
def fl_pow_int(x, y):
    # Integer power by squaring over the 31 low bits of a non-negative exponent; a negative one
    # gives torch's integer results: 1 for a base of 1, +-1 for -1 (by parity), else 0.
    zero = x * 0 + (y * 0).to(x.dtype)
    result = zero + 1
    base = x + zero
    e = y + zero.to(y.dtype)
    negative = e < 0
    odd = (e & 1) != 0
    e = tl.where(negative, 0, e)
    for _ in tl.static_range(31):
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    unit = tl.where(x == 1, zero + 1, tl.where(x == -1, tl.where(odd, zero - 1, zero + 1), zero))
    return tl.where(negative, unit, result)


if _INTERPRET:
    @triton.jit
    def fl_to_bfloat16(x):
        # Round to nearest even explicitly: the interpreter's float32 -> bfloat16 cast truncates.
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        lsb = (bits >> 16) & 1
        rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
        r = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
        return r.to(tl.bfloat16)
else:
    @triton.jit
    def fl_to_bfloat16(x):
        # The GPU converts with round to nearest even in one instruction (the integer rounding
        # above takes several per element and registers in the backward's hottest loop).
        return x.to(tl.float32).to(tl.bfloat16, fp_downcast_rounding="rtne")


# ------------------------------------------------------------------------------------------------
# Trigonometric, hyperbolic and special functions. On the GPU they are libdevice's (within 2 ulp);
# the interpreter has only exp, log, sin, cos, sqrt and erf, so it gets formulas built from those
# that avoid cancellation (float32 to a few ulp, float64 to about 1e-15 relative).
# ------------------------------------------------------------------------------------------------

@triton.jit
def _atan_unit(r):
    # atan on [0, 1]: above tan(pi/12), atan(r) = pi/6 + atan((r*sqrt3 - 1) / (r + sqrt3)); below
    # it the odd Taylor series converges by a factor 0.072 per term (15 terms reach float64).
    big = r > 0.2679491924311227
    t = tl.where(big, (r * 1.7320508075688772 - 1.0) / (r + 1.7320508075688772), r)
    t2 = t * t
    acc = t2 * 0.0 + 1.0 / 31.0
    for i in tl.static_range(15):
        acc = acc * (-t2) + 1.0 / (29 - 2 * i)
    return tl.where(big, 0.5235987755982988 + t * acc, t * acc)


@triton.jit
def _signbit_float(x):
    if tl.constexpr(x.dtype.is_fp64()):
        bit = x.to(tl.int64, bitcast=True) < 0
    else:
        bit = x.to(tl.float32).to(tl.int32, bitcast=True) < 0
    return bit


@triton.jit
def _atan2_portable(y, x):
    # C's atan2: quadrants, signed zeros and infinities as torch (std::atan2) gives them.
    ax = tl.abs(x)
    ay = tl.abs(y)
    mx = tl.maximum(ax, ay)
    mn = tl.minimum(ax, ay)
    r = mn / tl.where(mx == 0, 1.0, mx)
    r = tl.where(ax == float("inf"), tl.where(ay == float("inf"), 1.0, r), r)
    a = _atan_unit(r)
    a = tl.where(ay > ax, 1.5707963267948966 - a, a)
    a = tl.where(_signbit_float(x), 3.141592653589793 - a, a)
    a = tl.where(_signbit_float(y), -a, a)
    return tl.where(x != x, x + y, tl.where(y != y, x + y, a))


@triton.jit
def _sinh_portable(x):
    ax = tl.abs(x)
    small = (fl_expm1(x) - fl_expm1(-x)) * 0.5
    # exp(|x|) overflows before sinh does: square exp(|x| / 2) instead.
    half = tl.exp(tl.where(ax > 20.0, ax * 0.5, 0.0))
    large = (half * 0.5) * half
    return tl.where(ax > 20.0, tl.where(x < 0, -large, large), small)


@triton.jit
def _cosh_portable(x):
    ax = tl.abs(x)
    small = (tl.exp(ax) + tl.exp(-ax)) * 0.5
    half = tl.exp(tl.where(ax > 20.0, ax * 0.5, 0.0))
    return tl.where(ax > 20.0, (half * 0.5) * half, small)


@triton.jit
def _asinh_portable(x):
    a = tl.abs(x)
    # log1p(a + a^2 / (1 + sqrt(1 + a^2))) keeps small arguments exact; past 2^28 the 1 is lost.
    r = fl_log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    r = tl.where(a > 268435456.0, tl.log(a) + 0.6931471805599453, r)
    return tl.where(x < 0, -r, r)


@triton.jit
def _acosh_portable(x):
    xm1 = x - 1.0
    r = fl_log1p(xm1 + tl.sqrt(xm1 * (x + 1.0)))
    return tl.where(x > 268435456.0, tl.log(x) + 0.6931471805599453, r)


@triton.jit
def _atanh_portable(x):
    a = tl.abs(x)
    r = 0.5 * fl_log1p(2.0 * a / (1.0 - a))
    return tl.where(x < 0, -r, r)


@triton.jit
def _erfc_portable(x):
    if tl.constexpr(x.dtype.is_fp64()):
        r = 1.0 - tl.erf(x)
    else:
        # Numerical Recipes' erfcc (relative error below 1.2e-7) keeps the tail that 1 - erf loses.
        z = tl.abs(x)
        t = 1.0 / (1.0 + 0.5 * z)
        p = -0.82215223 + t * 0.17087277
        p = 1.48851587 + t * p
        p = -1.13520398 + t * p
        p = 0.27886807 + t * p
        p = -0.18628806 + t * p
        p = 0.09678418 + t * p
        p = 0.37409196 + t * p
        p = 1.00002368 + t * p
        p = -1.26551223 + t * p
        tail = t * tl.exp(-z * z + p)
        tail = tl.where(x < 0, 2.0 - tail, tail)
        r = tl.where(tl.abs(x) < 0.5, 1.0 - tl.erf(x), tail)
    return r


@triton.jit
def _erfinv_portable(x):
    # Giles' single-precision approximation, then two Newton steps on erf(y) = x.
    w = -tl.log(tl.maximum((1.0 - x) * (1.0 + x), 1e-300))
    wc = w - 2.5
    p = 2.81022636e-08
    p = 3.43273939e-07 + p * wc
    p = -3.5233877e-06 + p * wc
    p = -4.39150654e-06 + p * wc
    p = 0.00021858087 + p * wc
    p = -0.00125372503 + p * wc
    p = -0.00417768164 + p * wc
    p = 0.246640727 + p * wc
    p = 1.50140941 + p * wc
    wt = tl.sqrt(tl.maximum(w, 5.0)) - 3.0
    q = -0.000200214257
    q = 0.000100950558 + q * wt
    q = 0.00134934322 + q * wt
    q = -0.00367342844 + q * wt
    q = 0.00573950773 + q * wt
    q = -0.0076224613 + q * wt
    q = 0.00943887047 + q * wt
    q = 1.00167406 + q * wt
    q = 2.83297682 + q * wt
    y = tl.where(w < 5.0, p, q) * x
    for _ in tl.static_range(2):
        err = tl.erf(y) - x
        y = y - err / (1.1283791670955126 * tl.exp(-y * y))
    y = tl.where(tl.abs(x) == 1.0, x * float("inf"), y)
    return tl.where(tl.abs(x) > 1.0, float("nan"), y)


@triton.jit
def _lgamma_positive(x):
    # Lanczos (g = 7, 9 terms) for x >= 0.5.
    z = x - 1.0
    a = z * 0.0 + 0.99999999999980993
    a += 676.5203681218851 / (z + 1.0)
    a += -1259.1392167224028 / (z + 2.0)
    a += 771.32342877765313 / (z + 3.0)
    a += -176.61502916214059 / (z + 4.0)
    a += 12.507343278686905 / (z + 5.0)
    a += -0.13857109526572012 / (z + 6.0)
    a += 9.9843695780195716e-6 / (z + 7.0)
    a += 1.5056327351493116e-7 / (z + 8.0)
    t = z + 7.5
    return 0.9189385332046727 + (z + 0.5) * tl.log(t) - t + tl.log(a)


@triton.jit
def _lgamma_portable(x):
    # Reflection for x < 0.5: lgamma(x) = log(pi / |sin(pi x)|) - lgamma(1 - x).
    xr = tl.where(x < 0.5, 1.0 - x, x)
    r = _lgamma_positive(xr)
    s = tl.abs(tl.sin(3.141592653589793 * (x - tl.floor(x + 0.5))))
    reflected = tl.log(3.141592653589793 / s) - r
    r = tl.where(x < 0.5, reflected, r)
    return tl.where(tl.abs(x) == float("inf"), float("inf"), r)


@triton.jit
def _hypot_portable(x, y):
    ax = tl.abs(x)
    ay = tl.abs(y)
    mx = tl.maximum(ax, ay)
    mn = tl.minimum(ax, ay)
    r = mn / tl.where(mx == 0, 1.0, mx)
    h = mx * tl.sqrt(1.0 + r * r)
    h = tl.where(x != x, x + y, tl.where(y != y, x + y, h))
    return tl.where(ax == float("inf"), float("inf"), tl.where(ay == float("inf"), float("inf"), h))


if _INTERPRET:
    @triton.jit
    def fl_tan(x):
        return tl.sin(x) / tl.cos(x)

    @triton.jit
    def fl_atan(x):
        a = tl.abs(x)
        r = _atan_unit(tl.where(a > 1.0, 1.0 / a, a))
        r = tl.where(a > 1.0, 1.5707963267948966 - r, r)
        return tl.where(x < 0, -r, r)

    @triton.jit
    def fl_atan2(y, x):
        return _atan2_portable(y, x)

    @triton.jit
    def fl_asin(x):
        return _atan2_portable(x, tl.sqrt((1.0 - x) * (1.0 + x)))

    @triton.jit
    def fl_acos(x):
        return _atan2_portable(tl.sqrt((1.0 - x) * (1.0 + x)), x)

    @triton.jit
    def fl_sinh(x):
        return _sinh_portable(x)

    @triton.jit
    def fl_cosh(x):
        return _cosh_portable(x)

    @triton.jit
    def fl_asinh(x):
        return _asinh_portable(x)

    @triton.jit
    def fl_acosh(x):
        return _acosh_portable(x)

    @triton.jit
    def fl_atanh(x):
        return _atanh_portable(x)

    @triton.jit
    def fl_erfc(x):
        return _erfc_portable(x)

    @triton.jit
    def fl_erfinv(x):
        return _erfinv_portable(x)

    @triton.jit
    def fl_lgamma(x):
        return _lgamma_portable(x)

    @triton.jit
    def fl_hypot(x, y):
        return _hypot_portable(x, y)
else:
    @triton.jit
    def fl_tan(x):
        return libdevice.tan(x)

    @triton.jit
    def fl_atan(x):
        return libdevice.atan(x)

    @triton.jit
    def fl_atan2(y, x):
        return libdevice.atan2(y, x)

    @triton.jit
    def fl_asin(x):
        return libdevice.asin(x)

    @triton.jit
    def fl_acos(x):
        return libdevice.acos(x)

    @triton.jit
    def fl_sinh(x):
        return libdevice.sinh(x)

    @triton.jit
    def fl_cosh(x):
        return libdevice.cosh(x)

    @triton.jit
    def fl_asinh(x):
        return libdevice.asinh(x)

    @triton.jit
    def fl_acosh(x):
        return libdevice.acosh(x)

    @triton.jit
    def fl_atanh(x):
        return libdevice.atanh(x)

    @triton.jit
    def fl_erfc(x):
        return libdevice.erfc(x)

    @triton.jit
    def fl_erfinv(x):
        return libdevice.erfinv(x)

    @triton.jit
    def fl_lgamma(x):
        return libdevice.lgamma(x)

    @triton.jit
    def fl_hypot(x, y):
        return libdevice.hypot(x, y)


@triton.jit
def fl_signbit(x):
    return _signbit_float(x)


@triton.jit
def fl_copysign(x, y):
    ax = tl.abs(x)
    return tl.where(_signbit_float(y), -ax, ax)


@triton.jit
def fl_fmax(x, y):
    # C's fmax: a NaN operand yields the other one.
    return tl.where(x != x, y, tl.where(y != y, x, tl.maximum(x, y)))


@triton.jit
def fl_fmin(x, y):
    return tl.where(x != x, y, tl.where(y != y, x, tl.minimum(x, y)))


@triton.jit
def fl_gcd(a, b, STEPS: tl.constexpr):
    # Euclid on magnitudes; STEPS bounds the iterations (46 for int32, 92 for int64: Fibonacci).
    x = tl.abs(a) + tl.abs(b) * 0
    y = tl.abs(b) + x * 0
    for _ in tl.static_range(STEPS):
        nonzero = y != 0
        r = x % tl.where(nonzero, y, 1)
        x = tl.where(nonzero, y, x)
        y = tl.where(nonzero, r, y)
    return x


@triton.jit
def fl_angle(x):
    # angle of a real number: pi for negatives, 0 otherwise, NaN kept.
    return tl.where(x < 0, 3.141592653589793, tl.where(x != x, x, 0.0))


# digamma and trigamma: libdevice has neither, so GPU and interpreter share these: recurrence up
# to x >= 10, the asymptotic series there (to x^-12 / x^-13: below float64's resolution), and the
# reflection formula for negative arguments.
@triton.jit
def _digamma_positive(x):
    acc = x * 0.0
    for _ in tl.static_range(10):
        small = x < 10.0
        acc = tl.where(small, acc - 1.0 / x, acc)
        x = tl.where(small, x + 1.0, x)
    r = 1.0 / (x * x)
    series = r * (1.0 / 12 - r * (1.0 / 120 - r * (1.0 / 252 - r * (
        1.0 / 240 - r * (1.0 / 132 - r * (691.0 / 32760))))))
    return acc + tl.log(x) - 0.5 / x - series


@triton.jit
def fl_digamma(x):
    neg = x < 0.5
    y = tl.where(neg, 1.0 - x, x)
    r = _digamma_positive(y)
    # cot has period pi: reduce to |x - n| <= 1/2 (exact), keeping poles' neighbourhoods accurate.
    p = 3.141592653589793 * (x - tl.floor(x + 0.5))
    r = tl.where(neg, r - 3.141592653589793 * tl.cos(p) / tl.sin(p), r)
    r = tl.where(x == 0, float("-inf"), r)
    r = tl.where(x < 0, tl.where(x == tl.floor(x), float("nan"), r), r)
    return tl.where(x == float("inf"), x, r)


@triton.jit
def _trigamma_positive(x):
    acc = x * 0.0
    for _ in tl.static_range(10):
        small = x < 10.0
        acc = tl.where(small, acc + 1.0 / (x * x), acc)
        x = tl.where(small, x + 1.0, x)
    t = 1.0 / x
    r = t * t
    series = t * (1.0 + t * (0.5 + t * (1.0 / 6 - r * (1.0 / 30 - r * (1.0 / 42 - r * (
        1.0 / 30 - r * (5.0 / 66 - r * (691.0 / 2730))))))))
    return acc + series


@triton.jit
def fl_trigamma(x):
    neg = x < 0.5
    y = tl.where(neg, 1.0 - x, x)
    r = _trigamma_positive(y)
    s = tl.sin(3.141592653589793 * (x - tl.floor(x + 0.5)))
    r = tl.where(neg, 9.869604401089358 / (s * s) - r, r)
    return tl.where(x <= 0, tl.where(x == tl.floor(x), float("inf"), r), r)
