"""Learnable attention sinks (``flex_attention(..., sinks=)``): forward, lse and every gradient
(q, k, v, the sinks, a captured score_mod tensor) against the float64 reference's autograd, with
tolerances relative to torch's own error in the same dtype; fully masked rows, GQA, decode, a paged
cache, the deterministic sink gradient, torch.compile, bad inputs, and torch's flex_attention with
the LSE renormalisation that users apply today.

The reference implements sinks independently (one more softmax column), flex_attention from the
kernels' (out, lse) (flexcore.sinks), so agreement checks the derivation as well as the kernels.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from flexcore import AuxRequest, KernelOptions, create_block_mask, flex_attention
from flexcore.errors import InputError
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference

ATOL = {torch.float64: 1e-10, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_sinks(H: int, gen, dtype=torch.float32, device="cpu"):
    # Centred near a row's typical lse (log of ~100 keys), so that the sink takes a large share of
    # some rows and little of others: both terms of its gradient matter.
    return (3.0 + 2.0 * torch.randn(H, generator=gen)).to(device, dtype).requires_grad_()


def alibi_factory(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return alibi


def check_against_reference(B, Hq, Hkv, L, S, D, dtype, mask_mod, block, seed, *, device="cpu",
                            sink_dtype=torch.float32, what=""):
    """One forward+backward with sinks and a learnable ALiBi slope through flex_attention; out,
    lse and the gradients of q, k, v, sinks and slopes against the float64 golden, within twice
    torch's own error (the reference in ``dtype``). Returns (out, lse, grads) for more checks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype).requires_grad_()
    v = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype).requires_grad_()
    sinks = make_sinks(Hq, gen, sink_dtype, device)
    slopes = (0.1 * torch.rand(Hq, generator=gen)).to(device).requires_grad_()
    grad_out = torch.randn(B, Hq, L, D, generator=gen).to(device, dtype)
    grad_lse = torch.randn(B, Hq, L, generator=gen).to(device)
    bm = create_block_mask(mask_mod, None, None, L, S, device=device, BLOCK_SIZE=block)
    gqa = Hq != Hkv

    out, aux = flex_attention(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm, enable_gqa=gqa,
                              return_aux=AuxRequest(lse=True), sinks=sinks)
    inputs = [q, k, v, sinks, slopes]
    ours = [out, aux.lse, *torch.autograd.grad((out * grad_out).sum() + (aux.lse * grad_lse).sum(), inputs)]

    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    gold, gold_lse = flex_attention_reference(*inputs64[:3], score_mod=alibi_factory(inputs64[4]),
                                              block_mask=bm, enable_gqa=gqa, return_lse=True,
                                              sinks=inputs64[3], upcast=True)
    golden = [gold, gold_lse, *torch.autograd.grad(
        (gold * grad_out.double()).sum() + (gold_lse * grad_lse.double()).sum(), inputs64)]

    base, base_lse = flex_attention_reference(q, k, v, score_mod=alibi_factory(slopes), block_mask=bm,
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
    without = flex_attention_reference(*inputs64[:3], score_mod=alibi_factory(inputs64[4]), block_mask=bm,
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


def test_sinks_alone_require_grad():
    """Only the sinks learn (q, k, v frozen): the inference path runs the kernels without an
    autograd node and the sinks' gradient still matches the golden."""
    gen = torch.Generator().manual_seed(seed_of("sinks-only"))
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    sinks = make_sinks(2, gen)
    sinks64 = sinks.detach().double().requires_grad_()
    g = torch.randn(1, 2, 64, 16, generator=gen)
    out = flex_attention(q, k, v, sinks=sinks)
    (ours,) = torch.autograd.grad((out * g).sum(), sinks)
    gold = flex_attention_reference(q.double(), k.double(), v.double(), sinks=sinks64)
    (golden,) = torch.autograd.grad((gold * g.double()).sum(), sinks64)
    base = flex_attention_reference(q, k, v, sinks=sinks, upcast=False)
    (baseline,) = torch.autograd.grad((base * g).sum(), sinks)
    assert_close_to_reference(ours, golden, baseline, metric="rel_fro", atol=1e-6, name="dsinks")


def test_deterministic_sink_gradient():
    """KernelOptions(deterministic=True): two backward passes give bit-identical gradients of the
    sinks (a torch reduction over rows) and of q, k, v and a captured tensor."""
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


def test_compiled_matches_eager_without_graph_breaks():
    """Under torch.compile (fullgraph) the sinks are torch ops around flexcore's custom op: no
    graph break, and the outputs, lse and gradients (the sinks' included) are eager's."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("compiled"))
    B, H, L, D = 1, 2, 64, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
    sinks = make_sinks(H, gen)
    slopes = (0.1 * torch.rand(H, generator=gen)).requires_grad_()
    g = torch.randn(B, H, L, D, generator=gen)
    g_lse = torch.randn(B, H, L, generator=gen)
    bm = create_block_mask(causal_with_a_masked_row(9), None, None, L, L, device="cpu", BLOCK_SIZE=32)

    def fn(q, k, v, sinks):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

        out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=bm, sinks=sinks,
                                  return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def run(f):
        out, lse = f(q, k, v, sinks)
        grads = torch.autograd.grad((out * g).sum() + (lse * g_lse).sum(), [q, k, v, sinks, slopes])
        return [out.detach(), lse.detach(), *grads]

    assert torch._dynamo.explain(fn)(q, k, v, sinks).graph_break_count == 0
    got = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    eager = run(fn)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks", "dslopes"], got, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"compiled {name}")
    assert torch.equal(got[1][:, :, 9], sinks.detach().view(1, -1).expand(B, -1))


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
def test_compiled_inductor_gpu():
    """Inductor end to end on the GPU: one graph, eager's outputs and gradients."""
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

    def run(f):
        out = f(q, k, v, sinks)
        return [out.detach(), *torch.autograd.grad((out * g).sum(), [q, k, v, sinks])]

    got, eager = run(torch.compile(fn, fullgraph=True)), run(fn)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"compiled {name}")
