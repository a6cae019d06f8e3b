"""Learnable attention sinks (``flex_attention(..., sinks=)``): forward, lse and every gradient
(q, k, v, the sinks, a captured score_mod tensor) against the float64 reference's autograd, with
tolerances relative to torch's own error in the same dtype; fully masked rows, GQA, decode, a paged
cache, the deterministic sink gradient, torch.compile, bad inputs, and torch's flex_attention with
the LSE renormalisation that users apply today.

The reference implements sinks independently (one more softmax column). Eager calls of the forward
kernels (the Triton template here, under the interpreter; the Gluon forwards on a Hopper GPU) take
the sink into their epilogue, with the sink's gradient from the backward's row deltas, eagerly and
under torch.compile (flexcore's ops); eager decode and learnable-sink FP8 calls apply them after the
kernels (flexcore.sinks.apply_sinks).
Agreement checks the derivation as well as the kernels.
"""
from __future__ import annotations

import logging
import math
import zlib

import pytest
import torch

from flexcore import AuxRequest, KernelOptions, create_block_mask, flex_attention
from flexcore.errors import InputError
from flexcore.reference import flex_attention_reference
from flexcore.sinks import apply_sinks
from flexcore.testing import assert_close_to_reference
from tests.flexcore.helpers import needs_hopper
from tests.flexcore.policies import policy_options

ATOL = {torch.float64: 1e-10, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_sinks(H: int, gen, dtype=torch.float32, device="cpu", center: float = 3.0):
    # Centred near a row's typical lse (by default the log of ~20 keys), so that the sink takes a
    # large share of some rows and little of others: both terms of its gradient matter.
    return (center + 2.0 * torch.randn(H, generator=gen)).to(device, dtype).requires_grad_()


def alibi_factory(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return alibi


def check_against_reference(B, Hq, Hkv, L, S, D, dtype, mask_mod, block, seed, *, device="cpu",
                            sink_dtype=torch.float32, alibi=True, kernel_options=None, what="",
                            sink_center: float = 3.0, value_mean: float = 0.0):
    """One forward+backward with sinks (and, with ``alibi``, a learnable ALiBi slope: a captured
    tensor's gradient) through flex_attention; out, lse and the gradients of q, k, v, sinks (and
    slopes) against the float64 golden, within twice torch's own error (the reference in
    ``dtype``). ``value_mean``: added to every value. Returns (out, lse, grads) for more checks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype).requires_grad_()
    v = (value_mean + torch.randn(B, Hkv, S, D, generator=gen)).to(device, dtype).requires_grad_()
    sinks = make_sinks(Hq, gen, sink_dtype, device, sink_center)
    slopes = (0.1 * torch.rand(Hq, generator=gen)).to(device).requires_grad_()
    grad_out = torch.randn(B, Hq, L, D, generator=gen).to(device, dtype)
    grad_lse = torch.randn(B, Hq, L, generator=gen).to(device)
    bm = create_block_mask(mask_mod, None, None, L, S, device=device, BLOCK_SIZE=block)
    gqa = Hq != Hkv

    def score_mod(inputs):
        return alibi_factory(inputs[4]) if alibi else None

    inputs = [q, k, v, sinks, slopes][:5 if alibi else 4]
    out, aux = flex_attention(q, k, v, score_mod=score_mod(inputs), block_mask=bm, enable_gqa=gqa,
                              return_aux=AuxRequest(lse=True), sinks=sinks, kernel_options=kernel_options)
    ours = [out, aux.lse, *torch.autograd.grad((out * grad_out).sum() + (aux.lse * grad_lse).sum(), inputs)]

    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    gold, gold_lse = flex_attention_reference(*inputs64[:3], score_mod=score_mod(inputs64),
                                              block_mask=bm, enable_gqa=gqa, return_lse=True,
                                              sinks=inputs64[3], upcast=True)
    golden = [gold, gold_lse, *torch.autograd.grad(
        (gold * grad_out.double()).sum() + (gold_lse * grad_lse.double()).sum(), inputs64)]

    base, base_lse = flex_attention_reference(q, k, v, score_mod=score_mod(inputs), block_mask=bm,
                                              enable_gqa=gqa, return_lse=True, sinks=sinks, upcast=False)
    baseline = [base, base_lse, *torch.autograd.grad(
        (base * grad_out).sum() + (base_lse * grad_lse.to(base_lse.dtype)).sum(), inputs)]

    names = ["out", "lse", "dq", "dk", "dv", "dsinks", "dslopes"]
    for name, a, g, b in zip(names, ours, golden, baseline):
        assert a.shape == g.shape, f"{what}: {name} shape {tuple(a.shape)} vs {tuple(g.shape)}"
        assert torch.isfinite(a).all(), f"{what}: {name} has NaN/inf"
        assert_close_to_reference(a, g, b, metric="rel_fro", atol=ATOL[a.dtype] if a.dtype in ATOL else 1e-6,
                                  name=f"{what}: {name}")
    assert ours[0].dtype == dtype and ours[5].dtype == sink_dtype

    # The sinks change the result: the same call without them is far from the golden.
    without = flex_attention_reference(*inputs64[:3], score_mod=score_mod(inputs64), block_mask=bm,
                                       enable_gqa=gqa, upcast=True)
    assert (without - gold).norm() > 0.05 * gold.norm(), f"{what}: the sinks barely move the output"
    return ours, bm, sinks


def causal_with_a_masked_row(row):
    def causal_gap(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx != row)
    return causal_gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["fp32", "bf16", "fp64"])
def test_forward_backward_against_float64_with_a_fully_masked_row(dtype):
    """Causal mask with one query row that keeps no key, ALiBi with learnable slopes; 97 is not a
    multiple of the 32-wide blocks (a ragged last block). The masked row gets output 0 and lse
    equal to its head's sink (the sink alone gets the weight)."""
    row = 40
    ours, _, sinks = check_against_reference(2, 2, 2, 97, 97, 32, dtype, causal_with_a_masked_row(row), 32,
                                             seed_of("sinks", dtype), what=str(dtype))
    out, lse = ours[0], ours[1]
    assert torch.equal(out[:, :, row], torch.zeros_like(out[:, :, row]))
    expected = sinks.detach().to(lse.dtype).view(1, -1).expand(out.shape[0], -1)
    assert torch.equal(lse[:, :, row], expected), (lse[:, :, row], expected)
    assert (out[:, :, row + 1].abs().sum() > 0)


def test_gqa_sliding_window_bf16_sinks():
    """Grouped-query heads (4 query heads on 2 key/value heads) with a sliding window and sinks
    stored in bfloat16 (as gpt-oss ships them): the gradient comes back in the sinks' dtype."""
    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 24)

    check_against_reference(1, 4, 2, 128, 128, 16, torch.bfloat16, window, 64, seed_of("gqa"),
                            sink_dtype=torch.bfloat16, what="gqa")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode(dtype):
    """A decoding-length query (8 rows, the decode kernel's forward) over a longer cache, GQA."""
    L, S = 8, 150

    def cache_causal(b, h, q_idx, kv_idx):
        return q_idx + (S - L) >= kv_idx

    check_against_reference(2, 4, 2, L, S, 32, dtype, cache_causal, 32, seed_of("decode", dtype),
                            what=f"decode/{dtype}")


@pytest.mark.parametrize("case", ["dense", "gqa_window"])
def test_sink_gradient_reads_no_rounded_output(case):
    """bf16 without a captured tensor: the sinks' gradient, -sum over rows of p_sink * delta, adds
    up each row's delta over hundreds of rows. delta = rowsum(dO * O) read from the bf16 output
    carries one rounding of O per row, large beside torch's where the values share a mean (O is
    then large while each key's dP rounds on its own and averages out); the backward takes delta
    from its own probabilities, rowsum(P * dP), where the sinks learn. Sinks near log(S) take a
    sizeable share of the rows; the window case has 4 query heads on 2 key/value heads."""
    Hkv, mask_mod = {"dense": (4, lambda b, h, q_idx, kv_idx: q_idx >= 0),
                     "gqa_window": (2, _window(128))}[case]
    check_against_reference(2, 4, Hkv, 256, 256, 16, torch.bfloat16, mask_mod, 64, seed_of("rounded-out", case),
                            alibi=False, what=f"rounded-out/{case}", sink_center=math.log(256), value_mean=1.0)


@pytest.mark.parametrize("L", [1, 8, 16])
def test_sink_gradient_at_decoding_lengths(L):
    """Learning sinks at decoding lengths (the decode kernel's range) take the forward kernel, whose
    epilogue takes the sinks in: the decode kernel's sinks are applied after it (apply_sinks), and
    that gradient sums each row's rounded bf16 output (6-8x torch's bf16 error here). Values of mean
    1 and sinks near log S, as in test_sink_gradient_reads_no_rounded_output."""
    gen = torch.Generator().manual_seed(seed_of("decode-lengths", L))
    B, H, S, D = 2, 4, 128, 16
    q = torch.randn(B, H, L, D, generator=gen).bfloat16()
    k = torch.randn(B, H, S, D, generator=gen).bfloat16()
    v = (1 + torch.randn(B, H, S, D, generator=gen)).bfloat16()
    grad_out = torch.randn(B, H, L, D, generator=gen).bfloat16()
    sinks0 = make_sinks(H, gen, center=math.log(S))

    def dsinks(attention, dtype, **kwargs):
        sinks = sinks0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), sinks=sinks, **kwargs)
        return torch.autograd.grad((out * grad_out.to(out.dtype)).sum(), sinks)[0]

    golden = dsinks(flex_attention_reference, torch.float64)
    baseline = dsinks(lambda *a, **kw: flex_attention_reference(*a, upcast=False, **kw), torch.bfloat16)
    assert_close_to_reference(dsinks(flex_attention, torch.bfloat16), golden, baseline, metric="rel_fro",
                              name=f"dsinks at L={L}")


