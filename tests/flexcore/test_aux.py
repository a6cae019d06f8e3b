"""flex_attention's auxiliary outputs: ``return_aux=AuxRequest(lse=..., max_scores=...)`` with
torch 2.13's semantics, the deprecated ``return_lse``, and the differentiable lse.

Values are compared with torch's eager flex_attention on the same inputs (lse) or torch's own
definition of max_scores (``math_attention``, which torch's kernels follow; its CPU entry point
refuses max_scores), and with a float64 golden; gradients of a loss that uses lse with the float64
reference's autograd, within twice the error of torch's computation in float32.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import flexcore
from flexcore import AuxOutput, AuxRequest, create_block_mask, flex_attention
from flexcore import attention
from flexcore.errors import InputError
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference
from tests.flexcore.compare import seed_of

H, D = 2, 16


def causal_gapped(b, h, q_idx, kv_idx):
    # Query rows 5, 12, 19, ... keep no key at all: lse and max_scores are -inf there.
    return (q_idx >= kv_idx) & (q_idx % 7 != 5)


def make_inputs(L, S, dtype, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, H, S, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, H, S, D, generator=g, dtype=torch.float64).to(dtype)
    slopes = (torch.rand(H, generator=g, dtype=torch.float64) + 0.1).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, slopes)]


def alibi_of(slopes, offset):
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx)
    return alibi


def golden_stats(q, k, slopes, mask_mod, offset):
    """float64 (lse, max_scores) by the definition: the row logsumexp and max of the modded,
    masked scores, -inf on rows without a kept key."""
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    qi = torch.arange(L).view(L, 1)
    ki = torch.arange(S).view(1, S)
    s = s - slopes.double().view(1, Hq, 1, 1) * (qi + offset - ki)
    keep = mask_mod(None, None, qi + offset, ki).expand(L, S)
    s = s.masked_fill(~keep, -math.inf)
    return torch.logsumexp(s, -1), s.amax(-1)


def test_aux_classes_are_torchs():
    assert flexcore.AuxRequest is torch_flex.AuxRequest
    assert flexcore.AuxOutput is torch_flex.AuxOutput
    assert AuxRequest() == (False, False)


@pytest.mark.parametrize("lse,max_scores",
                         [(False, False), (True, False), (False, True), (True, True)])
def test_return_aux_fields(lse, max_scores):
    q, k, v, _ = make_inputs(64, 64, torch.float32, seed_of("fields", lse, max_scores))
    bm = create_block_mask(causal_gapped, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    out, aux = flex_attention(q, k, v, block_mask=bm,
                              return_aux=AuxRequest(lse=lse, max_scores=max_scores))
    assert isinstance(aux, AuxOutput)
    assert out.shape == q.shape
    assert (aux.lse is not None) == lse and (aux.max_scores is not None) == max_scores
    for t in (aux.lse, aux.max_scores):
        if t is not None:
            assert t.shape == (2, H, 64) and t.dtype == torch.float32


def test_return_lse_with_return_aux_is_a_value_error():
    q, k, v, _ = make_inputs(64, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="return_aux"):
        flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(InputError, match="return_aux must be"):
        flex_attention(q, k, v, return_aux=True)


def test_return_lse_warns_once_as_deprecated(monkeypatch):
    monkeypatch.setattr(attention, "_warned_return_lse", False)
    q, k, v, _ = make_inputs(64, 64, torch.float32, 1)
    with pytest.warns(FutureWarning, match="return_aux=AuxRequest"):
        out, lse = flex_attention(q, k, v, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out2, lse2 = flex_attention(q, k, v, return_lse=True)  # once per process, as torch
    _, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    assert torch.equal(lse, aux.lse) and torch.equal(lse2, lse) and torch.equal(out2, out)


@pytest.mark.parametrize("L,S", [(64, 64), (8, 96)], ids=["forward", "decode"])
def test_lse_and_max_scores_against_torch(L, S):
    """lse against torch's eager flex_attention, max_scores against torch's definition, both
    against float64; 8 queries run the decoding kernel."""
    offset = S - L
    q, k, v, slopes = make_inputs(L, S, torch.float32, seed_of("stats", L, S))

    def mask_mod(b, h, q_idx, kv_idx):
        return causal_gapped(b, h, q_idx + offset, kv_idx)

    alibi = alibi_of(slopes, offset)
    bm = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=bm,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    gold_lse, gold_max = golden_stats(q, k, slopes, causal_gapped, offset)
    assert torch.equal(torch.isinf(aux.lse), torch.isinf(gold_lse)) and torch.isinf(gold_lse).any()
    assert torch.equal(aux.max_scores == -math.inf, gold_max == -math.inf)

    torch_bm = torch_flex.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that eager flex_attention is unfused
        _, torch_aux = torch_flex.flex_attention(q, k, v, score_mod=alibi, block_mask=torch_bm,
                                                 return_aux=AuxRequest(lse=True))
    from torch._higher_order_ops.flex_attention import math_attention

    _, _, torch_max2 = math_attention(q, k, v, alibi, torch_bm.as_tuple(), 1 / math.sqrt(D), {})
    torch_max = torch_max2 * math.log(2.0)  # torch's kernels keep it in log2 units until returned
    assert_close_to_reference(aux.lse, gold_lse, torch_aux.lse, name="lse")
    assert_close_to_reference(aux.max_scores, gold_max, torch_max, name="max_scores")


@pytest.mark.parametrize("L,S", [(64, 64), (8, 96)], ids=["forward", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lse_gradients(L, S, dtype):
    """d/dq, dk, dv and d/d(captured slopes) of (out * g).sum() + (lse * h).sum(), against the
    float64 reference's autograd."""
    offset = S - L
    q, k, v, slopes = make_inputs(L, S, dtype, seed_of("grad", L, S, dtype), requires_grad=True)
    g = torch.Generator().manual_seed(seed_of("weights", L, S))
    w_out = torch.randn(2, H, L, D, generator=g, dtype=torch.float64)
    w_lse = torch.randn(2, H, L, generator=g, dtype=torch.float64)

    def mask_mod(b, h, q_idx, kv_idx):
        return causal_gapped(b, h, q_idx + offset, kv_idx)

    bm = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)

    def grads(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        qq, kk, vv, ss = leaves
        out, lse = fn(qq, kk, vv, alibi_of(ss, offset))
        lse = torch.where(torch.isinf(lse), 0.0, lse)  # rows without keys: no gradient
        loss = (out.double() * w_out).sum() + (lse.double() * w_lse).sum()
        loss.backward()
        return [t.grad for t in leaves]

    def ours(qq, kk, vv, mod):
        out, aux = flex_attention(qq, kk, vv, score_mod=mod, block_mask=bm,
                                  return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def reference(upcast):
        def run(qq, kk, vv, mod):
            return flex_attention_reference(qq, kk, vv, score_mod=mod, block_mask=bm, return_lse=True,
                                            upcast=upcast)
        return run

    got = grads(ours, q, k, v, slopes)
    golden = grads(reference(True), *(t.double() for t in (q, k, v, slopes)))
    base = grads(reference(False), q, k, v, slopes)  # torch's ops in the same dtype
    for name, a, gold, b in zip(("dq", "dk", "dv", "dslopes"), got, golden, base):
        assert a.dtype == dtype
        assert_close_to_reference(a, gold, b, name=name, metric="rel_fro")
    assert got[3].abs().sum() > 0


def test_lse_alone_carries_the_gradient():
    """A loss of lse only (out unused): the backward runs with no output gradient."""
    q, k, v, slopes = make_inputs(64, 64, torch.float32, 7, requires_grad=True)
    bm = create_block_mask(causal_gapped, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    _, aux = flex_attention(q, k, v, score_mod=alibi_of(slopes, 0), block_mask=bm,
                            return_aux=AuxRequest(lse=True, max_scores=True))
    assert aux.lse.requires_grad and not aux.max_scores.requires_grad
    torch.where(torch.isinf(aux.lse), 0.0, aux.lse).sum().backward()
    qd, kd, vd, sd = (t.detach().double().requires_grad_() for t in (q, k, v, slopes))
    _, lse = flex_attention_reference(qd, kd, vd, score_mod=alibi_of(sd, 0), block_mask=bm,
                                      return_lse=True)
    torch.where(torch.isinf(lse), 0.0, lse).sum().backward()
    assert v.grad.abs().max() == 0  # lse does not depend on v
    for ours, gold in ((q.grad, qd.grad), (k.grad, kd.grad), (slopes.grad, sd.grad)):
        torch.testing.assert_close(ours.double(), gold, rtol=1e-4, atol=1e-5)


def test_lse_gradcheck_in_float64():
    """torch.autograd.gradcheck of lse (float64 kernels) with respect to a captured tensor."""
    q, k, v, slopes = make_inputs(32, 32, torch.float64, 11)
    bm = create_block_mask(causal_gapped, None, None, 32, 32, device="cpu", BLOCK_SIZE=32)

    def lse_of(s):
        _, aux = flex_attention(q, k, v, score_mod=alibi_of(s, 0), block_mask=bm,
                                return_aux=AuxRequest(lse=True))
        return torch.where(torch.isinf(aux.lse), 0.0, aux.lse)

    # fast_mode: one vector-Jacobian product against a finite difference along a random direction.
    assert torch.autograd.gradcheck(lse_of, (slopes.detach().requires_grad_(),), eps=1e-6, atol=1e-8,
                                    fast_mode=True)
