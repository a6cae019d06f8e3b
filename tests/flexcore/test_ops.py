"""Every op a mod may use, lowered to Triton and checked against torch in float64: the forward
(the generated score_mod) and the backward (its lowered vector-Jacobian product: d score and the
gradients of captured tensors). One row per op; adding an op adds a row.

Each row computes ``op(x[, y])`` where x and y are per-position values mapped into the op's
domain through a sigmoid of the score and of captured tensors that require grad, so that the
op's derivative reaches d score and the captured gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from flexcore.errors import ModError, UnsupportedOpError
from flexcore.lowering import evaluate_mods, evaluate_score_backward, lower_score_mod
from flexcore.lowering.vjp import _vjp_graph, lower_score_mod_backward

pytestmark = [pytest.mark.usefixtures("kernel_cache_dir"),
              pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")]

# 19 x 23 leaves padded rows and columns in a 32 x 32 tile; two heads give h a range.
B, H, L, S = 1, 2, 19, 23
TILE = 32


@dataclass(frozen=True)
class Op:
    """``fn(x, y, q_idx, kv_idx, h, T)`` with x in ``x``'s interval, y in ``y``'s; ``T`` holds
    extra captured tensors (see _tensors)."""

    fn: object
    x: tuple = (-3.0, 3.0)
    y: tuple = (-3.0, 3.0)
    differentiable: bool = True  # False where torch itself has no derivative
    ref: object = None  # the same function as torch can differentiate it, where fn's op cannot


def _i(q, kv):
    return q - 7, kv + 1


OPS = {
    # arithmetic and powers
    "add_sub_mul_div": Op(lambda x, y, q, kv, h, T: (x + y) * x - y / (x.abs() + 1)),
    "neg_abs": Op(lambda x, y, q, kv, h, T: -x + x.abs()),
    "reciprocal": Op(lambda x, y, q, kv, h, T: torch.reciprocal(x), x=(0.5, 3)),
    "sqrt": Op(lambda x, y, q, kv, h, T: torch.sqrt(x), x=(0.1, 4)),
    "rsqrt": Op(lambda x, y, q, kv, h, T: torch.rsqrt(x), x=(0.1, 4)),
    "square": Op(lambda x, y, q, kv, h, T: torch.square(x)),
    "pow_scalar": Op(lambda x, y, q, kv, h, T: x ** 2.5 + x ** -1.5, x=(0.2, 3)),
    "pow_tensor": Op(lambda x, y, q, kv, h, T: torch.pow(x, y), x=(0.2, 3), y=(-2, 2)),
    "float_power": Op(lambda x, y, q, kv, h, T: torch.float_power(x, 2).float(), x=(0.2, 3)),
    # exponentials and logarithms
    "exp": Op(lambda x, y, q, kv, h, T: torch.exp(x)),
    "exp2": Op(lambda x, y, q, kv, h, T: torch.exp2(x)),
    "expm1": Op(lambda x, y, q, kv, h, T: torch.expm1(x)),
    "expm1_small": Op(lambda x, y, q, kv, h, T: torch.expm1(x) * 1e4, x=(-1e-4, 1e-4)),
    "log": Op(lambda x, y, q, kv, h, T: torch.log(x), x=(0.1, 5)),
    "log2": Op(lambda x, y, q, kv, h, T: torch.log2(x), x=(0.1, 5)),
    "log10": Op(lambda x, y, q, kv, h, T: torch.log10(x), x=(0.1, 5)),
    "log1p": Op(lambda x, y, q, kv, h, T: torch.log1p(x), x=(-0.5, 3)),
    "log1p_small": Op(lambda x, y, q, kv, h, T: torch.log1p(x) * 1e4, x=(-1e-4, 1e-4)),
    "logaddexp": Op(lambda x, y, q, kv, h, T: torch.logaddexp(x, y)),
    "logaddexp2": Op(lambda x, y, q, kv, h, T: torch.logaddexp2(x, y)),
    "xlogy": Op(lambda x, y, q, kv, h, T: torch.xlogy(x, y), y=(0.1, 4)),
    "xlog1py": Op(lambda x, y, q, kv, h, T: torch.special.xlog1py(x, y), y=(-0.5, 4)),
    # x = 0 where log's operand is 0 (log1p's -1): torch gives 0 and a derivative of 0 in x.
    "xlogy_at_zero": Op(lambda x, y, q, kv, h, T: torch.xlogy(x * (q != kv), (q - kv).abs().double())
                        + torch.special.xlog1py(x * (q != kv), (q - kv).abs().double() - 1) + x),
    "xlogy_scalars": Op(lambda x, y, q, kv, h, T: torch.xlogy(2.0, y) + torch.xlogy(x, 3.0)
                        + torch.special.xlog1py(0.5, y) + torch.special.xlog1py(x, 2.0), y=(0.1, 4)),
    "entr": Op(lambda x, y, q, kv, h, T: torch.special.entr(x), x=(0.05, 3)),
    "logit": Op(lambda x, y, q, kv, h, T: torch.logit(x), x=(0.05, 0.95)),
    # trigonometric and hyperbolic
    "sin": Op(lambda x, y, q, kv, h, T: torch.sin(x), x=(-4, 4)),
    "cos": Op(lambda x, y, q, kv, h, T: torch.cos(x), x=(-4, 4)),
    "tan": Op(lambda x, y, q, kv, h, T: torch.tan(x), x=(-1.4, 1.4)),
    "asin": Op(lambda x, y, q, kv, h, T: torch.asin(x), x=(-0.95, 0.95)),
    "acos": Op(lambda x, y, q, kv, h, T: torch.acos(x), x=(-0.95, 0.95)),
    "atan": Op(lambda x, y, q, kv, h, T: torch.atan(x), x=(-6, 6)),
    "atan2": Op(lambda x, y, q, kv, h, T: torch.atan2(x, y)),
    "sinh": Op(lambda x, y, q, kv, h, T: torch.sinh(x), x=(-4, 4)),
    "cosh": Op(lambda x, y, q, kv, h, T: torch.cosh(x), x=(-4, 4)),
    "tanh": Op(lambda x, y, q, kv, h, T: torch.tanh(x), x=(-4, 4)),
    "asinh": Op(lambda x, y, q, kv, h, T: torch.asinh(x), x=(-6, 6)),
    "acosh": Op(lambda x, y, q, kv, h, T: torch.acosh(x), x=(1.05, 6)),
    "atanh": Op(lambda x, y, q, kv, h, T: torch.atanh(x), x=(-0.9, 0.9)),
    "hypot": Op(lambda x, y, q, kv, h, T: torch.hypot(x, y)),
    "deg2rad_rad2deg": Op(lambda x, y, q, kv, h, T: torch.deg2rad(x) + torch.rad2deg(y) * 0.01),
    "sinc": Op(lambda x, y, q, kv, h, T: torch.sinc(x)),
    # At the point where torch's decomposition divides 0 by 0 (its derivative there is 0).
    "sinc_at_zero": Op(lambda x, y, q, kv, h, T: torch.sinc(x * (q != kv)) + x),
    # special functions
    "erf": Op(lambda x, y, q, kv, h, T: torch.erf(x)),
    "erfc": Op(lambda x, y, q, kv, h, T: torch.erfc(x)),
    "erfinv": Op(lambda x, y, q, kv, h, T: torch.erfinv(x), x=(-0.95, 0.95)),
    "lgamma": Op(lambda x, y, q, kv, h, T: torch.lgamma(x), x=(0.2, 6)),
    "lgamma_negative": Op(lambda x, y, q, kv, h, T: torch.lgamma(x), x=(-2.8, -2.2)),
    "digamma": Op(lambda x, y, q, kv, h, T: torch.digamma(x) + torch.special.psi(y * 3),
                  x=(0.1, 14), y=(-0.8, -0.4)),  # y * 3 stays between the poles -2 and -1
    "ndtr": Op(lambda x, y, q, kv, h, T: torch.special.ndtr(x)),
    # activations
    "sigmoid": Op(lambda x, y, q, kv, h, T: torch.sigmoid(x) + torch.special.expit(y)),
    "relu": Op(lambda x, y, q, kv, h, T: F.relu(x)),
    "relu6": Op(lambda x, y, q, kv, h, T: F.relu6(x * 3)),
    "leaky_relu": Op(lambda x, y, q, kv, h, T: F.leaky_relu(x, 0.1)),
    "elu": Op(lambda x, y, q, kv, h, T: F.elu(x)),
    "selu": Op(lambda x, y, q, kv, h, T: F.selu(x)),
    "celu": Op(lambda x, y, q, kv, h, T: F.celu(x, 0.5)),
    "gelu": Op(lambda x, y, q, kv, h, T: F.gelu(x)),
    "gelu_tanh": Op(lambda x, y, q, kv, h, T: F.gelu(x, approximate="tanh")),
    "silu": Op(lambda x, y, q, kv, h, T: F.silu(x)),
    "mish": Op(lambda x, y, q, kv, h, T: F.mish(x)),
    "softplus": Op(lambda x, y, q, kv, h, T: F.softplus(x) + F.softplus(y, beta=2, threshold=3)),
    "softsign": Op(lambda x, y, q, kv, h, T: F.softsign(x)),
    "hardsigmoid": Op(lambda x, y, q, kv, h, T: F.hardsigmoid(x * 2)),
    "hardswish": Op(lambda x, y, q, kv, h, T: F.hardswish(x * 2)),
    "hardtanh": Op(lambda x, y, q, kv, h, T: F.hardtanh(x, -1.5, 2.0)),
    "hardshrink": Op(lambda x, y, q, kv, h, T: F.hardshrink(x, 0.7)),
    "softshrink": Op(lambda x, y, q, kv, h, T: F.softshrink(x, 0.7)),
    "tanhshrink": Op(lambda x, y, q, kv, h, T: F.tanhshrink(x)),
    "threshold": Op(lambda x, y, q, kv, h, T: F.threshold(x, 0.3, -2.0)),
    "logsigmoid": Op(lambda x, y, q, kv, h, T: F.logsigmoid(x)),
    "softcap": Op(lambda x, y, q, kv, h, T: 2.0 * torch.tanh(x / 2.0), x=(-20, 20)),
    # rounding, clamps, min / max, remainders
    "floor_ceil_trunc": Op(lambda x, y, q, kv, h, T: torch.floor(x) + torch.ceil(x) * 2
                           + torch.trunc(x) * 3 + torch.fix(y) * 4 + x),
    "round": Op(lambda x, y, q, kv, h, T: torch.round(x * 2) + torch.round(y, decimals=1)
                + torch.round(x * 40, decimals=-1) + x),
    "frac": Op(lambda x, y, q, kv, h, T: torch.frac(x)),
    "sign": Op(lambda x, y, q, kv, h, T: torch.sign(x) + torch.sgn(y) + x),
    "clamp": Op(lambda x, y, q, kv, h, T: torch.clamp(x, -1, 2) + x.clamp(min=y)
                + torch.clamp_max(x, 0.5) + torch.clamp_min(y, -0.5)),
    "minimum_maximum": Op(lambda x, y, q, kv, h, T: torch.minimum(x, y) + torch.maximum(x, y) * 2
                          + torch.max(x, y) * 3 + torch.min(x, y) * 4),
    "fmin_fmax": Op(lambda x, y, q, kv, h, T: torch.fmin(x, y) + 2 * torch.fmax(x, y)),
    "remainder_float": Op(lambda x, y, q, kv, h, T: torch.remainder(x, 0.7) + x % -1.3),
    "fmod_float": Op(lambda x, y, q, kv, h, T: torch.fmod(x, 0.7) + torch.fmod(x, -1.1)),
    "floor_divide_float": Op(lambda x, y, q, kv, h, T: torch.floor_divide(x, 0.3) + x,
                             differentiable=False),
    "copysign": Op(lambda x, y, q, kv, h, T: torch.copysign(x, y)),
    # Signed zeros: a negated +0 and a -0.0 constant are -0, as in torch.
    "signed_zero": Op(lambda x, y, q, kv, h, T: x + torch.copysign(x * 0 + 1, -(x * 0))
                      + torch.copysign(y * 0 + 2, (q - kv) * -0.0)),
    "lerp_addcmul_addcdiv": Op(lambda x, y, q, kv, h, T: torch.lerp(x, y, 0.3)
                               + torch.addcmul(x, x, y, value=0.5)
                               + torch.addcdiv(x, x, y, value=0.5), y=(0.5, 3)),
    # torch's heaviside has no derivative; the lowering decomposes it into wheres, whose
    # derivative (zero almost everywhere) the reference spells out.
    "heaviside": Op(lambda x, y, q, kv, h, T: torch.heaviside(x, y) + x,
                    ref=lambda x, y, q, kv, h, T: torch.where(x > 0, 1.0, torch.where(
                        x == 0, y, 0.0)) + x),
    "angle": Op(lambda x, y, q, kv, h, T: torch.angle(x) + x),
    "nan_to_num": Op(lambda x, y, q, kv, h, T: torch.nan_to_num(torch.log(x), nan=0.5) + x,
                     x=(-1, 2)),
    # comparisons, logic, predicates, where
    "comparisons": Op(lambda x, y, q, kv, h, T: (x < y).float() + (x <= y) * 2.0 + (x > 0.5) * 3.0
                      + (x >= y) * 4.0 + (x == x) * 5.0 + (x != y) * 6.0 + x),
    "logical": Op(lambda x, y, q, kv, h, T: torch.logical_and(x > 0, y > 0).float()
                  + torch.logical_or(x > 1, y < -1) * 2.0 + torch.logical_xor(x > 0, y > 0) * 3.0
                  + torch.logical_not(x > 0) * 4.0 + x),
    "predicates": Op(lambda x, y, q, kv, h, T: torch.signbit(x).float() + torch.isfinite(x) * 2.0
                     + torch.isnan(x) * 3.0 + torch.isinf(x) * 4.0 + torch.isposinf(x) * 5.0
                     + torch.isneginf(y) * 6.0 + x),
    "where": Op(lambda x, y, q, kv, h, T: torch.where(x > y, x * 2, y) + x.masked_fill(x < 0, 0.5)),
    # integer ops on the indices (no gradient through them)
    "int_arithmetic": Op(lambda x, y, q, kv, h, T: x + (_i(q, kv)[0] * _i(q, kv)[1]
                                                        - abs(_i(q, kv)[0]) + (-kv)) * 0.01),
    "int_floordiv_remainder_fmod": Op(lambda x, y, q, kv, h, T: x + 0.1 * (
        torch.floor_divide(q - 7, 3) + torch.remainder(kv - 11, 4) + torch.fmod(q - 9, 4)
        + torch.div(kv - 5, -3, rounding_mode="trunc"))),
    # INT32_MIN as the dividend (a wrapped hash): its magnitude does not fit the type.
    "int_min_division": Op(lambda x, y, q, kv, h, T: x + 1e-9 * ((kv - 2**31) // 7 + (kv - 2**31) % 5
                                                              + torch.fmod(kv - 2**31, 3)
                                                              + torch.div(q - 2**31, -7,
                                                                          rounding_mode="trunc"))),
    "bitwise": Op(lambda x, y, q, kv, h, T: x + 0.01 * ((q & kv) + (q | 5) + (q ^ kv) + (~kv)
                                                        + torch.bitwise_left_shift(q, 2)
                                                        + torch.bitwise_right_shift(kv, 1))),
    "bitwise_bool": Op(lambda x, y, q, kv, h, T: x + ((q > 3) & (kv < 9) | ~(q == kv)
                                                     ^ (kv % 2 == 0)).float()),
    "gcd_lcm": Op(lambda x, y, q, kv, h, T: x + 0.01 * (torch.gcd(q, kv) + torch.lcm(q + 1, kv))),
    "int_minmax_clamp": Op(lambda x, y, q, kv, h, T: x + 0.01 * (torch.maximum(q, kv)
                                                                  - torch.minimum(q - 3, kv)
                                                                  + torch.clamp(q - kv, -5, 5))),
    "casts": Op(lambda x, y, q, kv, h, T: (x * 10).int().float() * 0.1 + x.to(torch.bfloat16).float()
                + x.half().float() + x.double().float() + (x > 0).long().float() + x),
    # shapes: views of size-1 dimensions, small reductions, nested indexing (torch's vmap semantics)
    "unsqueeze_squeeze_any_all": Op(lambda x, y, q, kv, h, T: x.unsqueeze(0).squeeze(0)
                                    + q.unsqueeze(0).any().float() + (kv.view(1, 1) > 3).all(1)[0]
                                    + x[None].expand(3).sum() + x.view(1).amax(0)),
    "stack_cat_reductions": Op(lambda x, y, q, kv, h, T: torch.stack([x, y, x * y]).amax()
                               + torch.cat([x.view(1), y.view(1)]).mean()
                               + torch.stack([x, y]).prod() + torch.stack([x, y]).amin()
                               + torch.logsumexp(torch.stack([x, y]), 0)
                               + torch.softmax(torch.stack([x, y]), 0)[1]
                               + torch.stack([x, y, x]).cumsum(0)[2]
                               + torch.stack([x, y]).cumprod(0)[1]),
    "argmax": Op(lambda x, y, q, kv, h, T: torch.stack([x, y, -x]).argmax().float() + x
                 + torch.stack([x, y]).max(0).values),
    # A captured vector read whole: its gradient has one lane per element.
    "whole_capture": Op(lambda x, y, q, kv, h, T: torch.logsumexp(x * T["w"], 0) + (T["w"] * y).sum()),
    "dot_mla": Op(lambda x, y, q, kv, h, T: x + 0.5 * torch.dot(T["qr"][0, h, q], T["kr"][0, 0, kv])),
    "matmul_mv_mm": Op(lambda x, y, q, kv, h, T: x + (T["m"][h] @ T["kr"][0, 0, kv]).sum()
                       + (T["kr"][0, 0, kv] @ T["m"][h].T)[1]
                       + (T["m"][h][:, :2] @ T["m"][h][:2]).amax()),
    "nested_index": Op(lambda x, y, q, kv, h, T: x + T["table"][q][kv] + T["table"][q, kv]),
    "head_then_row": Op(lambda x, y, q, kv, h, T: x + T["bias"][h][q]),
    "transposed_capture": Op(lambda x, y, q, kv, h, T: x + T["table"].T[kv][q]
                             + T["table"].permute(1, 0)[kv, q]),
    "unsqueezed_capture": Op(lambda x, y, q, kv, h, T: x + T["table"].unsqueeze(0)[0, q, kv]
                             + T["table"][None][0][q][kv] + T["bias"][:, None, :][h, 0, q]),
    "sliced_capture": Op(lambda x, y, q, kv, h, T: x + T["table"][1:][q % (L - 1)][kv]
                         + T["table"][:, ::2][q, kv // 2]),
    "expanded_capture": Op(lambda x, y, q, kv, h, T: x + T["bias"][None].expand(3, H, L)[kv % 3, h, q]
                           + T["bias"][:, :1].expand(H, 5)[h, kv % 5]),
    "reshaped_capture": Op(lambda x, y, q, kv, h, T: x + T["bias"].view(-1)[h * L + q]
                           + T["table"].reshape(S, L)[kv, q] + T["qr"].flatten()[q * 4 + kv % 4]),
    "index_select": Op(lambda x, y, q, kv, h, T: x + T["table"].index_select(0, q.unsqueeze(0))[0, kv]),
    "index_by_vector": Op(lambda x, y, q, kv, h, T: x + T["table"][q][torch.stack([kv, kv // 2])].sum()),
    # Tensors made inside the mod, on the indices' device (as torch's eager path needs).
    "constant_vector": Op(lambda x, y, q, kv, h, T: x + torch.tensor([0.5, -1.0, 2.0], device=kv.device)[kv % 3]
                          + torch.arange(4, device=q.device)[q % 4] * 0.1),
}


def _tensors(dtype, requires_grad: bool) -> dict:
    gen = torch.Generator().manual_seed(11)

    def r(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=gen) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    return {"w": r(H, scale=0.3).detach().add(1.0).requires_grad_(requires_grad),
            "c": r(S, scale=0.5), "d": r(L, scale=0.5), "table": r(L, S), "bias": r(H, L),
            "qr": r(1, H, L, 4), "kr": r(1, 1, S, 4), "m": r(H, 3, 4)}


def _mod(op: Op, T: dict, reference: bool = False):
    (lo, hi), (lo2, hi2) = op.x, op.y
    w, c, d = T["w"], T["c"], T["d"]
    fn = op.ref if reference and op.ref is not None else op.fn

    def mod(score, b, h, q_idx, kv_idx):
        x = lo + (hi - lo) * torch.sigmoid(score * w[h] + c[kv_idx])
        y = lo2 + (hi2 - lo2) * torch.sigmoid(score * 0.5 - d[q_idx])
        return fn(x, y, q_idx, kv_idx, h, T).to(score.dtype)
    return mod


def _vmapped(mod):
    """mod over (score, b, h, q, kv) as torch's flex_attention evaluates it: once per element."""
    fn = mod
    for dim in reversed(range(4)):
        in_dims = [None] * 4
        in_dims[dim] = 0
        fn = torch.vmap(fn, in_dims=tuple([0] + in_dims))
    return fn