@pytest.mark.parametrize("captured_learns", [False, True], ids=["sinks", "sinks+slopes"])
def test_where_the_sinks_delta_is_summed(monkeypatch, captured_learns):
    """The exact delta that a sink's gradient reads: without a learning captured tensor the dQ
    programs sum it beside dQ (ROW_SUMS, no pass before); a captured tensor's gradient reads it
    in dS, so then the PHASE 3 pass computes it first. Both match the float64 reference."""
    from flexcore.kernels import backward as bwd

    launched, real_launch = [], bwd.launch

    def spy(kernel, grid, args, bm, bn, meta, constexprs, **kw):
        if "PHASE" in constexprs:
            launched.append((constexprs["PHASE"], constexprs.get("ROW_SUMS", 0)))
        return real_launch(kernel, grid, args, bm, bn, meta, constexprs, **kw)

    monkeypatch.setattr(bwd, "launch", spy)
    gen = torch.Generator().manual_seed(seed_of("sinks-delta", captured_learns))
    B, H, L, D = 2, 2, 128, 16
    q, k = (torch.randn(B, H, L, D, generator=gen, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    v = (1.0 + torch.randn(B, H, L, D, generator=gen)).to(torch.bfloat16).requires_grad_()
    sinks = make_sinks(H, gen, center=math.log(L))
    slopes = (0.1 * torch.rand(H, generator=gen)).requires_grad_(captured_learns)
    g = torch.randn(B, H, L, D, generator=gen, dtype=torch.bfloat16)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L, device="cpu",
                           BLOCK_SIZE=32)
    out = flex_attention(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm, sinks=sinks)
    (dsinks,) = torch.autograd.grad((out * g).sum(), [sinks])
    sinks64 = sinks.detach().double().requires_grad_()
    gold = flex_attention_reference(q.double(), k.double(), v.double(), score_mod=alibi_factory(slopes.double()),
                                    block_mask=bm, sinks=sinks64)
    (golden,) = torch.autograd.grad((gold * g.double()).sum(), sinks64)
    base = flex_attention_reference(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm, sinks=sinks,
                                    upcast=False)
    (baseline,) = torch.autograd.grad((base * g).sum(), sinks)
    assert_close_to_reference(dsinks, golden, baseline, metric="rel_fro", atol=1e-6, name="dsinks")
    phases = {phase for phase, _ in launched}
    if captured_learns:
        assert 3 in phases and all(sums == 0 for _, sums in launched), launched
    else:
        assert 3 not in phases and launched, launched
        assert all(sums > 0 for phase, sums in launched if phase in (0, 2)), launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinks_alone_require_grad(decided, dtype):
    """Only the sinks learn (q, k, v frozen): the forward kernel takes them in and the backward
    runs no gradient kernel, only the pass that computes the rows' delta from its probabilities
    (not the bf16 output, whose rounding the sum over rows adds up: values with a common mean);
    it matches the golden."""
    gen = torch.Generator().manual_seed(seed_of("sinks-only", dtype))
    B, H, L, D = 2, 4, 256, 16
    q, k = (torch.randn(B, H, L, D, generator=gen).to(dtype) for _ in range(2))
    v = (1.0 + torch.randn(B, H, L, D, generator=gen)).to(dtype)
    sinks = make_sinks(H, gen, center=math.log(L))
    sinks64 = sinks.detach().double().requires_grad_()
    g = torch.randn(B, H, L, D, generator=gen).to(dtype)
    out = flex_attention(q, k, v, sinks=sinks)
    (ours,) = torch.autograd.grad((out * g).sum(), sinks)
    gold = flex_attention_reference(q.double(), k.double(), v.double(), sinks=sinks64)
    (golden,) = torch.autograd.grad((gold * g.double()).sum(), sinks64)
    base = flex_attention_reference(q, k, v, sinks=sinks, upcast=False)
    (baseline,) = torch.autograd.grad((base * g).sum(), sinks)
    assert_close_to_reference(ours, golden, baseline, metric="rel_fro", atol=1e-6, name="dsinks")
    assert decided == {"forward": 1, "backward": 0}


def _dispatch_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flexcore.dispatch"]


def test_the_forward_kernel_takes_the_sinks_in(caplog):
    """An eager call of the forward kernel applies the sinks in its epilogue (the dispatch log
    says so, and the pass after the kernels gives the same up to rounding); a decoding-length
    query applies them after the decode kernel, still matching the golden."""
    from flexcore import attention

    gen = torch.Generator().manual_seed(seed_of("in-kernel"))
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    sinks = make_sinks(2, gen).detach()
    with caplog.at_level(logging.DEBUG, logger="flexcore.dispatch"):
        out, aux = flex_attention(q, k, v, sinks=sinks, return_aux=AuxRequest(lse=True))
    [line] = [m for m in _dispatch_lines(caplog) if m.startswith("forward:")]
    assert "Triton template" in line and "sinks in the epilogue" in line, line
    plain, plain_aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    after, after_lse = apply_sinks(plain, plain_aux.lse, sinks)
    torch.testing.assert_close(out, after, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux.lse, after_lse, rtol=1e-6, atol=1e-6)

    opts = KernelOptions.from_any(None)
    assert attention.sinks_in_kernel(q, opts)
    short = q[:, :, :8]
    assert not attention.sinks_in_kernel(short, opts)  # the decode kernel's length
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="flexcore.dispatch"):
        out = flex_attention(short, k, v, sinks=sinks)
    assert not any("sinks in the epilogue" in m for m in _dispatch_lines(caplog))
    gold = flex_attention_reference(short.double(), k.double(), v.double(), sinks=sinks.double())
    base = flex_attention_reference(short, k, v, sinks=sinks, upcast=False)
    assert_close_to_reference(out, gold, base, metric="rel_fro", atol=1e-6, name="decode out")


