"""float64 inputs are computed in float64 end to end: forward, decode-length queries, backward (lse
gradients and captured tensors included), to within rounding of the float64 reference, so that
``torch.autograd.gradcheck`` passes with its default tolerances.

Rounding of float64 sums over a few hundred terms stays near 1e-15; the tests allow 1e-12, far
below the 1e-8 that a single float32 constant or argument in the kernels gives.
"""
from __future__ import annotations

import pytest
import torch

from flexcore import AuxRequest, create_block_mask, flex_attention
from tests.flexcore.cases import Shape, make_mods
from tests.flexcore.compare import seed_of
from tests.flexcore.helpers import kernel_grads, learnable_bias, reference_grads

DEVICE = "cpu"
F64 = torch.float64
TOL = 1e-12


def rel(a, g) -> float:
    """Relative Frobenius error over the entries where the golden is finite (same infinities)."""
    fin = torch.isfinite(g)
    assert torch.equal(torch.isfinite(a), fin)
    assert torch.equal(a[~fin], g[~fin])
    return ((a[fin] - g[fin]).norm() / g[fin].norm().clamp_min(1e-300)).item()


# Why these: a scale whose float32 rounding is visible (0.3), a score_mod over a captured tensor
# (alibi) and one through tanh (softcap), ragged lengths with Dv != D, GQA, and 4 queries, which
# flex_attention would give to the decode kernel in other dtypes.
CASES = [
    ("noop", Shape("sq64", B=2, Hq=2, Hkv=2, L=64, S=64, D=16, Dv=16, block=32), None),
    ("causal", Shape("sq64", B=2, Hq=2, Hkv=2, L=64, S=64, D=16, Dv=16, block=32), 0.3),
    ("alibi", Shape("ragged", B=1, Hq=2, Hkv=2, L=50, S=70, D=16, Dv=8, block=32), None),
    ("softcap", Shape("sq64", B=2, Hq=2, Hkv=2, L=64, S=64, D=16, Dv=16, block=32), None),
    ("document", Shape("gqa", B=1, Hq=4, Hkv=2, L=64, S=64, D=16, Dv=16, block=32), None),
    ("causal", Shape("decode4", B=2, Hq=4, Hkv=2, L=4, S=80, D=16, Dv=16, block=32), None),
    # Scales whose float64 bits are small integers (0.0, the least subnormal): the kernels take
    # the bits as an int, which triton types as int32 (or specialises, for 1).
    ("noop", Shape("sq64", B=2, Hq=2, Hkv=2, L=64, S=64, D=16, Dv=16, block=32), 0.0),
    ("alibi", Shape("ragged", B=1, Hq=2, Hkv=2, L=50, S=70, D=16, Dv=8, block=32), -0.0),
    ("causal", Shape("sq64", B=2, Hq=2, Hkv=2, L=64, S=64, D=16, Dv=16, block=32), 5e-324),
]


@pytest.mark.parametrize("mod_name,shape,scale", CASES, ids=[f"{m}-{s.name}-{c}" for m, s, c in CASES])
def test_outputs_and_gradients_to_float64_rounding(mod_name, shape, scale):
    gen = torch.Generator().manual_seed(seed_of("f64", mod_name, shape.name, scale))
    q, k, v = shape.qkv(F64, DEVICE, gen)
    score_mod, mask_mod = make_mods(mod_name, shape, DEVICE, gen)
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=shape.block)
    gqa = shape.Hq != shape.Hkv
    grad_out = torch.randn(shape.B, shape.Hq, shape.L, shape.Dv, generator=gen, dtype=F64)
    grad_lse = torch.randn(shape.B, shape.Hq, shape.L, generator=gen, dtype=F64)
    out, lse, row_stats, grads = kernel_grads(q, k, v, score_mod, bm, grad_out, grad_lse, scale=scale,
                                              enable_gqa=gqa)
    gold, gold_lse, golden = reference_grads(q, k, v, score_mod, bm, grad_out, grad_lse, upcast=True,
                                             scale=scale, enable_gqa=gqa)
    assert out.dtype == lse.dtype == row_stats.dtype == F64
    assert rel(out, gold) <= TOL and rel(lse, gold_lse) <= TOL
    for name, a, g in zip(("dq", "dk", "dv"), grads, golden):
        assert a.dtype == F64 and rel(a, g) <= TOL, (name, rel(a, g))
    # The public call gives the same output (it routes 4 queries away from the decode kernel too).
    public, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
                                 return_aux=AuxRequest(lse=True))
    public_lse = aux.lse
    assert rel(public, gold) <= TOL and rel(public_lse, gold_lse) <= TOL