def _eager(op: Op, score: torch.Tensor, grad: torch.Tensor, dtype):
    """Output, d score and captured gradients (by name) of torch's evaluation in ``dtype``."""
    T = _tensors(dtype, requires_grad=True)
    s = score.to(dtype).requires_grad_(True)
    idx = [torch.arange(n, dtype=torch.int32) for n in (B, H, L, S)]
    out = _vmapped(_mod(op, T, reference=True))(s, *idx)
    if not op.differentiable:
        return out.detach(), None, {}
    names = [k for k, t in T.items() if t.requires_grad]
    grads = torch.autograd.grad((out * grad.to(dtype)).sum(), [s] + [T[k] for k in names],
                                allow_unused=True)
    return out.detach(), grads[0], dict(zip(names, grads[1:]))


def _close(ours, ref64, ref32, what, atol=1e-5, rtol=1e-5):
    ours, ref32 = ours.double(), ref32.double()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref64)), f"{what}: NaN positions differ"
    fin = torch.isfinite(ref64)
    assert torch.equal(ours[~fin & ~torch.isnan(ref64)], ref64[~fin & ~torch.isnan(ref64)]), what
    err = (ours - ref64)[fin].abs()
    tol = 2 * (ref32 - ref64)[fin].abs() + atol + rtol * ref64[fin].abs()
    assert bool((err <= tol).all()), f"{what}: max error {err.max().item():.3g} exceeds tolerance"


