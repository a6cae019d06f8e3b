"""FP8 forward (``flex_attention`` with float8_e4m3fn q, k, v and descale factors): out, lse and
max_scores against the float64 reference on the dequantized inputs, within a bound stated from
e4m3's epsilon; score_mods, masks, GQA, every descale layout, sinks, short queries, a shared cache,
the Triton template's descriptor path; quantize/dequantize; every bad input. The CPU runs the same
kernel under Triton's interpreter (inputs upcast, P rounded to e4m3 as the GPU rounds it).
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from flexcore import AuxRequest, KernelOptions, create_block_mask, flex_attention
from flexcore.errors import InputError
from flexcore.fp8 import FP8_DTYPE, check_fp8_device, dequantize, key_major, quantize
from flexcore.kernels import hopper
from flexcore.kernels.policy import DispatchPolicy, fp8_policy
from flexcore.reference import flex_attention_reference
from tests.flexcore.helpers import needs_hopper, served_spy
from tests.flexcore.policies import policy_options

# The kernel's own rounding, per output element (the inputs are exact: the golden takes the same
# dequantized values). It rounds each probability p = exp(s - max) in (0, 1] to e4m3 before P·V:
# relative error at most e4m3's unit roundoff u = eps/2 = 2^-4 in the normal range, absolute at
# most half the subnormal spacing, 2^-10, below 2^-6. Hence
#   |out - golden| <= Σ_j max((u + δ)·p_j, 2^-10)·|v_j| / l  +  2^-8·|golden|  +  1e-6,
# with δ = 2^-8 for the scores' own error (float32 arithmetic; on Hopper the FP8 tensor cores'
# reduced-precision accumulation, about 2^-13 of Σ|q·k|), 2^-8 the bfloat16 output's rounding, and
# 1e-6 for float32 arithmetic in P·V. The same bound holds per tile under the online softmax (a
# tile's probabilities are rescaled by factors <= 1 afterwards).
U_E4M3 = torch.finfo(FP8_DTYPE).eps / 2
HALF_SUBNORMAL_SPACING = torch.finfo(FP8_DTYPE).smallest_normal / 2 ** 4
SCORE_SLACK = 2.0 ** -8
U_BF16 = torch.finfo(torch.bfloat16).eps / 2


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi_factory(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return alibi


def softcap(score, b, h, q_idx, kv_idx):
    return 4.0 * torch.tanh(score / 4.0)


def quantized(B, Hq, Hkv, L, S, D, seed, device="cpu", q_heads=None, per_tensor=False):
    """float8 q, k, v quantized from random normals (scaled per head so that descales differ) and
    their descales; ``q_heads``: the heads of q's descale (Hkv: FlashAttention-3's layout)."""
    gen = torch.Generator().manual_seed(seed)

    def tensor(H, N):
        spread = torch.exp(torch.randn(1, H, 1, 1, generator=gen))  # heads of different ranges
        return (torch.randn(B, H, N, D, generator=gen) * spread).to(device)

    q, k, v = tensor(Hq, L), tensor(Hkv, S), tensor(Hkv, S)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(q, heads=q_heads, per_tensor=per_tensor),
                                    quantize(k, per_tensor=per_tensor), quantize(v, per_tensor=per_tensor))
    return (q8, k8, v8), dict(descale_q=dq, descale_k=dk, descale_v=dv)


def exact_probabilities(qd, kd, score_mod, mask_mod, scale):
    """(scores, p = exp(s - max), l = Σ p) in float64, from dequantized q and k (GQA repeated)."""
    B, Hq, L, _ = qd.shape
    S = kd.shape[2]
    kd = kd.expand(B, -1, -1, -1).repeat_interleave(Hq // kd.shape[1], dim=1)
    s = qd @ kd.transpose(-1, -2) * scale
    dev = qd.device
    b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(Hq, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(L, device=dev).view(1, 1, -1, 1)
    kj = torch.arange(S, device=dev).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, kj)
    if mask_mod is not None:
        s = torch.where(mask_mod(b, h, qi, kj), s, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    return s, p, p.sum(dim=-1, keepdim=True)


def e4m3_bound(qd, kd, vd, golden, score_mod, mask_mod, scale, weight=None):
    """The per-element bound on |out - golden| stated at the top of this module. ``weight``: each
    row's share of the mass that sinks leave to the keys (the output is scaled by it and rounded
    to bfloat16 once more)."""
    _, p, l = exact_probabilities(qd, kd, score_mod, mask_mod, scale)
    B, Hq = qd.shape[:2]
    v_abs = vd.expand(B, -1, -1, -1).repeat_interleave(Hq // vd.shape[1], dim=1).abs()
    per_p = torch.where(p > 0, torch.maximum((U_E4M3 + SCORE_SLACK) * p,
                                             torch.full_like(p, HALF_SUBNORMAL_SPACING)), 0.0)
    rounding = (per_p @ v_abs) / l
    if weight is None:
        return rounding + U_BF16 * golden.abs() + 1e-6
    return rounding * weight.unsqueeze(-1) + 2 * U_BF16 * golden.abs() + 1e-6


def check_fp8(inputs, descales, *, score_mod=None, block_mask=None, mask_mod=None, enable_gqa=False,
              kernel_options=None, sinks=None, what=""):
    """One FP8 call against the float64 golden on the dequantized inputs: out within the e4m3
    bound, lse and max_scores within float32 rounding. Returns (out, lse, golden, bound)."""
    q8, k8, v8 = inputs
    scale = 1.0 / math.sqrt(q8.shape[-1])
    with torch.no_grad():
        out, aux = flex_attention(q8, k8, v8, score_mod=score_mod, block_mask=block_mask,
                                  enable_gqa=enable_gqa, kernel_options=kernel_options, sinks=sinks,
                                  return_aux=AuxRequest(lse=True, max_scores=True), **descales)
    assert out.dtype == torch.bfloat16 and aux.lse.dtype == torch.float32, what
    assert out.shape == (*q8.shape[:3], v8.shape[-1]), what
    golden, golden_lse = flex_attention_reference(q8, k8, v8, score_mod=score_mod, block_mask=block_mask,
                                                  enable_gqa=enable_gqa, return_lse=True, sinks=sinks,
                                                  **descales)
    assert golden.dtype == torch.float64, what
    qd, kd, vd = (dequantize(t, descales[n]) for t, n in
                  ((q8, "descale_q"), (k8, "descale_k"), (v8, "descale_v")))
    # With sinks each row keeps 1 - exp(sink - lse') of its mass (lse' includes the sink).
    weight = None if sinks is None else 1 - torch.exp(sinks.double().view(1, -1, 1) - golden_lse)
    bound = e4m3_bound(qd, kd, vd, golden, score_mod, mask_mod, scale, weight)
    err = (out.double() - golden).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, (f"{what}: |out - golden| exceeds the e4m3 bound by {worst:.2f}x "
                          f"(max error {float(err.max()):.3e})")
    # lse and max_scores carry the scores' own error only (the row sum is unrounded): at most
    # SCORE_SLACK, the same allowance as in the bound.
    assert torch.allclose(aux.lse.double(), golden_lse, rtol=0, atol=SCORE_SLACK), \
        f"{what}: lse off by {float((aux.lse.double() - golden_lse).abs().max()):.3e}"
    scores, _, _ = exact_probabilities(qd, kd, score_mod, mask_mod, scale)
    # max_scores is the scores' max as the mods see them: descaled and scaled, as for bf16 inputs.
    assert torch.allclose(aux.max_scores.double(), scores.amax(-1), rtol=0, atol=SCORE_SLACK), what
    return out, aux.lse, golden, bound


@pytest.mark.parametrize("case", ["noop", "causal_alibi_gqa", "softcap_ragged", "per_tensor"])
def test_fp8_forward_against_float64(case):
    """Each row: a mask and score_mod as bf16 calls take them, and a descale layout. GQA reads q's
    descale per KV head (FlashAttention-3's layout), softcap per query head; 97 is not a multiple
    of the 64-wide tiles (a ragged last tile on both axes)."""
    if case == "noop":
        inputs, descales = quantized(2, 2, 2, 64, 64, 32, seed_of(case))
        check_fp8(inputs, descales, what=case)
    elif case == "causal_alibi_gqa":
        inputs, descales = quantized(1, 4, 2, 64, 64, 16, seed_of(case), q_heads=2)
        assert descales["descale_q"].shape == (1, 2)
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
        check_fp8(inputs, descales, score_mod=alibi_factory(slopes), block_mask=bm, mask_mod=causal,
                  enable_gqa=True, what=case)
    elif case == "softcap_ragged":
        inputs, descales = quantized(1, 2, 2, 97, 97, 32, seed_of(case))
        bm = create_block_mask(causal, None, None, 97, 97, device="cpu")
        check_fp8(inputs, descales, score_mod=softcap, block_mask=bm, mask_mod=causal, what=case)
    else:
        inputs, descales = quantized(1, 2, 2, 64, 64, 32, seed_of(case), per_tensor=True)
        assert descales["descale_k"].shape == ()
        descales["descale_v"] = descales["descale_v"].reshape(1)  # (1,) is per tensor too
        check_fp8(inputs, descales, what=case)


def test_the_bound_detects_a_wrong_descale():
    """The comparison can fail: a descale_v off by 2^-3 (one e4m3 step at 1) breaks the bound."""
    inputs, descales = quantized(1, 2, 2, 64, 64, 32, seed_of("wrong"))
    wrong = dict(descales, descale_v=descales["descale_v"] * 1.125)
    q8, k8, v8 = inputs
    with torch.no_grad():
        out = flex_attention(q8, k8, v8, **wrong)
    golden = flex_attention_reference(q8, k8, v8, **descales)
    qd, kd, vd = (dequantize(t, descales[n]) for t, n in
                  ((q8, "descale_q"), (k8, "descale_k"), (v8, "descale_v")))
    bound = e4m3_bound(qd, kd, vd, golden, None, None, 1 / math.sqrt(32))
    assert float(((out.double() - golden).abs() / bound).max()) > 1.0


def test_fp8_through_tensor_descriptors_with_key_major_value():
    """The template's descriptor path (the policy's forward.tma "on", as Hopper takes it): K by
    rows, V key-major over its transpose. A V given key-major is read without a copy."""
    inputs, descales = quantized(1, 2, 2, 128, 128, 32, seed_of("tma"))
    q8, k8, v8 = inputs
    vt = key_major(v8)
    assert vt.stride(2) == 1 and torch.equal(vt.float(), v8.float())
    assert key_major(vt) is vt
    check_fp8((q8, k8, vt), descales, kernel_options=policy_options(forward={"tma": "on"}), what="tma")


def test_fp8_short_queries_shared_cache_and_sinks():
    """Query length 8 (where bf16 takes the decoding kernel, FP8 takes the forward kernel), a
    key/value cache of batch 1 shared by two query batches with descales (1, Hkv), and sinks."""
    gen = torch.Generator().manual_seed(seed_of("short"))
    q = torch.randn(2, 4, 8, 16, generator=gen)
    k, v = torch.randn(1, 2, 80, 16, generator=gen), torch.randn(1, 2, 80, 16, generator=gen)
    (q8, dq), (k8, dk), (v8, dv) = quantize(q), quantize(k), quantize(v)
    assert dk.shape == (1, 2)
    sinks = torch.tensor([0.5, 2.0, -1.0, 3.0])
    check_fp8((q8, k8, v8), dict(descale_q=dq, descale_k=dk, descale_v=dv), enable_gqa=True, sinks=sinks,
              what="short")


def test_learnable_sinks_get_their_gradient_from_an_fp8_forward():
    """The sinks' gradient needs no kernel backward (flexcore.sinks differentiates out and lse):
    an FP8 forward with learnable sinks trains them, close to the float64 gradient."""
    inputs, descales = quantized(1, 2, 2, 64, 64, 16, seed_of("sinkgrad"))
    sinks = torch.tensor([1.0, 2.5], requires_grad=True)
    out = flex_attention(*inputs, sinks=sinks, **descales)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad((out.double() * g).sum(), sinks)
    s64 = sinks.detach().double().requires_grad_()
    golden = flex_attention_reference(*inputs, sinks=s64, **descales)
    (grad64,) = torch.autograd.grad((golden * g.double()).sum(), s64)
    assert torch.allclose(grad.double(), grad64, rtol=0.1, atol=0.05), (grad, grad64)


def test_reference_without_upcast_follows_the_fp8_kernels_math():
    """flex_attention_reference(..., upcast=False) on float8 inputs rounds exp(s - max) to e4m3
    before @ V: its error against float64 is e4m3's, within the bound, and far above bfloat16's."""
    inputs, descales = quantized(1, 2, 2, 64, 64, 32, seed_of("emulated"))
    golden = flex_attention_reference(*inputs, **descales)
    emulated, lse = flex_attention_reference(*inputs, upcast=False, return_lse=True, **descales)
    assert emulated.dtype == torch.bfloat16 and lse.dtype == torch.float32
    qd, kd, vd = (dequantize(t, descales[n]) for t, n in
                  zip(inputs, ("descale_q", "descale_k", "descale_v")))
    bound = e4m3_bound(qd, kd, vd, golden, None, None, 1 / math.sqrt(32))
    err = (emulated.double() - golden).abs()
    assert float((err / bound).max()) <= 1.0
    bf16 = flex_attention_reference(qd.bfloat16(), kd.bfloat16(), vd.bfloat16(), upcast=False)
    assert float(err.max()) > 2 * float((bf16.double() - golden).abs().max())


def test_quantize_round_trip_and_layouts():
    x = torch.randn(2, 4, 32, 16) * torch.tensor([1.0, 10.0, 0.1, 3.0]).view(1, 4, 1, 1)
    x8, d = quantize(x)
    assert x8.dtype == FP8_DTYPE and d.shape == (2, 4) and d.dtype == torch.float32
    assert float(x8.float().abs().amax()) == 448.0  # each head's amax maps to e4m3's largest value
    back = dequantize(x8, d)
    normal = back.abs() >= torch.finfo(FP8_DTYPE).smallest_normal * d.view(2, 4, 1, 1)
    assert float(((back - x.double()).abs() / x.double().abs())[normal].max()) <= U_E4M3
    _, groups = quantize(x, heads=2)
    assert groups.shape == (2, 2)
    _, whole = quantize(x, per_tensor=True)
    assert whole.shape == ()
    x8, pow2 = quantize(x, power_of_two=True)
    assert torch.equal(torch.exp2(torch.log2(pow2).round()), pow2)
    # Power-of-two descales make the dequantized values exact in bfloat16.
    assert torch.equal(dequantize(x8, pow2, torch.bfloat16).double(), dequantize(x8, pow2))


def test_fp8_policy_runs_the_gluon_forwards_only_where_forced():
    policy = fp8_policy(DispatchPolicy())
    assert (policy.gluon.dense, policy.gluon.masked) == ("off", "off")
    assert policy.forward.kv_rows == "off" and policy.forward.warp_spec == "off"
    forced = fp8_policy(DispatchPolicy().replace(gluon={"dense": "on"}))
    assert (forced.gluon.dense, forced.gluon.masked) == ("on", "off")


# ---- bad input ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_call():
    inputs, descales = quantized(1, 2, 2, 32, 32, 16, seed_of("bad"))
    return inputs, descales


def test_fp8_without_descales(fp8_call):
    (q8, k8, v8), d = fp8_call
    with pytest.raises(InputError, match="missing: descale_q, descale_k, descale_v"):
        flex_attention(q8, k8, v8)
    with pytest.raises(InputError, match="missing: descale_v"):
        flex_attention(q8, k8, v8, descale_q=d["descale_q"], descale_k=d["descale_k"])


@pytest.mark.parametrize("bad, match", [
    (lambda d: torch.ones(3, 2), r"descale_k has shape \(3, 2\); expected \(\) or \(1,\).*\(1, 2\)"),
    (lambda d: torch.ones(2), r"descale_k has shape \(2,\)"),
    (lambda d: d.half(), r"descale_k has dtype torch.float16; expected torch.float32"),
    (lambda d: d.to("meta"), r"descale_k is on meta but query is on cpu"),
    (lambda d: 0.5, r"descale_k must be a float32 torch.Tensor.*got float"),
    (lambda d: -d, r"descale_k holds values that are not finite and positive"),
])
def test_bad_descale(fp8_call, bad, match):
    inputs, d = fp8_call
    with pytest.raises(InputError, match=match):
        flex_attention(*inputs, **dict(d, descale_k=bad(d["descale_k"])))


def test_descale_q_per_query_head_is_accepted_but_other_head_counts_are_not():
    inputs, d = quantized(1, 4, 2, 32, 32, 16, seed_of("qheads"))
    assert d["descale_q"].shape == (1, 4)
    with torch.no_grad():
        flex_attention(*inputs, enable_gqa=True, **d)
    with pytest.raises(InputError, match=r"descale_q has shape \(1, 3\).*\(1, 2\) or \(1, 4\)"):
        flex_attention(*inputs, enable_gqa=True, **dict(d, descale_q=torch.ones(1, 3)))


def test_mixed_and_other_float8_formats(fp8_call):
    (q8, k8, v8), d = fp8_call
    with pytest.raises(InputError, match="mixed FP8 inputs.*value torch.bfloat16"):
        flex_attention(q8, k8, v8.to(torch.bfloat16), **d)
    with pytest.raises(InputError, match="query has dtype torch.float8_e5m2"):
        flex_attention(torch.zeros(q8.shape, dtype=torch.float8_e5m2), k8, v8, **d)
    with pytest.raises(InputError, match="descale_q, descale_k, descale_v given, but query, key and value"):
        flex_attention(*(t.to(torch.bfloat16) for t in (q8, k8, v8)), **d)


def test_fp8_is_forward_only(fp8_call):
    (q8, k8, v8), d = fp8_call
    with pytest.raises(InputError, match="forward-only, but query requires grad"):
        flex_attention(q8.clone().requires_grad_(), k8, v8, **d)
    with pytest.raises(InputError, match="forward-only, but descale_v requires grad"):
        flex_attention(q8, k8, v8, **dict(d, descale_v=d["descale_v"].clone().requires_grad_()))
    slopes = torch.tensor([0.1, 0.2], requires_grad=True)
    with pytest.raises(InputError, match="forward-only, but the score_mod's captured tensor"):
        flex_attention(q8, k8, v8, score_mod=alibi_factory(slopes), return_aux=AuxRequest(lse=True), **d)
    with torch.no_grad():  # the same calls without autograd run
        flex_attention(q8.clone().requires_grad_(), k8, v8, score_mod=alibi_factory(slopes), **d)


def test_fp8_under_torch_compile_runs_eagerly_as_a_graph_break(fp8_call):
    """FP8 calls run eagerly: inside a compiled function they are a graph break with the eager
    result (sinks learning through it too); fullgraph=True names the reason."""
    (q8, k8, v8), d = fp8_call
    sinks = torch.tensor([0.5, 1.5], requires_grad=True)

    def fn(q, k, v):
        return flex_attention(q, k, v, sinks=sinks, **d) * 2

    eager = fn(q8, k8, v8)
    (grad,) = torch.autograd.grad(eager.float().sum(), sinks)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager")(q8, k8, v8)
    assert torch.equal(compiled, eager)
    (compiled_grad,) = torch.autograd.grad(compiled.float().sum(), sinks)
    assert torch.equal(compiled_grad, grad)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="FP8 .* runs eagerly, not under torch.compile"):
        torch.compile(fn, backend="eager", fullgraph=True)(q8, k8, v8)
    torch._dynamo.reset()


def test_fp8_without_query_rows_still_trains_its_sinks(fp8_call):
    """No query rows: an empty output, and the sinks get a zero gradient (as at L > 0, and as
    16-bit calls without rows do)."""
    (q8, k8, v8), d = fp8_call
    sinks = torch.tensor([0.5, 1.5], requires_grad=True)
    out = flex_attention(q8[:, :, :0], k8, v8, sinks=sinks, **d)
    assert out.shape == (*q8.shape[:2], 0, v8.shape[-1]) and out.dtype == torch.bfloat16
    (grad,) = torch.autograd.grad(out.float().sum(), sinks)
    assert torch.equal(grad, torch.zeros(2))


def test_quantize_empty_tensors():
    """An empty tensor (no rows, or no batch) quantizes with descale 1."""
    for shape, heads in (((2, 4, 0, 16), None), ((0, 4, 32, 16), None), ((2, 4, 0, 16), 2)):
        x8, d = quantize(torch.randn(shape), heads=heads)
        assert x8.shape == shape and d.shape == (shape[0], heads or shape[1]) and (d == 1).all()
    x8, d = quantize(torch.randn(2, 4, 0, 16), per_tensor=True)
    assert d.shape == () and float(d) == 1.0


def test_fp8_refuses_kernels_without_an_fp8_path(fp8_call):
    inputs, d = fp8_call
    with pytest.raises(InputError, match="decoding kernel, which has no FP8 path"):
        flex_attention(*inputs, kernel_options=KernelOptions(decode=True), **d)


def test_fp8_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    import flexcore.fp8 as fp8

    monkeypatch.setattr(fp8, "_capability", lambda index: ((8, 0), "NVIDIA A100-SXM4-80GB"))
    with pytest.raises(InputError, match=r"compute capability 8.9 or newer.*H100.*sm_80"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(fp8, "_capability", lambda index: ((9, 0), "NVIDIA H100"))
    check_fp8_device(torch.device("cuda", 0))


# ---- the GPU ---------------------------------------------------------------------------------


def _gpu_case(B, Hq, Hkv, S, D, mask, mod, seed):
    """Inputs quantized with power-of-two descales, so that the dequantized values are exact in
    bfloat16 and both dtypes attend the same numbers."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def tensor(H):
        return torch.randn(B, H, S, D, generator=gen, device="cuda")

    q8, dq = quantize(tensor(Hq), heads=Hkv, power_of_two=True)
    (k8, dk), (v8, dv) = quantize(tensor(Hkv), power_of_two=True), quantize(tensor(Hkv), power_of_two=True)
    mask_mod = {"none": None, "causal": causal,
                "window": lambda b, h, q, kv: (q >= kv) & (q - kv < S // 4)}[mask]
    slopes = torch.exp2(-torch.arange(1, Hq + 1, device="cuda") / 2)
    score_mod = {"none": None, "alibi": alibi_factory(slopes), "softcap": softcap}[mod]
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S, S, device="cuda")
    return (q8, k8, v8), dict(descale_q=dq, descale_k=dk, descale_v=dv), bm, mask_mod, score_mod


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B, Hq, Hkv, S, D, mask, mod", [
    (2, 4, 4, 1024, 64, "none", "none"),
    (1, 8, 2, 2048, 128, "causal", "alibi"),
    (1, 4, 4, 4096, 128, "causal", "none"),
    (1, 4, 2, 4096, 128, "window", "softcap"),
    (2, 4, 4, 1000, 64, "causal", "softcap"),   # lengths that divide no tile
])
def test_fp8_forward_gpu_against_float64_and_bf16(B, Hq, Hkv, S, D, mask, mod):
    """On the FP8 tensor cores: within the e4m3 bound of float64, and the error against bfloat16's
    on the same (exactly representable) inputs: larger (P rounds to e4m3, 3 mantissa bits instead
    of 8) by at most twice the ratio of the two unit roundoffs, 2^-4 / 2^-8 = 16."""
    inputs, descales, bm, mask_mod, score_mod = _gpu_case(B, Hq, Hkv, S, D, mask, mod,
                                                          seed_of(B, Hq, Hkv, S, D, mask, mod))
    gqa = Hq != Hkv
    out, _, golden, _ = check_fp8(inputs, descales, score_mod=score_mod, block_mask=bm, mask_mod=mask_mod,
                                  enable_gqa=gqa, what=f"gpu {S} {D} {mask} {mod}")
    q, k, v = (dequantize(t, descales[n], torch.bfloat16) for t, n in
               zip(inputs, ("descale_q", "descale_k", "descale_v")))
    with torch.no_grad():
        out_bf16 = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)
    err_fp8 = float((out.double() - golden).norm() / golden.norm())
    err_bf16 = float((out_bf16.double() - golden).norm() / golden.norm())
    ratio = (U_E4M3 / U_BF16)
    assert err_bf16 < err_fp8 <= 2 * ratio * err_bf16, (err_fp8, err_bf16)