def test_row_statistics_include_the_sink():
    """The forward kernel's own outputs with sinks, in float64: row_stats keep the scores' row
    max (max_scores' source, unchanged by the sinks) with the second row such that
    exp2(s·scale·log2(e) - max) times it is each key's probability with the sink in (what the
    backward kernels recompute); out and lse are what flex_attention returns. Row 5 keeps no key."""
    from flexcore import attention
    from flexcore.kernels import forward as fwd
    from flexcore.lowering import lower_mask_mod, lower_score_mod
    from flexcore.options import KernelOptions

    attention.ready()
    gen = torch.Generator().manual_seed(seed_of("row-stats"))
    B, H, L, D = 1, 2, 64, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = make_sinks(H, gen, torch.float64).detach()
    mask_mod = causal_with_a_masked_row(5)
    bm = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    scale = 1.0 / math.sqrt(D)
    args = (q, k, v, lower_score_mod(None, torch.float64), lower_mask_mod(mask_mod),
            attention.kv_blocks(bm, B, H), scale, KernelOptions.from_any(None))
    out, lse, row_stats = fwd.forward(*args, sinks=sinks)
    _, _, plain_stats = fwd.forward(*args)
    assert torch.equal(row_stats[0], plain_stats[0])
    assert row_stats[0, 0, :, 5].eq(float("-inf")).all() and row_stats[1, 0, :, 5].eq(0).all()

    rows = torch.arange(L).view(-1, 1)
    keep = (rows >= torch.arange(L).view(1, -1)) & (rows != 5)
    scores = torch.where(keep, q @ k.transpose(-1, -2) * scale, float("-inf"))
    m = torch.where(torch.isinf(row_stats[0]), 0.0, row_stats[0]).unsqueeze(-1)
    probs = torch.exp2(scores / math.log(2) - m) * row_stats[1].unsqueeze(-1)
    columns = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
    expected = torch.softmax(columns, dim=-1)[..., :L]
    torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-14)

    got, aux = flex_attention(q, k, v, block_mask=bm, sinks=sinks, return_aux=AuxRequest(lse=True))
    assert torch.equal(got, out) and torch.equal(aux.lse, lse)
    assert torch.equal(lse[:, :, 5], sinks.view(1, H).expand(B, H)) and out[:, :, 5].eq(0).all()


@pytest.mark.filterwarnings("ignore:return_lse is deprecated")
def test_lse_gradient_alone_with_sinks():
    """A loss of the lse only (no gradient reaches out: the backward fills a zero dO), through the
    deprecated return_lse, with sinks in the kernel: q, k and the sinks' gradients against the
    golden. A row without a kept key has lse = sink, so its lse's gradient goes to the sink whole."""
    gen = torch.Generator().manual_seed(seed_of("lse-only"))
    B, H, L, D = 1, 2, 80, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
    sinks = make_sinks(H, gen)
    g = torch.randn(B, H, L, generator=gen)
    bm = create_block_mask(causal_with_a_masked_row(33), None, None, L, L, device="cpu", BLOCK_SIZE=32)
    _, lse = flex_attention(q, k, v, block_mask=bm, sinks=sinks, return_lse=True)
    inputs = [q, k, sinks]
    ours = torch.autograd.grad((lse * g).sum(), inputs)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    _, gold_lse = flex_attention_reference(inputs64[0], inputs64[1], v.detach().double(), block_mask=bm,
                                           sinks=inputs64[2], return_lse=True)
    golden = torch.autograd.grad((gold_lse * g.double()).sum(), inputs64)
    _, base_lse = flex_attention_reference(q, k, v, block_mask=bm, sinks=sinks, return_lse=True, upcast=False)
    baseline = torch.autograd.grad((base_lse * g).sum(), inputs)
    for name, a, gold, base in zip(["dq", "dk", "dsinks"], ours, golden, baseline):
        assert_close_to_reference(a, gold, base, metric="rel_fro", atol=1e-6, name=f"lse-only {name}")


def test_plans_take_each_calls_sinks(decided):
    """Repeated calls of one shape run the kept plan with each call's sinks (their values are
    read at every call, never kept); a call without sinks, or with sinks of another dtype, takes
    a plan of its own. Each result against the golden."""
    gen = torch.Generator().manual_seed(seed_of("plans"))
    B, H, L, D = 1, 2, 64, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L, device="cpu",
                           BLOCK_SIZE=32)
    first, second = make_sinks(H, gen).detach(), make_sinks(H, gen).detach()
    calls = [(first, 1), (second, 0), (None, 1), (second.to(torch.bfloat16), 1), (first, 0)]
    for sinks, decides in calls:
        before = decided["forward"]
        out = flex_attention(q, k, v, block_mask=bm, sinks=sinks)
        assert decided["forward"] - before == decides, (sinks, decided)
        s64 = None if sinks is None else sinks.double()
        gold = flex_attention_reference(q.double(), k.double(), v.double(), block_mask=bm, sinks=s64)
        base = flex_attention_reference(q, k, v, block_mask=bm, sinks=sinks, upcast=False)
        assert_close_to_reference(out, gold, base, metric="rel_fro", atol=1e-6, name=f"plan out {sinks}")