def _close_norm(ours, ref64, ref32, what):
    # Captured gradients sum many positions: compare as a whole, relative to torch's own error.
    err = (ours.double() - ref64).norm()
    base = (ref32.double() - ref64).norm()
    assert err <= 2 * base + 1e-5 * ref64.norm() + 1e-6, f"{what}: error {err:.3g} vs torch {base:.3g}"


# Rows past this one change shapes and read captured tables: their gradients are also
# evaluated with the tiles transposed, as the backward's dK/dV programs hold them.
_FIRST_SHAPE_ROW = list(OPS).index("unsqueeze_squeeze_any_all")


def _check_op(name: str, device: str) -> None:
    op = OPS[name]
    gen = torch.Generator().manual_seed(5)
    score = torch.randn(B, H, L, S, generator=gen)
    grad = torch.randn(B, H, L, S, generator=gen)
    ref64, ds64, cg64 = _eager(op, score, grad, torch.float64)
    ref32, ds32, cg32 = _eager(op, score, grad, torch.float32)

    T = {k: t.detach().to(device).requires_grad_() for k, t in
         _tensors(torch.float32, requires_grad=False).items()}
    mod = _mod(op, T)
    score, grad = score.to(device), grad.to(device)
    out, _ = evaluate_mods(mod, None, B, H, L, S, score=score, block_m=TILE, block_n=TILE)
    _close(out.cpu(), ref64, ref32, f"{name} forward")

    captured = lower_score_mod(mod).captured
    if not op.differentiable:
        # torch has no derivative here; neither does the lowering, and it says so.
        with pytest.raises(ModError, match="not implemented"):
            evaluate_score_backward(mod, score, grad, block_m=TILE, block_n=TILE)
        return
    orientations = (False, True) if list(OPS).index(name) >= _FIRST_SHAPE_ROW else (False,)
    for transposed in orientations:
        dscore, grads = evaluate_score_backward(mod, score, grad, block_m=TILE, block_n=TILE,
                                                transposed=transposed)
        _close(dscore.cpu(), ds64, ds32, f"{name} d score", atol=1e-4, rtol=1e-4)
        for key, t in T.items():
            if not any(c is t for c in captured):
                continue
            g = grads[next(i for i, c in enumerate(captured) if c is t)]
            ref = cg64[key]
            if ref is None:
                assert g is None or not g.any(), f"{name}: gradient of {key} should be zero"
                continue
            assert g is not None, f"{name}: no gradient for {key}"
            _close_norm(g.cpu(), ref, cg32[key], f"{name} d {key}")