def test_a_repeated_call_reads_each_calls_descales():
    """The second call of the same shapes runs the kept plan: the descales are per-call
    arguments there too (doubling descale_v doubles the output exactly; bfloat16 scales by 2)."""
    from flexcore.kernels import launch

    inputs, d = quantized(1, 2, 2, 64, 64, 16, seed_of("plan"))
    with torch.no_grad():
        first = flex_attention(*inputs, **d)
        assert launch._plans, "the first call kept no plan"
        second = flex_attention(*inputs, **dict(d, descale_v=d["descale_v"] * 2))
        third = flex_attention(*inputs, **dict(d, descale_q=d["descale_q"] * 2))
    assert torch.equal(second, first * 2)
    doubled = dict(d, descale_q=d["descale_q"] * 2)
    golden = flex_attention_reference(*inputs, **doubled)
    qd, kd, vd = (dequantize(t, doubled[n]) for t, n in zip(inputs, ("descale_q", "descale_k", "descale_v")))
    bound = e4m3_bound(qd, kd, vd, golden, None, None, 1 / math.sqrt(16))
    assert float(((third.double() - golden).abs() / bound).max()) <= 1.0
    assert float(((first.double() - golden).abs() / bound).max()) > 1.0


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("B, Hq, Hkv, S, mask, layout, with_sinks", [
    (2, 4, 4, 1024, "none", "heads", False),     # the dense kernel
    (2, 4, 2, 1024, "none", "qheads", True),     # dense, GQA, q's descale per query head, sinks
    (1, 8, 2, 2048, "causal", "heads", False),   # masked, GQA, q's descale per KV head
    (1, 4, 4, 2048, "window", "tensor", True),   # masked, partial and full blocks, per-tensor descales, sinks
])
def test_fp8_gluon_forwards_gpu(monkeypatch, B, Hq, Hkv, S, mask, layout, with_sinks):
    """The Gluon forwards at head dim 128 on FP8 inputs (forced, so that they serve these sizes):
    within the e4m3 bound of float64, and against the bf16 Gluon call on the same inputs as the
    template's FP8 test bounds it; a repeated call (the kept plan) reads its own descales."""
    rule = "dense" if mask == "none" else "masked"
    calls = served_spy(monkeypatch, hopper, "forward" if rule == "dense" else "forward_masked")
    opts = policy_options(gluon={rule: "on"})  # raises if the Gluon kernel cannot serve the call
    gen = torch.Generator(device="cuda").manual_seed(seed_of("gluon-fp8", B, Hq, Hkv, S, mask, layout))

    def tensor(H):
        return torch.randn(B, H, S, 128, generator=gen, device="cuda")

    per_tensor = layout == "tensor"
    q8, dq = quantize(tensor(Hq), heads=Hkv if layout == "heads" else None, per_tensor=per_tensor,
                      power_of_two=True)
    (k8, dk), (v8, dv) = (quantize(tensor(Hkv), per_tensor=per_tensor, power_of_two=True) for _ in range(2))
    descales = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    mask_mod = {"none": None, "causal": causal,
                "window": lambda b, h, q, kv: (q >= kv) & (q - kv < S // 4)}[mask]
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S, S, device="cuda")
    sinks = torch.linspace(-1.0, 2.0, Hq, device="cuda") if with_sinks else None
    gqa = Hq != Hkv
    what = f"gluon fp8 {rule} {S} {mask} {layout}"
    out, _, golden, _ = check_fp8((q8, k8, v8), descales, block_mask=bm, mask_mod=mask_mod, enable_gqa=gqa,
                                  kernel_options=opts, sinks=sinks, what=what)
    assert calls == [True], f"{what}: the Gluon kernel did not serve the call"
    qb, kb, vb = (dequantize(t, descales[n], torch.bfloat16) for t, n in
                  zip((q8, k8, v8), ("descale_q", "descale_k", "descale_v")))
    with torch.no_grad():
        out_bf16 = flex_attention(qb, kb, vb, block_mask=bm, enable_gqa=gqa, kernel_options=opts, sinks=sinks)
    err_fp8 = float((out.double() - golden).norm() / golden.norm())
    err_bf16 = float((out_bf16.double() - golden).norm() / golden.norm())
    assert err_bf16 < err_fp8 <= 2 * (U_E4M3 / U_BF16) * err_bf16, (what, err_fp8, err_bf16)
    # The kept plan: doubling descale_v doubles the output exactly (bfloat16 scales by 2).
    with torch.no_grad():
        again = flex_attention(q8, k8, v8, block_mask=bm, enable_gqa=gqa, kernel_options=opts, sinks=sinks,
                               **dict(descales, descale_v=dv * 2))
    assert calls[-1] is True and torch.equal(again, out * 2), what


@pytest.mark.gpu
@needs_hopper
def test_a_forced_gluon_fp8_forward_at_head_dim_64_is_refused():
    """The Gluon forwards take FP8 at head dim 128 only: forcing one at 64 names what it serves."""
    q8, dq = quantize(torch.randn(1, 2, 256, 64, device="cuda"))
    (k8, dk), (v8, dv) = quantize(torch.randn(1, 2, 256, 64, device="cuda")), \
        quantize(torch.randn(1, 2, 256, 64, device="cuda"))
    with pytest.raises(InputError, match=r"float8_e4m3fn at \[128\]"):
        flex_attention(q8, k8, v8, kernel_options=policy_options(gluon={"dense": "on"}),
                       descale_q=dq, descale_k=dk, descale_v=dv)


@pytest.mark.parametrize("shape, transposed", [((2, 3, 100, 80), False), ((1, 2, 64, 16), True)])
def test_key_major_copy_kernel(shape, transposed):
    """The tile-transposing copy that key_major runs on CUDA (here under the interpreter): the same
    values, key stride 1, rows of keys padded to 16, from row-major and head-interleaved layouts."""
    from flexcore.kernels.layout import key_major_copy

    B, H, S, D = shape
    x = torch.randn((B, S, H, D) if transposed else shape, generator=torch.Generator().manual_seed(3))
    v = (x.transpose(1, 2) if transposed else x).to(FP8_DTYPE)
    padded = -(-S // 16) * 16
    out = key_major_copy(v, padded)
    assert out.shape == v.shape and out.stride(2) == 1 and out.stride(3) == padded
    assert torch.equal(out.view(torch.uint8), v.view(torch.uint8))


def test_operand_order_copy_matches_the_gluon_kernels_key_order():
    """The Gluon FP8 forward renumbers the keys of each 32-key group so that its P operand needs
    no shuffles (forward_hopper.py.tmpl, _p_late: a reshape to 2x2x2x2x2 and the permutation
    (0, 1, 2, 4, 5, 3, 6)); the V copy it reads (key_major_copy with operand_order, here under the
    interpreter) holds the same keys at the same positions, so P·V is unchanged, from row-major and
    key-major V alike."""
    from flexcore.kernels.layout import key_major_copy

    B, H, S, D = 2, 3, 128, 16
    gen = torch.Generator().manual_seed(11)
    v = torch.randn(B, H, S, D, generator=gen).to(FP8_DTYPE)
    p = torch.randn(4, S, generator=gen)
    # The template's renumbering of P's keys, written in torch.
    p_op = p.reshape(4, S // 32, 2, 2, 2, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(4, S)
    keys = torch.arange(S).reshape(1, S // 32, 2, 2, 2, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(S)
    assert torch.equal(p_op, p[:, keys]) and sorted(keys.tolist()) == list(range(S))
    assert keys[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]  # lane 0 and 1's accumulator keys
    for given in (v, key_major(v)):
        out = key_major_copy(given, S, operand_order=True)
        assert out.shape == v.shape and out.stride(2) == 1
        assert torch.equal(out.view(torch.uint8), v[:, :, keys].view(torch.uint8))
        vf = v.float()[0, 0]
        assert torch.allclose(p_op @ out.float()[0, 0], p @ vf, rtol=1e-5, atol=1e-4)