def test_captured_tensor_gradient_to_float64_rounding():
    shape = Shape("bias", B=1, Hq=2, Hkv=2, L=64, S=96, D=16, Dv=16, block=32)
    gen = torch.Generator().manual_seed(seed_of("f64_bias"))
    q, k, v = shape.qkv(F64, DEVICE, gen)
    factory, bias = learnable_bias(shape.S, gen, F64)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 32, None, None, shape.L, shape.S,
                           device=DEVICE, BLOCK_SIZE=shape.block)
    grad_out = torch.randn(shape.B, shape.Hq, shape.L, shape.Dv, generator=gen, dtype=F64)
    grad_lse = torch.randn(shape.B, shape.Hq, shape.L, generator=gen, dtype=F64)
    *_, grads = kernel_grads(q, k, v, factory(bias), bm, grad_out, grad_lse, captured=(bias,))
    bias64 = bias.detach().clone().requires_grad_()
    *_, golden = reference_grads(q, k, v, factory(bias64), bm, grad_out, grad_lse, upcast=True, captured=(bias64,))
    for name, a, g in zip(("dq", "dk", "dv", "dbias"), grads, golden):
        assert a.dtype == F64 and rel(a, g) <= TOL, (name, rel(a, g))


def test_gradcheck_through_flex_attention():
    """gradcheck with its default tolerances on q, k, v and a captured slope: finite differences of
    step 1e-6 see float32-sized errors as 1e-2 gradient errors. Fast mode (random directional
    derivatives: a few dozen forward calls instead of one pair per input entry) keeps it to seconds
    under the interpreter."""
    gen = torch.Generator().manual_seed(seed_of("f64_gradcheck"))
    q, k, v = (torch.randn(1, 1, 32, 4, generator=gen, dtype=F64).requires_grad_() for _ in range(3))
    slope = torch.rand(1, generator=gen, dtype=F64).requires_grad_()
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32, device=DEVICE,
                           BLOCK_SIZE=16)

    def fn(q, k, v, slope):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slope[h] * (q_idx - kv_idx).abs()
        return flex_attention(q, k, v, score_mod=alibi, block_mask=bm, scale=0.3)  # 0.3: inexact in float32

    assert torch.autograd.gradcheck(fn, (q, k, v, slope), fast_mode=True)


class _KernelAttention(torch.autograd.Function):
    """out and a differentiable lse from the kernels (as tests/flexcore/helpers.kernel_grads),
    scale 0.3 (inexact in float32)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, factory, bm):
        from flexcore import attention
        from flexcore.kernels.forward import forward
        from flexcore.lowering import lower_mask_mod, lower_score_mod

        score_mod = factory(bias)
        B, H = q.shape[:2]
        out, lse, _ = forward(q, k, v, lower_score_mod(score_mod, F64), lower_mask_mod(bm.mask_mod),
                              attention.kv_blocks(bm, B, H), 0.3, _options())
        ctx.save_for_backward(q, k, v, bias)
        ctx.factory, ctx.bm = factory, bm
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias = ctx.saved_tensors
        *_, grads = kernel_grads(q, k, v, ctx.factory(bias), ctx.bm, grad_out.contiguous(), grad_lse,
                                 scale=0.3, captured=(bias,))
        return (*grads, None, None)


def _options():
    from flexcore import KernelOptions
    return KernelOptions()


def test_gradcheck_of_the_lse_gradient():
    """gradcheck (default tolerances) of out and lse from the kernels, whose backward takes grad_lse,
    on q, k, v and a captured bias."""
    gen = torch.Generator().manual_seed(seed_of("f64_gradcheck_lse"))
    q, k, v = (torch.randn(1, 1, 32, 4, generator=gen, dtype=F64).requires_grad_() for _ in range(3))
    factory, bias = learnable_bias(32, gen, F64)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32, device=DEVICE,
                           BLOCK_SIZE=16)
    assert torch.autograd.gradcheck(lambda *t: _KernelAttention.apply(*t, factory, bm), (q, k, v, bias),
                                    fast_mode=True)