@pytest.mark.parametrize("name", list(OPS))
def test_op_forward_and_gradients(name):
    _check_op(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPS))
def test_op_forward_and_gradients_gpu(name):
    # Compiled Triton: libdevice's functions where the interpreter has portable ones.
    _check_op(name, "cuda")


# A mod is traced over stand-ins for (score, b, h, q_idx, kv_idx) and, for its gradient, grad on
# the device of the tensors it captures, as torch evaluates it on the query's device: meta tensors
# stand for a GPU's here (lowering reads only dtypes and shapes). On the CPU the index_select row
# met two devices, and a gradient graph over two devices ran on two autograd engine threads that
# shared one fake-tensor mode (the GPU's "AssertionError: False, True").
@pytest.mark.parametrize("name", list(OPS))
def test_op_traces_on_the_captured_tensors_device(name):
    op = OPS[name]
    T = {k: t.to("meta").requires_grad_() for k, t in _tensors(torch.float32, False).items()}
    mod = _mod(op, T)
    forward = lower_score_mod(mod)
    meta = torch.device("meta")
    graphs = [forward.graph]
    if op.differentiable:
        lower_score_mod_backward(mod, forward)
        grads, _ = _vjp_graph(forward.graph, [t for t in forward.captured if t.requires_grad],
                              torch.float32)
        graphs.append(grads)
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                assert node.meta["val"].device == meta, f"{name}: {node.name} traced off the device"
            elif node.op == "get_attr":  # captured tensors and tensors made in the mod
                t = getattr(graph, node.target)
                assert t.device == meta, f"{name}: {node.target} on {t.device}"