def test_deterministic_sink_gradient(monkeypatch):
    """KernelOptions(deterministic=True): the backward's launches take the fixed-point sums of the
    captured tensor's gradient, and two backward passes give bit-identical gradients of the sinks
    (a torch reduction over rows) and of q, k, v and a captured tensor. The interpreter runs
    atomics in order, so the bit-identity alone cannot fail here: the GPU test checks it there."""
    from flexcore.kernels import backward as bwd

    fixed_point, real_launch = [], bwd.launch

    def spy(kernel, grid, args, bm, bn, meta, constexprs, **kw):
        if "PHASE" in constexprs:
            fixed_point.append(constexprs["FIXED_POINT_GRADS"])
        return real_launch(kernel, grid, args, bm, bn, meta, constexprs, **kw)

    monkeypatch.setattr(bwd, "launch", spy)
    gen = torch.Generator().manual_seed(seed_of("deterministic"))
    B, H, L, D = 2, 2, 96, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
    sinks = make_sinks(H, gen)
    slopes = (0.1 * torch.rand(H, generator=gen)).requires_grad_()
    g = torch.randn(B, H, L, D, generator=gen)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L, device="cpu",
                           BLOCK_SIZE=32)
    opts = KernelOptions(deterministic=True)

    def grads():
        out = flex_attention(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm, kernel_options=opts,
                             sinks=sinks)
        return torch.autograd.grad((out * g).sum(), [q, k, v, sinks, slopes])

    first, second = grads(), grads()
    for name, a, b in zip(["dq", "dk", "dv", "dsinks", "dslopes"], first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    assert first[3].abs().min() > 0
    assert fixed_point and all(fixed_point), fixed_point


def test_forced_gluon_backward_rule_for_learning_sinks(monkeypatch):
    """Where the Gluon backward could take a call (hopper.backward_may_apply, patched here to say so)
    and the policy forces it, sinks that learn alone are refused with what would serve them (the
    pass that gives their delta has no Gluon kernel); with q, k and v learning too the Gluon
    kernels are asked (their dQ kernel sums the delta). On the GPU:
    test_forced_gluon_backward_with_learning_sinks."""
    from flexcore.kernels import hopper

    gen = torch.Generator().manual_seed(seed_of("forced-gluon-rule"))
    B, H, L, D = 1, 2, 64, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    sinks = make_sinks(H, gen)
    opts = policy_options(gluon={"backward": "on"})
    monkeypatch.setattr(hopper, "backward_may_apply", lambda q, opts: opts.dispatch.gluon.backward != "off")
    asked = []

    def applies(*args):  # the rest of its rule: not here (the call then takes the template)
        asked.append(True)
        return False

    monkeypatch.setattr(hopper, "applies_backward", applies)
    lq, ls = (t.detach().requires_grad_() for t in (q, sinks))
    out = flex_attention(lq, k, v, sinks=ls, kernel_options=opts)
    torch.autograd.grad(out.sum(), [lq, ls])
    assert asked
    ls = sinks.detach().requires_grad_()
    out = flex_attention(q, k, v, sinks=ls, kernel_options=opts)
    with pytest.raises(InputError, match="only the sinks want a gradient.*exact_delta"):
        torch.autograd.grad(out.sum(), [ls])


def test_paged_decode_with_sinks():
    """Decoding from a paged cache (flexcore.paged): the sinks apply to the paged call exactly as
    to the contiguous one, and both match the golden."""
    from flexcore.decoding import offset_mask_mod
    from flexcore.paged import PagedAttention

    gen = torch.Generator().manual_seed(seed_of("paged"))
    page, Hq, Hkv, D, L = 32, 4, 2, 16, 2
    lengths, slots = [70, 45], [1, 0]
    B, S = len(lengths), max(lengths)
    paged = PagedAttention(n_pages=8, page_size=page, max_batch_size=2, device="cpu")
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    k_cache = torch.zeros(1, Hkv, 8 * page, D)
    v_cache = torch.zeros(1, Hkv, 8 * page, D)
    for i, (n, slot) in enumerate(zip(lengths, slots)):
        paged.reserve(torch.tensor(slot), torch.tensor(n))
        paged.assign(torch.tensor([slot]), torch.arange(n)[None], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                     k_cache, v_cache)
    q = torch.randn(B, Hq, L, D, generator=gen)
    sinks = make_sinks(Hq, gen).detach()
    offset = torch.tensor([n - L for n in lengths])
    kv_len = torch.tensor(lengths)

    def causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx < kv_len[b])

    logical = create_block_mask(offset_mask_mod(causal, offset), B, None, L, S, device="cpu",
                                BLOCK_SIZE=(16, page))
    out, aux = flex_attention(q, k, v, block_mask=logical, enable_gqa=True, sinks=sinks,
                              return_aux=AuxRequest(lse=True))
    lse = aux.lse
    physical = paged.convert_logical_block_mask(logical, batch_idx=torch.tensor(slots))
    paged_out, paged_aux = flex_attention(q, k_cache, v_cache, block_mask=physical, enable_gqa=True,
                                          sinks=sinks, return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(paged_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(paged_aux.lse, lse, rtol=1e-5, atol=1e-5)
    gold, gold_lse = flex_attention_reference(q.double(), k.double(), v.double(), block_mask=logical,
                                              enable_gqa=True, return_lse=True, sinks=sinks.double())
    base = flex_attention_reference(q, k, v, block_mask=logical, enable_gqa=True, sinks=sinks, upcast=False)
    assert_close_to_reference(paged_out, gold, base, metric="rel_fro", atol=1e-6, name="paged out")
    torch.testing.assert_close(paged_aux.lse.double(), gold_lse, rtol=1e-5, atol=1e-5)


@pytest.fixture
def sink_paths(monkeypatch):
    """Counts of where a call's sinks go: ``post_pass`` calls of flexcore.sinks.apply_sinks (the
    pass after the kernels), ``forward_sinks`` forward-kernel calls given sinks, ``delta`` backward
    kernel calls returning the rows' delta, ``kernels`` backward kernel calls, ``row_deltas`` calls
    of the delta-only pass."""
    from flexcore import attention, sinks as sinks_module

    counts = dict.fromkeys(["post_pass", "forward_sinks", "delta", "kernels", "row_deltas"], 0)

    def counting(real, name, key=None):
        def wrapped(*args, **kwargs):
            if key is None or kwargs.get(key) is not None and kwargs.get(key) is not False:
                counts[name] += 1
            return real(*args, **kwargs)
        return wrapped

    post_pass = counting(apply_sinks, "post_pass")
    monkeypatch.setattr(sinks_module, "apply_sinks", post_pass)
    monkeypatch.setattr(attention, "apply_sinks", post_pass)
    monkeypatch.setattr(attention, "forward_kernels",
                        counting(attention.forward_kernels, "forward_sinks", "sinks"))
    real_backward = attention.backward_kernels
    monkeypatch.setattr(attention, "backward_kernels", counting(
        counting(real_backward, "delta", "return_delta"), "kernels"))
    monkeypatch.setattr(attention, "row_delta_kernels",
                        counting(attention.row_delta_kernels, "row_deltas"))
    return counts


# (dtype, Hq, Hkv): bf16 with grouped heads, where the sinks' gradient is hardest to get right, and
# float64, which must stay exact; the inductor test runs the plain bf16 case. Each compiles for ~15 s.
COMPILED_CASES = {"bf16": (torch.bfloat16, 4, 4), "fp64": (torch.float64, 4, 4),
                  "bf16-gqa": (torch.bfloat16, 4, 2)}


def _compiled_sinks_case(case, backend="aot_eager"):
    """(compiled run, eager run, golden, baseline, names, sinks) of a causal call with learnable
    sinks and a learnable ALiBi slope (a captured tensor's gradient) returning its lse: values of
    mean 1 and sinks near log S, where the sinks' gradient is hardest to get right (a sum over
    every row)."""
    dtype, Hq, Hkv = COMPILED_CASES[case]
    gen = torch.Generator().manual_seed(seed_of("compiled-sinks", case, backend))
    B, L, D = 2, 128, 16
    q = torch.randn(B, Hq, L, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype).requires_grad_()
    v = (1.0 + torch.randn(B, Hkv, L, D, generator=gen)).to(dtype).requires_grad_()
    sinks = make_sinks(Hq, gen, center=math.log(L))
    slopes = (0.1 * torch.rand(Hq, generator=gen)).requires_grad_()
    g = torch.randn(B, Hq, L, D, generator=gen).to(dtype)
    g_lse = torch.randn(B, Hq, L, generator=gen).to(torch.float64 if dtype == torch.float64 else torch.float32)
    bm = create_block_mask(causal_with_a_masked_row(9), None, None, L, L, device="cpu", BLOCK_SIZE=32)
    inputs = [q, k, v, sinks, slopes]

    def call(attend, q, k, v, sinks, slopes, **kw):
        out, lse = attend(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm,
                          enable_gqa=Hq != Hkv, sinks=sinks, **kw)
        return [out, lse, *torch.autograd.grad((out * g.to(out.dtype)).sum()
                                               + (lse * g_lse.to(lse.dtype)).sum(), [q, k, v, sinks, slopes])]

    def fn(q, k, v, sinks, slopes):
        out, aux = flex_attention(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm,
                                  enable_gqa=Hq != Hkv, sinks=sinks, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def run(f):
        out, lse = f(*inputs)
        return [out.detach(), lse.detach(), *torch.autograd.grad(
            (out * g).sum() + (lse * g_lse).sum(), inputs)]

    torch._dynamo.reset()
    compiled = run(torch.compile(fn, fullgraph=True, backend=backend))
    eager = run(fn)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    golden = call(lambda *a, **kw: flex_attention_reference(*a, **kw, return_lse=True, upcast=True),
                  *inputs64)
    baseline = call(lambda *a, **kw: flex_attention_reference(*a, **kw, return_lse=True, upcast=False),
                    *inputs)
    return compiled, eager, golden, baseline, ["out", "lse", "dq", "dk", "dv", "dsinks", "dslopes"], sinks


@pytest.mark.parametrize("case", ["fp64", "bf16-gqa"])
def test_compiled_sinks_go_through_the_forward_op(case, sink_paths):
    """Under torch.compile (fullgraph, aot_eager) flexcore's forward op takes the sinks into the
    forward kernel's epilogue and its backward op gives their gradient from the rows' delta, as an
    eager call does: no pass after the kernels runs, every result is within torch's own error of
    the float64 golden (the sinks' gradient included: values of mean 1, sinks near log S), and
    equal bit for bit to the eager call's (the same kernels on the same inputs)."""
    compiled, eager, golden, baseline, names, sinks = _compiled_sinks_case(case)
    assert sink_paths["post_pass"] == 0
    assert sink_paths["forward_sinks"] == 2 and sink_paths["delta"] == 2  # compiled, then eager
    for name, a, b, gold, base in zip(names, compiled, eager, golden, baseline):
        assert_close_to_reference(a, gold, base, metric="rel_fro", atol=ATOL.get(a.dtype, 1e-6),
                                  name=f"compiled {case}: {name}")
        assert torch.equal(a, b), f"compiled {case}: {name} differs from the eager call's"
    # Row 9 keeps no key: its lse is the sink.
    assert torch.equal(compiled[1][:, :, 9], sinks.detach().view(1, -1).expand(2, -1))


def test_compiled_sinks_without_graph_breaks():
    """A call with sinks traces in one graph."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("compiled-explain"))
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen).requires_grad_() for _ in range(3))
    sinks = make_sinks(2, gen)
    assert torch._dynamo.explain(lambda q, k, v, s: flex_attention(q, k, v, sinks=s))(
        q, k, v, sinks).graph_break_count == 0


def test_compiled_sinks_inductor():
    """The default backend (Inductor) on the CPU: the same results as the eager call, bit for bit
    (the op runs the same kernels on the same inputs; the loss is outside the compiled region)."""
    compiled, eager, golden, baseline, names, _ = _compiled_sinks_case("bf16", backend="inductor")
    for name, a, b, gold, base in zip(names, compiled, eager, golden, baseline):
        assert_close_to_reference(a, gold, base, metric="rel_fro", atol=ATOL.get(a.dtype, 1e-6),
                                  name=f"inductor: {name}")
        assert torch.equal(a, b), f"inductor: {name} differs from the eager call's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_sinks_alone_require_grad(dtype, sink_paths):
    """Only the sinks learn (q, k, v frozen) under torch.compile: the backward runs no gradient
    kernel, only the delta pass (flexcore's sink backward op), and matches the golden and the
    eager call."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("compiled-sinks-only", dtype))
    B, H, L, D = 2, 4, 128, 16
    q, k = (torch.randn(B, H, L, D, generator=gen).to(dtype) for _ in range(2))
    v = (1.0 + torch.randn(B, H, L, D, generator=gen)).to(dtype)
    sinks = make_sinks(H, gen, center=math.log(L))
    g = torch.randn(B, H, L, D, generator=gen).to(dtype)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L, device="cpu",
                           BLOCK_SIZE=32)

    def fn(q, k, v, sinks):
        return flex_attention(q, k, v, block_mask=bm, sinks=sinks)

    def run(f):
        out = f(q, k, v, sinks)
        return [out.detach(), *torch.autograd.grad((out * g).sum(), sinks)]

    got = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    assert sink_paths == {"post_pass": 0, "forward_sinks": 1, "delta": 0, "kernels": 0, "row_deltas": 1}
    eager = run(fn)
    sinks64 = sinks.detach().double().requires_grad_()
    gold = flex_attention_reference(q.double(), k.double(), v.double(), block_mask=bm, sinks=sinks64)
    golden = [gold.detach(), *torch.autograd.grad((gold * g.double()).sum(), sinks64)]
    base = flex_attention_reference(q, k, v, block_mask=bm, sinks=sinks, upcast=False)
    baseline = [base.detach(), *torch.autograd.grad((base * g).sum(), sinks)]
    for name, a, b, gd, bs in zip(["out", "dsinks"], got, eager, golden, baseline):
        assert_close_to_reference(a, gd, bs, metric="rel_fro", atol=1e-6, name=f"compiled {name}")
        assert torch.equal(a, b), f"compiled {name} differs from the eager call's"


def test_compiled_decode_with_sinks(sink_paths):
    """A decoding-length query under torch.compile: the decode kernel takes no sinks, so
    flexcore's forward op applies them to its (out, lse) and derives the row statistics from the
    lse with the sink in; the backward kernels then give q, k, v and the sinks their gradients.
    Out and lse are the eager call's (which applies them after the kernel, the same formula);
    everything is within torch's own error of the float64 golden, with return_aux's max_scores."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("compiled-decode"))
    B, H, L, S, D = 2, 4, 8, 128, 16
    q = torch.randn(B, H, L, D, generator=gen).requires_grad_()
    k, v = (torch.randn(B, 2, S, D, generator=gen).requires_grad_() for _ in range(2))
    sinks = make_sinks(H, gen, center=math.log(S))
    g = torch.randn(B, H, L, D, generator=gen)
    g_lse = torch.randn(B, H, L, generator=gen)
    inputs = [q, k, v, sinks]

    def fn(q, k, v, sinks):
        out, aux = flex_attention(q, k, v, enable_gqa=True, sinks=sinks,
                                  return_aux=AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    def run(f):
        out, lse, max_scores = f(*inputs)
        return [out.detach(), lse.detach(), max_scores, *torch.autograd.grad(
            (out * g).sum() + (lse * g_lse).sum(), inputs)]

    got = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    assert sink_paths["forward_sinks"] == 0 and sink_paths["delta"] == 1
    eager = run(fn)
    # The eager call of learning sinks takes the forward kernel (the sinks in its epilogue), the
    # compiled one the decode kernel with the formula in its op: equal within float32 rounding.
    for name, a, b in zip(["out", "lse", "max_scores"], got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"compiled decode {name}")
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    gold, gold_lse = flex_attention_reference(*inputs64[:3], enable_gqa=True, sinks=inputs64[3],
                                              return_lse=True, upcast=True)
    golden = [gold, gold_lse, *torch.autograd.grad((gold * g.double()).sum() + (gold_lse * g_lse.double()).sum(),
                                                   inputs64)]
    base, base_lse = flex_attention_reference(*inputs[:3], enable_gqa=True, sinks=sinks, return_lse=True,
                                              upcast=False)
    baseline = [base, base_lse, *torch.autograd.grad((base * g).sum() + (base_lse * g_lse).sum(), inputs)]
    for name, a, gd, bs in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got[:2] + got[3:], golden, baseline):
        assert_close_to_reference(a, gd, bs, metric="rel_fro", atol=1e-6, name=f"compiled decode {name}")
    scores = (q.detach().double() @ k.detach().double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(D)
    torch.testing.assert_close(got[2].double(), scores.amax(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_torch_flex_with_lse_renormalisation_gives_the_same():
    """What users of torch's flex_attention do today: run without sinks, take the lse, and
    renormalise out by exp(lse - logaddexp(lse, sink)). torch's eager flex_attention on the CPU
    with that correction agrees with flexcore's sinks."""
    from torch.nn.attention.flex_attention import AuxRequest as TorchAuxRequest
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    gen = torch.Generator().manual_seed(seed_of("torch"))
    B, H, L, D = 1, 2, 80, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
    sinks = make_sinks(H, gen).detach()
    slopes = 0.1 * torch.rand(H, generator=gen)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 20)

    torch_bm = torch_create_block_mask(window, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    t_out, t_aux = torch_flex_attention(q, k, v, score_mod=alibi_factory(slopes), block_mask=torch_bm,
                                        return_aux=TorchAuxRequest(lse=True))
    lse_sink = torch.logaddexp(t_aux.lse, sinks.view(1, H, 1))
    t_out = t_out * torch.exp(t_aux.lse - lse_sink).unsqueeze(-1)

    bm = create_block_mask(window, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    out, aux = flex_attention(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm, sinks=sinks,
                              return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(out, t_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.lse, lse_sink, rtol=1e-5, atol=1e-5)
    gold = flex_attention_reference(q.double(), k.double(), v.double(), score_mod=alibi_factory(slopes.double()),
                                    block_mask=bm, sinks=sinks.double())
    torch.testing.assert_close(out.double(), gold, rtol=1e-4, atol=1e-5)


def test_max_scores_stay_the_scores_max():
    """max_scores is each row's largest score, as without sinks (torch's meaning); only the
    lse takes the sink in."""
    gen = torch.Generator().manual_seed(seed_of("max"))
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(3))
    sinks = make_sinks(2, gen).detach()
    _, plain = flex_attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=True))
    _, with_sinks = flex_attention(q, k, v, sinks=sinks, return_aux=AuxRequest(lse=True, max_scores=True))
    torch.testing.assert_close(with_sinks.max_scores, plain.max_scores, rtol=0, atol=0)
    torch.testing.assert_close(with_sinks.lse, torch.logaddexp(plain.lse, sinks.view(1, 2, 1)))


@pytest.mark.parametrize("sinks, words", [
    (torch.zeros(3), ["sinks", "shape (3,)", "(2,)", "query head"]),
    (torch.zeros(1, 2), ["sinks", "shape (1, 2)", "(2,)"]),
    (torch.zeros(()), ["sinks", "shape ()", "(2,)"]),
    (torch.zeros(2, dtype=torch.int64), ["sinks", "torch.int64", "float32"]),
    (torch.zeros(2, dtype=torch.bool), ["sinks", "torch.bool", "floating"]),
    (torch.zeros(2, device="meta"), ["sinks", "meta", "cpu", "sinks.to("]),
    ([0.0, 0.0], ["sinks", "torch.Tensor", "list"]),
    (torch.tensor([0.0, math.inf]), ["sinks", "non-finite", "finite logit"]),
    (torch.tensor([0.0, math.nan]), ["sinks", "non-finite"]),
], ids=["too_long", "two_dims", "scalar", "int", "bool", "other_device", "list", "inf", "nan"])
def test_bad_sinks_are_refused_naming_them(sinks, words):
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    with pytest.raises(InputError) as info:
        flex_attention(q, k, v, sinks=sinks)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    if "non-finite" not in words:  # the reference refuses the same (it accepts any finite value)
        with pytest.raises(InputError, match="sinks"):
            flex_attention_reference(q, k, v, sinks=sinks)


def test_non_finite_sinks_are_refused_under_torch_compile_on_the_cpu():
    """The compiled call checks CPU sinks in its op, as an eager call does (the check reads
    values, which the traced function cannot)."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v, s: flex_attention(q, k, v, sinks=s), fullgraph=True,
                             backend="aot_eager")
    compiled(q, k, v, torch.zeros(2))
    with pytest.raises(InputError, match="non-finite"):
        compiled(q, k, v, torch.tensor([0.0, math.nan]))


def test_learnable_sinks_with_a_per_head_mask_under_dynamic_shapes():
    """dynamic=True, an nn.Parameter of sinks and a mask with one row per head: the mask check
    compares symbolic sizes (it refused this call, "expected heads 1 or 2")."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("dynamic sinks"))
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, 2, 20, 20, device="cpu",
                           BLOCK_SIZE=16)
    sinks = torch.nn.Parameter(torch.randn(2, generator=gen))

    def fn(q, k, v, bm, sinks):
        return flex_attention(q, k, v, block_mask=bm, sinks=sinks)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(q, k, v, bm, sinks), fn(q, k, v, bm, sinks), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_finite_sinks_beyond_float32s_log2_range(dtype):
    """A finite sink above float32's max / log2(e) (about 2.36e38) dominates every row: output 0,
    lse = sink, as in float64 math; in log2 units it would reach inf, and inf - inf gave NaN."""
    gen = torch.Generator().manual_seed(seed_of("huge-sinks", dtype))
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen).to(dtype) for _ in range(3))
    sinks = torch.tensor([3e38, -3e38])
    out, aux = flex_attention(q, k, v, sinks=sinks, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    ref, ref_lse = flex_attention_reference(q.double(), k.double(), v.double(), sinks=sinks.double(),
                                            return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (out[:, 0] == 0).all() and (lse[:, 0] == sinks[0].to(lse.dtype)).all()
    torch.testing.assert_close(lse[:, 1].double(), ref_lse[:, 1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 1].double(), ref[:, 1], rtol=2e-2, atol=2e-2)


def test_sinks_are_keyword_only_and_refused_with_nested_tensors():
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    with pytest.raises(TypeError):
        flex_attention(q, k, v, None, None, None, False, False, None, torch.zeros(2))  # sinks by position
    nested = torch.nested.nested_tensor([torch.randn(2, 5, 16), torch.randn(2, 7, 16)], layout=torch.jagged)
    with pytest.raises(InputError, match="sinks is not supported with nested"):
        flex_attention(nested, nested, nested, sinks=torch.zeros(2))


def test_gallery_variant_gpt_oss_sinks():
    """The gallery's gpt_oss_sinks: a sliding window with learnable per-head sinks, through
    flex_attention against the float64 reference, gradients of the sinks included."""
    import variants

    mods = variants.get("gpt_oss_sinks").make(H=2, Q_LEN=97, **variants.get("gpt_oss_sinks").example)
    assert mods.sinks is not None and mods.sinks.shape == (2,) and mods.sinks.requires_grad
    gen = torch.Generator().manual_seed(seed_of("variant"))
    q, k, v = (torch.randn(1, 2, 97, 16, generator=gen) for _ in range(3))
    bm = mods.create_block_mask(BLOCK_SIZE=32)
    g = torch.randn(1, 2, 97, 16, generator=gen)
    out = flex_attention(q, k, v, block_mask=bm, sinks=mods.sinks)
    (ours,) = torch.autograd.grad((out * g).sum(), mods.sinks)
    sinks64 = mods.sinks.detach().double().requires_grad_()
    gold = flex_attention_reference(q.double(), k.double(), v.double(), block_mask=bm, sinks=sinks64)
    (golden,) = torch.autograd.grad((gold * g.double()).sum(), sinks64)
    base = flex_attention_reference(q, k, v, block_mask=bm, sinks=mods.sinks, upcast=False)
    (baseline,) = torch.autograd.grad((base * g).sum(), mods.sinks)
    assert_close_to_reference(out, gold, base.detach(), metric="rel_fro", atol=1e-6, name="variant out")
    assert_close_to_reference(ours, golden, baseline, metric="rel_fro", atol=1e-6, name="variant dsinks")


# -- GPU: the same at larger shapes (run with -m gpu on the device) ---------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _window(width):
    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < width)
    return window


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["causal_gap_1k", "gqa_window_2k", "ragged_d64"])
def test_forward_backward_gpu(case, dtype):
    B, Hq, Hkv, L, S, D, mask_mod = {
        "causal_gap_1k": (2, 4, 4, 1024, 1024, 128, causal_with_a_masked_row(300)),
        "gqa_window_2k": (1, 16, 4, 2048, 2048, 128, _window(512)),
        "ragged_d64": (1, 4, 4, 1000, 1000, 64, causal_with_a_masked_row(999)),
    }[case]
    check_against_reference(B, Hq, Hkv, L, S, D, dtype, mask_mod, 128, seed_of("gpu", case, dtype),
                            device="cuda", what=f"gpu/{case}/{dtype}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("L", [1, 16])
def test_decode_gpu(L):
    S = 4096

    def cache_causal(b, h, q_idx, kv_idx):
        return q_idx + (S - L) >= kv_idx

    check_against_reference(4, 32, 8, L, S, 128, torch.bfloat16, cache_causal, 128, seed_of("gpu-decode", L),
                            device="cuda", what=f"gpu decode L={L}")


@pytest.mark.gpu
@needs_gpu
def test_deterministic_sink_gradient_gpu():
    gen = torch.Generator().manual_seed(seed_of("gpu-deterministic"))
    B, H, L, D = 2, 8, 2048, 128
    q, k, v = (torch.randn(B, H, L, D, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
    sinks = make_sinks(H, gen, device="cuda")
    g = torch.randn(B, H, L, D, generator=gen).cuda().bfloat16()
    bm = create_block_mask(_window(700), None, None, L, L, device="cuda")
    opts = KernelOptions(deterministic=True)

    def grads():
        out = flex_attention(q, k, v, block_mask=bm, kernel_options=opts, sinks=sinks)
        return torch.autograd.grad((out * g).sum(), [q, k, v, sinks])

    first, second = grads(), grads()
    for name, a, b in zip(["dq", "dk", "dv", "dsinks"], first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.gpu
@needs_gpu
def test_compiled_inductor_gpu(sink_paths):
    """Inductor end to end on the GPU: one graph, eager's outputs and gradients; the sinks go
    through flexcore's forward op (not the inline op, not a pass after the kernels)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("gpu-compiled"))
    B, H, L, D = 2, 8, 1024, 64
    q, k, v = (torch.randn(B, H, L, D, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
    sinks = make_sinks(H, gen, device="cuda")
    g = torch.randn(B, H, L, D, generator=gen).cuda().bfloat16()
    bm = create_block_mask(_window(300), None, None, L, L, device="cuda")

    def fn(q, k, v, sinks):
        return flex_attention(q, k, v, block_mask=bm, sinks=sinks)

    assert torch._dynamo.explain(fn)(q, k, v, sinks).graph_break_count == 0
    sink_paths.update(dict.fromkeys(sink_paths, 0))  # explain ran the graph once

    def run(f):
        out = f(q, k, v, sinks)
        return [out.detach(), *torch.autograd.grad((out * g).sum(), [q, k, v, sinks])]

    got = run(torch.compile(fn, fullgraph=True))
    assert sink_paths["post_pass"] == 0 and sink_paths["forward_sinks"] == 1 and sink_paths["delta"] == 1
    eager = run(fn)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"compiled {name}")


# -- Hopper GPU: the Gluon forwards take the sinks in their epilogue --------------------------------

# Dense: every block full (the dense Gluon kernel); causal with an empty row and a sliding window:
# the masked Gluon kernel (forced by the policy, which otherwise keeps short rows on the template).
_GLUON_MASKS = {
    "dense": (lambda b, h, q_idx, kv_idx: q_idx >= 0, "dense"),
    "causal": (causal_with_a_masked_row(300), "masked"),
    "window": (_window(256), "masked"),
}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", sorted(_GLUON_MASKS))
def test_gluon_forward_takes_the_sinks_in(caplog, mask, D):
    """bf16 through the Gluon forwards at head dims 64 and 128 (GQA, two batches): out, lse and
    the gradients of q, k, v and the sinks against the float64 golden, within twice torch's own
    bf16 error; the dispatch log shows that the Gluon kernel, not the template, served the call
    with the sinks in its epilogue."""
    mask_mod, kind = _GLUON_MASKS[mask]
    opts = policy_options(gluon={kind: "on"})  # raises if the Gluon kernel cannot serve the call
    with caplog.at_level(logging.DEBUG, logger="flexcore.dispatch"):
        # 16 heads: dsinks is one sum per head, and its error over a few heads is too noisy to
        # compare with torch's; sinks near log(1024 keys), where they move a dense row's output.
        check_against_reference(2, 16, 4, 1024, 1024, D, torch.bfloat16, mask_mod, 128,
                                seed_of("gluon", mask, D), device="cuda", alibi=False,
                                kernel_options=opts, what=f"gluon/{mask}/D{D}",
                                sink_center=math.log(1024) - 0.5)
    lines = [m for m in _dispatch_lines(caplog) if m.startswith("forward:")]
    assert lines and all(f"Gluon {kind} kernel" in m and "sinks in the epilogue" in m for m in lines), lines
    # The sinks learn: the backward sums delta = rowsum(P * dP), in the template or the Gluon dQ kernel.
    lines = [m for m in _dispatch_lines(caplog) if m.startswith("backward:")]
    assert lines and all(("Triton template" in m and "exact_delta=True" in m)
                         or ("Gluon kernels" in m and "row sums True" in m) for m in lines), lines


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("masked", [False, True])
def test_forced_gluon_backward_with_learning_sinks(caplog, masked):
    """policy.gluon.backward='on' with sinks that want a gradient beside q, k and v: the Gluon dQ
    kernel sums their delta (ROW_SUMS) over full blocks and, under a causal mask, partial ones, and
    the gradients match the float64 reference; with the sinks alone learning the call is refused,
    naming the sinks and the settings that would serve it."""
    gen = torch.Generator().manual_seed(seed_of("gluon-refuses", masked))
    B, H, L, D = 1, 4, 1024, 128
    q, k, v = (torch.randn(B, H, L, D, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
    sinks = make_sinks(H, gen, device="cuda", center=math.log(L))
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, L, L, device="cuda") if masked else None
    opts = policy_options(gluon={"backward": "on"})
    # A dense dO: the Gluon backward reads dO as (rows, D), which out.sum()'s expanded ones are not.
    grad_out = torch.randn(B, H, L, D, generator=gen).cuda().bfloat16()
    with caplog.at_level(logging.DEBUG, logger="flexcore.dispatch"):
        out = flex_attention(q, k, v, block_mask=bm, sinks=sinks, kernel_options=opts)
        ours = torch.autograd.grad(out, [q, k, v, sinks], grad_out)
    assert any("Gluon kernels" in m and "row sums True" in m for m in _dispatch_lines(caplog))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    gold = flex_attention_reference(*leaves64[:3], block_mask=bm, sinks=leaves64[3])
    golden = torch.autograd.grad(gold, leaves64, grad_out.double())
    base_leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    base = flex_attention_reference(*base_leaves[:3], block_mask=bm, sinks=base_leaves[3], upcast=False)
    baseline = torch.autograd.grad(base, base_leaves, grad_out)
    for name, a, g, b in zip(["dq", "dk", "dv", "dsinks"], ours, golden, baseline):
        assert_close_to_reference(a, g, b, metric="rel_fro", atol=1e-6, name=name)
    out = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=bm, sinks=sinks, kernel_options=opts)
    with pytest.raises(InputError, match="only the sinks want a gradient.*exact_delta"):
        torch.autograd.grad(out, [sinks], grad_out)
    # Sinks that do not learn: the forced Gluon backward runs.
    out = flex_attention(q, k, v, block_mask=bm, sinks=sinks.detach(), kernel_options=opts)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out, [q, k, v], grad_out))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kind", ["dense", "masked"])
def test_gluon_plans_take_each_calls_sinks(caplog, kind):
    """Repeated Gluon calls of one shape (the kept plan) read each call's sinks; a call without
    sinks takes its own kernel. Each output and lse against the float64 golden."""
    gen = torch.Generator().manual_seed(seed_of("gluon-plans", kind))
    B, H, L, D = 1, 4, 1024, 128
    q, k, v = (torch.randn(B, H, L, D, generator=gen).cuda().bfloat16() for _ in range(3))
    mask_mod = _GLUON_MASKS["dense" if kind == "dense" else "window"][0]
    bm = create_block_mask(mask_mod, None, None, L, L, device="cuda")
    opts = policy_options(gluon={kind: "on"})
    first, second = make_sinks(H, gen, device="cuda").detach(), make_sinks(H, gen, device="cuda").detach()
    for sinks in (first, second, None, first):
        out, aux = flex_attention(q, k, v, block_mask=bm, sinks=sinks, kernel_options=opts,
                                  return_aux=AuxRequest(lse=True))
        s64 = None if sinks is None else sinks.double()
        gold, gold_lse = flex_attention_reference(q, k, v, block_mask=bm, sinks=s64, return_lse=True)
        base = flex_attention_reference(q, k, v, block_mask=bm, sinks=sinks, upcast=False)
        assert_close_to_reference(out, gold, base, metric="rel_fro", atol=1e-3, name=f"{kind} out")
        torch.testing.assert_close(aux.lse.double(), gold_lse, rtol=1e-4, atol=1e-4)