def _per_head_mod(op: Op, T: dict, reference: bool = False):
    (lo, hi), (lo2, hi2) = op.x, op.y
    w = T["w"]
    fn = op.ref if reference and op.ref is not None else op.fn

    def mod(score, b, h, q_idx, kv_idx):
        # x and y depend on h only: one number per program in the kernels (a 0-d tensor).
        x = lo + (hi - lo) * torch.sigmoid(w[h] * 1.3 - 0.2)
        y = lo2 + (hi2 - lo2) * torch.sigmoid(w[h] * 0.7 + 0.1)
        return score + fn(x, y, q_idx, kv_idx, h, T).to(score.dtype)
    return mod


@pytest.mark.parametrize("name", list(OPS))
def test_op_of_a_value_per_head(name):
    op = OPS[name]
    score = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(7))
    idx = [torch.arange(n, dtype=torch.int32) for n in (B, H, L, S)]
    refs = {dtype: _vmapped(_per_head_mod(op, _tensors(dtype, False), True))(score.to(dtype), *idx)
            for dtype in (torch.float64, torch.float32)}
    out, _ = evaluate_mods(_per_head_mod(op, _tensors(torch.float32, False)), None, B, H, L, S,
                           score=score, block_m=TILE, block_n=TILE)
    _close(out, refs[torch.float64], refs[torch.float32], f"{name} per head")


# Each is an op a mod may write that has no lowering, and the reason is given.
REFUSED = {
    "polygamma_2": lambda s: torch.polygamma(2, s),
    "zeta": lambda s: torch.special.zeta(s, 2.0),
    "i0": lambda s: torch.special.i0(s),
    "nextafter": lambda s: torch.nextafter(s, s + 1),
    "rand_like": lambda s: s + torch.rand_like(s),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_ops_name_the_op_and_the_reason(name):
    fn = REFUSED[name]

    def mod(score, b, h, q_idx, kv_idx):
        return fn(score)

    with pytest.raises(UnsupportedOpError) as info:
        lower_score_mod(mod)
    err = info.value
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if text.startswith(f'    "{name}":'))
    assert err.filename == __file__ and err.lineno == line  # the user's own line
    assert "has no Triton lowering" in str(err) and err.op
    assert ":" in str(err).split("has no Triton lowering", 1)[1]  # a reason follows


def test_too_large_a_value_per_position_is_refused():
    table = torch.randn(L, 1000)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx].sum()  # 1000 elements per position

    with pytest.raises(UnsupportedOpError, match="1000 elements"):
        lower_score_mod(mod)


# The interpreter's portable versions of libdevice functions are float64-accurate too (float64
# inputs lower the mods in float64).
FLOAT64_OPS = ["tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh",
               "hypot", "erf", "erfc", "erfinv", "lgamma", "lgamma_negative", "digamma", "expm1",
               "expm1_small", "log1p", "log1p_small", "tanh", "copysign", "predicates", "gelu",
               "silu", "softplus"]


@pytest.mark.parametrize("name", FLOAT64_OPS)
def test_op_in_float64(name):
    op = OPS[name]
    score = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ref, _, _ = _eager(op, score, torch.zeros_like(score), torch.float64)
    T = _tensors(torch.float64, requires_grad=False)
    out, _ = evaluate_mods(_mod(op, T), None, B, H, L, S, score=score, block_m=TILE, block_n=TILE)
    assert out.dtype == torch.float64
    err = (out - ref).abs()
    assert bool((err <= 1e-13 * (1 + ref.abs())).all()), f"{name}: max error {err.max():.3g}"
