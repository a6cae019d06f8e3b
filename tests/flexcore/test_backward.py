"""flex_attention's backward kernels against autograd through the float64 reference.

Every gradient (q, k, v and captured tensors that require grad) must satisfy
``err(ours) <= 2 * err(torch in the same dtype) + eps`` against the float64 golden, where torch's
error is that of autograd through ``flex_attention_reference(..., upcast=False)`` and err is the
relative Frobenius error.
"""
from __future__ import annotations

import pytest
import torch

from flexcore import KernelOptions, create_block_mask, flex_attention
from flexcore.errors import InputError
from flexcore.reference import flex_attention_reference
from tests.flexcore.cases import CPU_SHAPES, GPU_SHAPES, MOD_NAMES, Shape, make_mods
from tests.flexcore.compare import seed_of
from tests.flexcore.helpers import LEARNABLE, check_backward
from tests.flexcore.policies import policy_options

DEVICE = "cpu"


# -- the forward's variant matrix ---------------------------------------------------------------


@pytest.mark.parametrize("mod_name", MOD_NAMES)
def test_variants_fp32(mod_name):
    check_backward(CPU_SHAPES[0], mod_name, torch.float32, seed=seed_of("bwd", mod_name))


# bf16 on a smaller square shape (the interpreter's cost is per loop step): 80 is ragged for 32.
_SMALL = Shape("square80", B=1, Hq=2, Hkv=2, L=80, S=80, D=32, Dv=32, block=32)


@pytest.mark.parametrize("mod_name", MOD_NAMES)
def test_variants_bf16(mod_name):
    check_backward(_SMALL, mod_name, torch.bfloat16, seed=seed_of("bwd16", mod_name))


# Each of the forward's other shapes with a few variants (together they cover every variant).
_SHAPE_CASES = [
    ("square191", "sliding_window", torch.float32), ("square191", "alibi", torch.float32),
    ("cross64x300", "causal", torch.float32), ("cross64x300", "relative_table", torch.float32),
    ("cross64x300", "prefix_lm", torch.bfloat16),
    ("gqa8to2", "document", torch.bfloat16), ("gqa8to2", "softcap", torch.float32),
    ("d80_dv48", "and_or", torch.bfloat16), ("d80_dv48", "noop", torch.float32),
]


@pytest.mark.parametrize("shape_name,mod_name,dtype", _SHAPE_CASES,
                         ids=[f"{s}-{m}-{str(d)[6:]}" for s, m, d in _SHAPE_CASES])
def test_shapes(shape_name, mod_name, dtype):
    shape = {s.name: s for s in CPU_SHAPES}[shape_name]
    check_backward(shape, mod_name, dtype, seed=seed_of("bwdshape", shape_name, mod_name))


# -- gradients of captured tensors --------------------------------------------------------------


@pytest.mark.parametrize("learnable", LEARNABLE)
def test_captured_tensor_gradients(learnable):
    check_backward(_SMALL, "causal", torch.float32, seed=seed_of("cap", learnable), learnable=learnable)


def test_captured_gradients_gqa_ragged_bf16():
    # GQA, ragged lengths and a mask block spanning two tiles, with a per-(b, h) temperature.
    shape = Shape("gqa_ragged", B=2, Hq=4, Hkv=2, L=70, S=90, D=16, Dv=24, block=(32, 64))
    check_backward(shape, "causal", torch.bfloat16, seed=11, learnable="temperature",
                   kernel_options={"BLOCK_N": 32})
    check_backward(shape, None, torch.float32, seed=12, learnable="table_read_twice")
    check_backward(shape, "causal", torch.float32, seed=13, learnable="bias_difference")


_SLOPE = Shape("slope256", B=1, Hq=2, Hkv=2, L=256, S=256, D=32, Dv=32, block=64)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_learnable_slope_bf16(seed):
    # A learnable ALiBi slope in bf16. Its gradient sums dS * |i - j| along each row, so an error
    # in a row's delta adds up instead of cancelling; the delta pass (EXACT_DELTA) takes delta from
    # the backward's own P and dP. Without it these draws are off by about 1e-2 against torch's
    # 1e-3 (docs/decisions.md#exact-delta).
    check_backward(_SLOPE, "causal", torch.bfloat16, seed=seed, learnable="alibi_slope")


def test_delta_pass_runs_only_for_captured_gradients(monkeypatch):
    # The delta pass (PHASE 3) is launched where captured tensors' gradients are wanted, not for
    # q, k and v alone.
    from flexcore.kernels import backward as bwd

    phases = []
    real = bwd.launch
    monkeypatch.setattr(bwd, "launch", lambda kernel, grid, args, bm, bn, meta, constexprs, **kw:
                        phases.append(constexprs["PHASE"]) or real(kernel, grid, args, bm, bn, meta,
                                                                   constexprs, **kw))
    opts = policy_options(backward={"fused": "off"})
    check_backward(_SMALL, "causal", torch.bfloat16, seed=4, kernel_options=opts)
    assert phases == [1, 2]
    phases.clear()
    check_backward(_SMALL, "causal", torch.bfloat16, seed=5, learnable="temperature", kernel_options=opts)
    assert phases == [3, 1, 2]


@pytest.mark.parametrize("fused,tma", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["two-launches", "two-launches-tma", "one-launch", "one-launch-tma"])
def test_launch_layouts(monkeypatch, fused, tma):
    """The dK/dV and dQ programs in one launch or two, with inner-loop tiles read through tensor
    descriptors (TMA) or pointers: GQA, ragged lengths (descriptors zero-fill past the end), partial
    blocks and captured-tensor gradients."""
    from flexcore.kernels import backward as bwd

    opts = policy_options(backward={"fused": "on" if fused else "off", "tma": "on" if tma else "off"})
    used = []
    real = bwd.use_tma
    monkeypatch.setattr(bwd, "use_tma", lambda *a: used.append(real(*a)) or used[-1])
    shape = Shape("gqa_ragged_tma", B=1, Hq=4, Hkv=2, L=70, S=90, D=32, Dv=32, block=(32, 64))
    check_backward(shape, "causal", torch.float32, seed=seed_of("layout", fused, tma), learnable="alibi_slope",
                   kernel_options=opts)
    check_backward(shape, "causal", torch.bfloat16, seed=seed_of("layout16", fused, tma), learnable="alibi_slope",
                   kernel_options=opts)
    check_backward(shape, "document", torch.bfloat16, seed=seed_of("layout-doc", fused, tma), kernel_options=opts)
    assert used == [tma, tma, tma]  # descriptors are off unless asked for


def test_one_launch_out_of_shared_memory_splits(monkeypatch):
    """A single launch that runs out of shared memory runs as two launches instead (and stays so)."""
    from flexcore.kernels import backward as bwd

    class OutOfResources(Exception):
        pass

    phases = []

    class Wrapped:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                phases.append(kwargs["PHASE"])
                if kwargs["PHASE"] == 0:
                    raise OutOfResources("shared memory")
                return self.kernel[grid](*args, **kwargs)
            return run

    real_module = bwd.backward_module

    def module(*mods):
        m = real_module(*mods)
        return type("M", (), {"__name__": m.__name__, "flex_bwd_preprocess": m.flex_bwd_preprocess,
                              "flex_bwd_kernel": Wrapped(m.flex_bwd_kernel)})

    opts = policy_options(backward={"fused": "on"})
    monkeypatch.setattr(bwd, "backward_module", module)
    monkeypatch.setattr(bwd, "_split", set())
    check_backward(_SMALL, "causal", torch.float32, seed=31, kernel_options=opts)
    assert phases == [0, 1, 2]
    check_backward(_SMALL, "causal", torch.float32, seed=32, kernel_options=opts)
    assert phases == [0, 1, 2, 1, 2]


@pytest.mark.parametrize("fused_faster", [True, False])
def test_layout_tuning_keeps_the_faster_and_correct_gradients(monkeypatch, fused_faster):
    """On the GPU the first backward of a kernel and size times one launch against two and keeps the
    faster. Here the GPU path runs under the interpreter with a stand-in timer: the timed runs
    add captured-tensor gradients again and again, and the returned gradients must still be right."""
    import triton.testing

    from flexcore.kernels import backward as bwd

    timed = []

    def fake_do_bench(fn, **kwargs):
        fn()
        fn()  # repeated runs, as the real timer makes
        if fn not in timed:
            timed.append(fn)  # one launch is timed first, then two, in every round
        fast = (fn is timed[0]) == fused_faster
        return [1.0 if fast else 2.0] * 3  # return_mode="all": one round's samples

    monkeypatch.setattr(bwd, "use_interpreter", lambda: False)  # GPU tiles and the layout choice
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(bwd, "_layout_choice", {})
    shape = Shape("tuned128", B=1, Hq=1, Hkv=1, L=128, S=128, D=128, Dv=128, block=128)
    check_backward(shape, "causal", torch.float32, seed=41, learnable="alibi_slope")
    assert len(timed) == 2 and list(bwd._layout_choice.values()) == [fused_faster]
    check_backward(shape, "causal", torch.float32, seed=42, learnable="alibi_slope")
    assert len(timed) == 2  # remembered for this kernel and size


def test_deterministic_captured_gradients_are_bit_identical():
    opts = KernelOptions(deterministic=True)
    first = check_backward(_SMALL, "sliding_window", torch.float32, seed=21, learnable="t5_bucket_softcap",
                           kernel_options=opts, return_grads=True)
    second = check_backward(_SMALL, "sliding_window", torch.float32, seed=21,
                            learnable="t5_bucket_softcap", kernel_options=opts, return_grads=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("loss_scale", [2.0 ** 30, 2.0 ** 62])
def test_deterministic_captured_gradients_keep_their_range(loss_scale):
    # A per-head temperature gathers every score's gradient: under a loss scaler's 2**30 it passes
    # 2**31, which one int64 of 2**-32 units cannot hold (it came back clamped, 27% low). Past
    # 2**62 it reads as an infinity, as a float overflow would, not as a finite wrong number.
    from flexcore.testing import assert_close_to_reference

    gen = torch.Generator().manual_seed(seed_of("deterministic", "range", str(loss_scale)))
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    weights = torch.randn(1, 2, 64, 16, generator=gen)
    temp = (torch.rand(2, generator=gen) + 0.5).requires_grad_()

    def grad_of(attention, dtype, **options):
        t = temp.detach().to(dtype).requires_grad_()
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), score_mod=lambda s, b, h, qi, ki: s * t[h], **options)
        return torch.autograd.grad((out * weights.to(dtype)).sum() * loss_scale, [t])[0]

    ours = grad_of(flex_attention, torch.float32, kernel_options=KernelOptions(deterministic=True))
    gold = grad_of(flex_attention_reference, torch.float64)
    if loss_scale < 2.0 ** 62:
        assert gold.abs().max() > 2.0 ** 31
        base = grad_of(lambda *a, **kw: flex_attention_reference(*a, upcast=False, **kw), torch.float32)
        assert_close_to_reference(ours, gold, base, name="dtemp", metric="rel_fro")
    else:
        assert (gold.abs() > 2.0 ** 62).any()
        assert torch.equal(torch.isinf(ours), gold.abs() >= 2.0 ** 62) and not ours.isnan().any(), (ours, gold)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_have_zero_gradients(dtype):
    # bfloat16 recomputes probabilities from lse2 (P_FROM_LSE), where such rows have lse2 = +inf.
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 80, 32, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    table = torch.randn(80, generator=gen).requires_grad_()

    def late(b, h, q_idx, kv_idx):
        return kv_idx < q_idx - 20  # the first 21 queries see nothing

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx]

    bm = create_block_mask(late, None, None, 80, 80, device=DEVICE, BLOCK_SIZE=32)
    out = flex_attention(q, k, v, score_mod=bias, block_mask=bm)
    dq, dk, dv, dtable = torch.autograd.grad(out, (q, k, v, table), torch.randn_like(out))
    for g in (dq, dk, dv, dtable):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[:, :, :21], torch.zeros_like(dq[:, :, :21]))
    assert torch.equal(dtable[:21], torch.zeros_like(dtable[:21]))
    assert torch.equal(dk[:, :, 59:], torch.zeros_like(dk[:, :, 59:]))  # keys no query may see


def test_scale_and_noncontiguous_inputs():
    gen = torch.Generator().manual_seed(7)
    B, H, L, D = 1, 2, 70, 48
    q = torch.randn(B, L, H, D, generator=gen).transpose(1, 2).requires_grad_()
    k = torch.randn(B, L, H, D, generator=gen).transpose(1, 2).requires_grad_()
    v = torch.randn(B, H, D, L, generator=gen).transpose(2, 3).requires_grad_()
    # An expanded (stride-0) grad_out, as out.sum() produces.
    out = flex_attention(q, k, v, scale=0.3)
    ours = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    gold = torch.autograd.grad(flex_attention_reference(q64, k64, v64, scale=0.3).sum(), (q64, k64, v64))
    for a, g in zip(ours, gold):
        assert (a.double() - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item())


def _compare_with_golden(fn, inputs, tol):
    """Gradients of sum(fn(*inputs) * g) against the same through float64 copies."""
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    ours = torch.autograd.grad(out, inputs, g)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    gold = torch.autograd.grad(fn(*inputs64, reference=True), inputs64, g.double())
    for a, ref in zip(ours, gold):
        assert a.shape == ref.shape
        assert (a.double() - ref).norm() <= tol * ref.norm(), (a.double() - ref).norm() / ref.norm()


def test_shared_batch1_cache_and_decode_length_queries():
    # K/V with batch 1 shared by a batch of 3 (their gradient sums over the batch), and a query
    # length of 8, where the forward runs the split-KV decode kernel.
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(3, 4, 8, 32, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 2, 150, 32, generator=gen).requires_grad_() for _ in range(2))
    bias = torch.randn(150, generator=gen).requires_grad_()

    def fn(q, k, v, bias, reference=False):
        def kv_bias(score, b, h, q_idx, kv_idx):
            return score + bias[kv_idx]
        if reference:
            return flex_attention_reference(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1),
                                            score_mod=kv_bias, enable_gqa=True)
        return flex_attention(q, k, v, score_mod=kv_bias, enable_gqa=True)

    _compare_with_golden(fn, [q, k, v, bias], 1e-5)


# score_mods whose derivatives exercise torch's backward formulas (in-place masks in clamp's,
# sgn in abs's, masked_fill in minimum's); t is a (64,) table and c a 0-d tensor, both learnable.
_OP_MODS = {
    "clamp": lambda s, b, h, q, k, t, c: torch.clamp(s, -1.0, 1.0) * c + t[k],
    "where_neg_inf": lambda s, b, h, q, k, t, c: torch.where(q >= k, s * c + t[q - k], float("-inf")),
    "abs_sqrt": lambda s, b, h, q, k, t, c: torch.sqrt(s.abs() + c) * t[h],
    "min_max": lambda s, b, h, q, k, t, c: torch.maximum(s, t[k]) + torch.minimum(s, c),
    "expm1_log1p_pow": lambda s, b, h, q, k, t, c: torch.expm1(s * 0.1) + torch.log1p(s.abs()) * c
    + t[q] * t[k] ** 2,
    "sigmoid_sin_rsqrt": lambda s, b, h, q, k, t, c: torch.sigmoid(s) * torch.sin(t[k]) * torch.rsqrt(c)
    + 1.0 / (s.abs() + c),
}


@pytest.mark.parametrize("name", list(_OP_MODS))
def test_gradients_through_torch_backward_formulas(name):
    gen = torch.Generator().manual_seed(seed_of("ops", name))
    q, k, v = (torch.randn(1, 2, 48, 16, generator=gen).requires_grad_() for _ in range(3))
    t = (0.5 * torch.randn(64, generator=gen)).requires_grad_()
    c = torch.tensor(1.5).requires_grad_()
    body = _OP_MODS[name]

    def fn(q, k, v, t, c, reference=False):
        def op_mod(score, b, h, q_idx, kv_idx):
            return body(score, b, h, q_idx, kv_idx, t, c)
        attend = flex_attention_reference if reference else flex_attention
        return attend(q, k, v, score_mod=op_mod)

    _compare_with_golden(fn, [q, k, v, t, c], 1e-5)


def test_vjp_lowering_reads_no_handwritten_derivative():
    # The generated gradient of softcap is traced from torch's own tanh backward (1 - tanh^2).
    from flexcore.lowering import lower_score_mod
    from flexcore.lowering.vjp import lower_score_mod_backward

    cap = torch.tensor(5.0, requires_grad=True)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    fwd = lower_score_mod(softcap)
    bwd = lower_score_mod_backward(softcap, fwd)
    assert bwd.cap_params == fwd.cap_params and bwd.grad_of == (0,)
    assert "fl_tanh" in bwd.source and "atomic_add" in bwd.source
    assert bwd.grad_params == ("sm_g0_ptr",)


def test_gradcheck_float64():
    # Every entry of the Jacobian (test_float64 checks random directions at default tolerances):
    # L=17 keeps the square kernel (not decode: 16 and under) over a full and a partial block;
    # D=2 (the scores' sum) and Dv=1 keep the entries few; float64 end to end.
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 17, d, generator=gen, dtype=torch.float64).requires_grad_()
               for d in (2, 2, 1))
    slope = torch.rand(1, generator=gen, dtype=torch.float64).requires_grad_()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = create_block_mask(causal, None, None, 17, 17, device=DEVICE, BLOCK_SIZE=16)

    def fn(q, k, v, slope):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slope[h] * (q_idx - kv_idx).abs()
        return flex_attention(q, k, v, score_mod=alibi, block_mask=bm)

    assert torch.autograd.gradcheck(fn, (q, k, v, slope), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_backward_kernels_float64():
    # The backward kernels accumulate in float64 for float64 inputs: fed the reference's own
    # forward outputs, they match autograd to rounding (identity score_mod, masked blocks).
    from flexcore.attention import kv_blocks
    from flexcore.kernels.backward import backward, q_block_tensors
    from flexcore.kernels.forward import row_stats_from_lse
    from flexcore.lowering import lower_mask_mod, lower_score_mod
    from flexcore.lowering.vjp import lower_score_mod_backward

    gen = torch.Generator().manual_seed(4)
    B, H, L, S, D = 1, 2, 40, 56, 16
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64).requires_grad_()
               for n in (L, S, S))

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 16) & (kv_idx > q_idx - 8)

    bm = create_block_mask(window, None, None, L, S, device=DEVICE, BLOCK_SIZE=16)
    out, lse = flex_attention_reference(q, k, v, block_mask=bm, return_lse=True)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    golden = torch.autograd.grad(out, (q, k, v), grad_out)
    score, mask = lower_score_mod(None), lower_mask_mod(window)
    # The reference gives lse only: row_stats_from_lse turns it into the kernels' row statistics.
    dq, dk, dv, caps = backward(q.detach(), k.detach(), v.detach(), out.detach(),
                                row_stats_from_lse(lse.detach()),
                                grad_out, score, lower_score_mod_backward(None, score), mask,
                                kv_blocks(bm, B, H), q_block_tensors(bm, B, H), D ** -0.5,
                                KernelOptions())
    assert caps == []
    for a, g in zip((dq, dk, dv), golden):
        assert a.dtype == torch.float64
        assert (a - g).abs().max() <= 1e-12 * max(1.0, g.abs().max().item())


def _spy_p_from_lse(monkeypatch, bwd) -> list:
    """The P_FROM_LSE constexpr of every preprocessing launch, in order."""
    seen = []
    real = bwd.run

    def spy(kernel, grid, args, kwargs, *rest):
        if "P_FROM_LSE" in kwargs and "BLOCK_M" in kwargs:  # flex_bwd_preprocess
            seen.append(kwargs["P_FROM_LSE"])
        return real(kernel, grid, args, kwargs, *rest)

    monkeypatch.setattr(bwd, "run", spy)
    return seen


# float32 takes (m, 1/l) whatever the policy: one case. 8 queries: the decode kernel runs the
# forward and keeps only lse (row_stats_from_lse).
@pytest.mark.parametrize("p_from_lse,mod_name,dtype,L", [
    (True, "causal", torch.bfloat16, 150), (False, "causal", torch.bfloat16, 150),
    (True, "alibi", torch.bfloat16, 150), (True, "document", torch.float16, 150),
    (False, "causal", torch.float32, 150),
    (True, "document", torch.bfloat16, 8), (False, "alibi", torch.bfloat16, 8)])
def test_probabilities_from_lse2_or_row_stats(monkeypatch, p_from_lse, mod_name, dtype, L):
    """16-bit inputs recompute p = exp2(s - lse2) (lse2 from the preprocessing kernel) unless
    the policy's backward.p_from_lse is off; float32 always uses (m, 1/l). Both against the float64 gradients, at ragged
    lengths with GQA, after the forward kernel and after the decode kernel."""
    from flexcore.kernels import backward as bwd

    seen = _spy_p_from_lse(monkeypatch, bwd)
    shape = Shape("ragged_gqa", B=1, Hq=4, Hkv=2, L=L, S=200, D=32, Dv=32, block=32)
    check_backward(shape, mod_name, dtype, seed=seed_of("bwd_lse2", mod_name, p_from_lse, str(dtype), L),
                   kernel_options=policy_options(backward={"p_from_lse": p_from_lse}))
    assert seen == [p_from_lse and dtype != torch.float32]


# The chosen paths over masks whose runs differ (none, all, some rows; stripes); the tables over two.
@pytest.mark.parametrize("paths,mod_name", [
    ("chosen", "noop"), ("chosen", "causal"), ("chosen", "prefix_lm"), ("chosen", "stripes"),
    ("tables", "causal"), ("tables", "document")])
def test_run_and_table_paths(monkeypatch, mod_name, paths):
    """Full blocks stepped over as one run per row (dK/dV over the transposed tables, dQ over the
    key-block tables) or read from the tables, against the float64 gradients, at ragged lengths
    with GQA; which rows form runs is read from the tables."""
    from flexcore.kernels import forward as fwd

    opts = (policy_options(forward={"full_runs": False, "dense": False}, backward={"full_runs": False})
            if paths == "tables" else None)
    seen = []
    real = fwd.BlockTensors.full_runs

    def spy(self, rows):
        seen.append(real(self, rows))
        return seen[-1]

    monkeypatch.setattr(fwd.BlockTensors, "full_runs", spy)
    shape = Shape("ragged_gqa", B=1, Hq=4, Hkv=2, L=150, S=200, D=32, Dv=32, block=32)
    check_backward(shape, mod_name, torch.float32, seed=seed_of("bwd_paths", mod_name, paths), kernel_options=opts)
    # The forward asks about its key-block tables (not on the dense path), then the backward about
    # the transposed tables and the key-block tables. A stripe of full keys is full for every query.
    expected = {"noop": [True, True], "stripes": [False, True, False]}.get(mod_name, [True] * 3)
    assert seen == ([] if paths == "tables" else expected)


@pytest.mark.parametrize("head_dim,mod_name,expected", [
    (32, "causal", [(2, 6)]),      # runs at head dims up to 64: both tables in one read-back
    (128, "alibi", [(2, 6)]),      # and above with a score_mod
    (128, "causal", [(1, 6)]),     # no runs in this backward: only the forward's tables
])
def test_one_read_back_per_new_mask(monkeypatch, head_dim, mod_name, expected):
    """A forward+backward with a new mask waits on the device once: the forward reads back the
    statistics of the key-block tables and, where the backward will use them, of the transposed
    tables together (the first step's gradients against the float64 reference). Two more steps
    with another mask: one read-back for the first, none for the second, the same gradients."""
    from flexcore.kernels import tables

    calls = []
    real = tables._read_back

    def spy(values):
        calls.append(tuple(values.shape))
        return real(values)

    monkeypatch.setattr(tables, "_read_back", spy)
    shape = Shape("ragged_gqa", B=1, Hq=2, Hkv=1, L=150, S=200, D=head_dim, Dv=head_dim, block=32)
    check_backward(shape, mod_name, torch.float32, seed=seed_of("readback", mod_name, head_dim))
    assert calls == expected

    gen = torch.Generator().manual_seed(seed_of("readback-again", mod_name, head_dim))
    score_mod, mask_mod = make_mods(mod_name, shape, DEVICE, gen)
    bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=shape.block)
    q, k, v = (t.requires_grad_() for t in shape.qkv(torch.float32, DEVICE, gen))
    flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True).sum().backward()
    assert calls == expected * 2
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True).sum().backward()
    assert calls == expected * 2  # the same mask: everything known
    for t, g in zip((q, k, v), grads):
        assert torch.equal(t.grad, g)


def _bwd_launch_spy(monkeypatch, record) -> None:
    """Call ``record(constexprs)`` at every launch of the backward module (``launch`` and ``run``),
    with the tiles that ``launch`` takes positionally under their names."""
    from flexcore.kernels import backward as bwd

    real_launch, real_run = bwd.launch, bwd.run

    def launch_spy(kernel, grid, args, bm, bn, meta, constexprs, **kw):
        names = kw.get("tile_names", ("BLOCK_M", "BLOCK_N"))
        record({names[0]: bm, names[1]: bn, **constexprs})
        return real_launch(kernel, grid, args, bm, bn, meta, constexprs, **kw)

    def run_spy(kernel, grid, args, kwargs, *rest):
        record(kwargs)
        return real_run(kernel, grid, args, kwargs, *rest)

    monkeypatch.setattr(bwd, "launch", launch_spy)
    monkeypatch.setattr(bwd, "run", run_spy)


def _bwd_path_spy(monkeypatch) -> list:
    """(PHASE, DENSE, DKDV_WARP_SPEC, DQ_WARP_SPEC) of every flex_bwd_kernel launch, in order."""
    seen = []

    def record(constexprs):
        if "PHASE" in constexprs:
            seen.append(tuple(constexprs[k] for k in ("PHASE", "DENSE", "DKDV_WARP_SPEC", "DQ_WARP_SPEC")))

    _bwd_launch_spy(monkeypatch, record)
    return seen


_WS_SHAPE = Shape("square_ws", B=1, Hq=3, Hkv=3, L=128, S=256, D=32, Dv=32, block=32)


@pytest.mark.parametrize("shape,mod_name,kind,dense,ws", [
    (_WS_SHAPE, "noop", "dkdv", True, True),
    (_WS_SHAPE, "softcap", "dq", True, True),
    (_WS_SHAPE, "relative_table", "dkdv", True, False),  # captured tensors: never warp-specialized
    (_WS_SHAPE, "alibi", "dkdv", False, False),  # causal: not all full
    (Shape("ragged_gqa", B=1, Hq=4, Hkv=2, L=150, S=200, D=32, Dv=32, block=32), "softcap", "dq", True, False),
    (Shape("gqa", B=1, Hq=4, Hkv=2, L=128, S=128, D=32, Dv=32, block=32), "noop", "dkdv", True, False),
], ids=["noop", "softcap", "relative_table", "alibi", "ragged_gqa", "gqa"])
def test_dense_and_warp_specialized_backward(monkeypatch, shape, mod_name, kind, dense, ws):
    """With the policy's backward.dense and warp_spec forced: all-full masks take the dense loops, the
    chosen kind of program warp-specialized (every tile and row read through descriptors over all
    rows; under the interpreter the loops run unspecialized) where the layout, GQA, lengths and mod
    allow; bf16 gradients against float64."""
    seen = _bwd_path_spy(monkeypatch)
    check_backward(shape, mod_name, torch.bfloat16, seed=seed_of("bwd_ws", mod_name, shape.name),
                   kernel_options=policy_options(backward={"dense": "on", "warp_spec": "on",
                                                           "warp_spec_kinds": (kind,)}))
    assert seen and all(flags[1:] == (dense, ws and kind == "dkdv", ws and kind == "dq") for flags in seen), seen


@pytest.mark.parametrize("head_dim,mod_name,dense", [
    (128, "noop", True), (128, "softcap", False), (64, "noop", False), (128, "causal", False)])
def test_dense_backward_by_default(monkeypatch, head_dim, mod_name, dense):
    """The default rule: the dense loops at head dim 128 without a score_mod; with one only
    warp-specialized, which is off by default; never at 64 (docs/decisions.md#backward-dense-path)."""
    seen = _bwd_path_spy(monkeypatch)
    shape = Shape("dense_default", B=1, Hq=2, Hkv=2, L=64, S=96, D=head_dim, Dv=head_dim, block=32)
    check_backward(shape, mod_name, torch.bfloat16, seed=seed_of("bwd_dense", mod_name, head_dim))
    assert seen and all(flags[1:] == (dense, False, False) for flags in seen), seen


@pytest.mark.parametrize("head_dim,mod_name,score_or_dense", [
    (128, "noop", True), (128, "causal", False), (128, "softcap", True), (128, "alibi", True),
    (128, "document", False), (64, "noop", False), (64, "softcap", True)])
def test_dq_tiles_follow_the_score_mod_and_the_mask(monkeypatch, head_dim, mod_name, score_or_dense):
    """The backward asks for the dQ tiles of a score_mod or a dense mask (docs/decisions.md#backward-tiles)
    exactly when the score_mod is not the identity or the dense loops run; gradients against float64."""
    from flexcore.kernels import backward as bwd

    asked, real = [], bwd._tiles

    def spy(*args):
        asked.append(args[-1])
        return real(*args)

    monkeypatch.setattr(bwd, "_tiles", spy)
    shape = Shape("dq_tiles", B=1, Hq=2, Hkv=2, L=64, S=96, D=head_dim, Dv=head_dim, block=32)
    check_backward(shape, mod_name, torch.bfloat16, seed=seed_of("dq_tiles", mod_name, head_dim))
    assert asked == [score_or_dense]


def test_dq_tiles_on_the_gpu_by_table(monkeypatch):
    """The GPU's tiles (the interpreter takes its own): at head dim 128 a score_mod or a dense mask
    gives dQ programs 64 keys per step at 3 stages, and one launch then keeps 3 stages; other head
    dims and float32 tiles follow their tables."""
    from flexcore.kernels import backward as bwd

    monkeypatch.setattr(bwd, "use_interpreter", lambda: False)
    opts = KernelOptions()
    dkdv, dq = bwd._tiles(opts, 128, 2, 128, 128, True)
    assert (dq[0], dq[1], dq[2]["num_stages"], dq[2]["num_warps"]) == (128, 64, 3, 8)
    assert (dkdv[0], dkdv[1], dkdv[2]["num_stages"]) == (64, 128, 3)
    _, dq = bwd._tiles(opts, 128, 2, 128, 128, False)
    assert (dq[0], dq[1], dq[2]["num_stages"]) == (128, 128, 2)
    _, dq = bwd._tiles(opts, 128, 4, 128, 128, True)  # float32: half the tile, one stage less
    assert (dq[0], dq[1], dq[2]["num_stages"]) == (64, 32, 2)
    assert bwd._tiles(opts, 64, 2, 128, 128, True) == bwd._tiles(opts, 64, 2, 128, 128, False)
    _, dq = bwd._tiles(opts, 128, 2, 32, 32, True)  # mask blocks of 32 bound the tiles
    assert (dq[0], dq[1]) == (32, 32)


def test_warp_spec_rows_follow_the_layout(monkeypatch):
    """Descriptors over all rows need batch and head strides that are multiples of the row stride:
    padded strides qualify, heads-inner memory does not, and then none of the four tensors does."""
    from flexcore.kernels import backward as bwd

    x = torch.randn(2, 3, 64, 32, dtype=torch.bfloat16)
    padded = torch.zeros(2, 4, 80, 32, dtype=torch.bfloat16)[:, :3, :64]
    heads_inner = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert bwd._warp_spec_rows(x, x, x, x, True, "on") == (2 * 3 * 64,) * 4
    assert bwd._warp_spec_rows(padded, x, x, x, True, "on") == (4 * 80 + 2 * 80 + 64, 384, 384, 384)
    assert bwd._warp_spec_rows(x, x, x, heads_inner, True, "on") == (0, 0, 0, 0)
    assert bwd._warp_spec_rows(x, x, x, x, False, "on") == (0, 0, 0, 0)
    odd = torch.randn(2, 3, 64, 48, dtype=torch.bfloat16)  # head dim padded to 64: no descriptors
    assert bwd._warp_spec_rows(odd, odd, odd, odd, True, "on") == (0, 0, 0, 0)


def test_backward_of_a_mask_without_q_tables():
    # compute_q_blocks=False: the backward transposes the key-block tables once per mask and reuses
    # it; an in-place change to the tables afterwards is refused (the transpose would be stale).
    # Gradients against the float64 reference (torch's float32 error as scale).
    from flexcore import attention
    from flexcore.blockmask import BlockMask
    from tests.flexcore.compare import rel_err

    gen = torch.Generator().manual_seed(seed_of("no_q_tables"))
    B, H, L, D, blk = 1, 2, 64, 16, 16
    n = L // blk

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    num = torch.arange(1, n + 1, dtype=torch.int32).expand(B, H, n).contiguous()
    idx = torch.arange(n, dtype=torch.int32).expand(B, H, n, n).contiguous()
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=blk, mask_mod=causal, compute_q_blocks=False)
    assert bm.q_indices is None
    q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
    grad_out = torch.randn(B, H, L, D, generator=gen)

    def check(what):
        grads = torch.autograd.grad(flex_attention(q, k, v, block_mask=bm), (q, k, v), grad_out)
        x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        golden = torch.autograd.grad(flex_attention_reference(*x64, block_mask=bm), x64,
                                     grad_out.double())
        base = torch.autograd.grad(flex_attention_reference(q, k, v, block_mask=bm, upcast=False),
                                   (q, k, v), grad_out)
        for name, g, gold, b in zip("qkv", grads, golden, base):
            assert rel_err(g, gold) <= 2 * rel_err(b, gold) + 1e-6, f"{what}: d{name}"
        return grads

    check("first backward")
    tables = attention._q_blocks(bm, B, H)
    check("second backward")
    assert attention._q_blocks(bm, B, H) is tables  # transposed once
    # Drop the last key block of the last query row in place: refused, with what to do instead.
    bm.kv_num_blocks[..., -1] = n - 1
    with pytest.raises(InputError, match="kv_num_blocks was modified in place"):
        flex_attention(q, k, v, block_mask=bm)
    key = (id(bm), B, H, "q")
    assert key in attention._views_cache
    del bm, tables
    assert key not in attention._views_cache  # entries leave with their mask


# -- GPU -------------------------------------------------------------------------------------------

_GPU_SHAPES = {s.name: s for s in GPU_SHAPES if s.L * s.S <= 4096 * 4096}
# Every variant at 1k in bf16; each other shape with a few variants (each case compiles its own
# kernels, so the full product would take most of an hour).
_GPU_CASES = ([("gpu_1k", m, torch.bfloat16) for m in MOD_NAMES]
              + [("gpu_1k", m, torch.float32) for m in ("causal", "softcap", "relative_table")]
              + [("gpu_ragged", m, torch.bfloat16) for m in ("document", "alibi", "prefix_lm")]
              + [("gpu_gqa", m, torch.bfloat16) for m in ("sliding_window", "relative_table")]
              + [("gpu_d80", m, torch.bfloat16) for m in ("causal", "and_or")]
              + [("gpu_d80", "softcap", torch.float32)]
              + [("gpu_d256", m, torch.bfloat16) for m in ("noop", "alibi")])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape_name,mod_name,dtype", _GPU_CASES,
                         ids=[f"{s}-{m}-{str(d)[6:]}" for s, m, d in _GPU_CASES])
def test_backward_gpu(shape_name, mod_name, dtype):
    check_backward(_GPU_SHAPES[shape_name], mod_name, dtype, seed=seed_of("gpu", mod_name, shape_name),
                   device="cuda")


def _template_backward(**families):
    """Kernel options for GPU tests of the Triton template's backward: the Gluon backward of
    flexcore.kernels.hopper, which would serve their identity-score_mod cases at head dim 128 on an
    sm_90 GPU, is switched off (tests/flexcore/test_hopper.py tests it); ``families`` as
    policy_options takes them."""
    gluon = dict(families.pop("gluon", {}), backward="off")
    return policy_options(gluon=gluon, **families)


_TEMPLATE_CASES = [(s, m) for s in ("gpu_1k", "gpu_gqa") for m in ("noop", "causal", "sliding_window",
                                                                       "prefix_lm", "document")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape_name,mod_name", _TEMPLATE_CASES, ids=[f"{s}-{m}" for s, m in _TEMPLATE_CASES])
def test_backward_template_gpu(monkeypatch, shape_name, mod_name):
    # The masks the Gluon backward serves at head dim 128, on the Triton template it falls back to.
    check_backward(_GPU_SHAPES[shape_name], mod_name, torch.bfloat16,
                   seed=seed_of("gpu_template", mod_name, shape_name), device="cuda",
                   kernel_options=_template_backward())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape_name,mod_name", [("gpu_1k", "causal"), ("gpu_1k", "alibi"),
                                                 ("gpu_ragged", "prefix_lm"), ("gpu_ragged", "document"),
                                                 ("gpu_gqa", "sliding_window"), ("gpu_ragged", "stripes")])
def test_backward_table_path_gpu(monkeypatch, shape_name, mod_name):
    # Every full block read from the tables (the matrix above steps over runs wherever they apply);
    # stripes has no runs on either path.
    opts = (_template_backward() if mod_name == "stripes"
            else _template_backward(forward={"full_runs": False}, backward={"full_runs": False}))
    check_backward(_GPU_SHAPES[shape_name], mod_name, torch.bfloat16,
                   seed=seed_of("gpu_tables", mod_name, shape_name), device="cuda", kernel_options=opts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape_name,mod_name", [("gpu_1k", "causal"), ("gpu_1k", "softcap"),
                                                 ("gpu_ragged", "document"), ("gpu_d256", "alibi")])
def test_backward_row_stats_path_gpu(monkeypatch, shape_name, mod_name):
    # 16-bit inputs with probabilities from (m, 1/l) instead of lse2 (test_backward_gpu covers lse2).
    from flexcore.kernels import backward as bwd

    seen = _spy_p_from_lse(monkeypatch, bwd)
    check_backward(_GPU_SHAPES[shape_name], mod_name, torch.bfloat16,
                   seed=seed_of("gpu_rowstats", mod_name, shape_name), device="cuda",
                   kernel_options=_template_backward(backward={"p_from_lse": False}))
    assert seen == [False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape_name,mod_name,forced,dense,ws", [
    ("gpu_1k", "noop", False, True, False), ("gpu_1k", "softcap", False, False, False),
    ("gpu_1k", "alibi", False, False, False), ("gpu_1k", "noop", True, True, True),
    # head dim 64: 4-warp tiles, never warp-specialized on the GPU (a forced run once gave NaN)
    ("gpu_ws64", "softcap", True, True, False), ("gpu_ws64", "noop", True, True, False),
    ("gpu_1k", "relative_table", True, True, False), ("gpu_gqa", "softcap", True, True, False),
    ("gpu_ragged", "softcap", True, True, False), ("gpu_ws64", "softcap", False, False, False)])
def test_backward_dense_and_warp_specialized_gpu(monkeypatch, shape_name, mod_name, forced, dense, ws):
    """The dense backward and its warp-specialized loops on the GPU (compiled with the
    specialization), by the default rule or forced, against float64; 4-warp tiles (head dim 64),
    captured tensors, GQA and ragged lengths fall back."""
    shape = _GPU_SHAPES.get(shape_name) or Shape("gpu_ws64", B=2, Hq=4, Hkv=4, L=1024, S=1024, D=64,
                                                 Dv=64, block=128)
    opts = _template_backward(backward={"dense": "on", "warp_spec": "on"} if forced else {})
    seen = _bwd_path_spy(monkeypatch)
    check_backward(shape, mod_name, torch.bfloat16, seed=seed_of("gpu_ws", mod_name, shape_name, forced),
                   device="cuda", kernel_options=opts)
    assert seen and all(flags[1:] == (dense, ws, False) for flags in seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["dkdv", "dq"])
@pytest.mark.parametrize("mod_name", ["noop", "softcap"])
def test_warp_specialized_backward_repeats_bit_identically_gpu(monkeypatch, mod_name, kind):
    """dQ, dK and dV use no atomics, so repeated backward passes must agree bit for bit: a race in
    the warp-specialized loops (as seen at 4 warps, and with both kinds specialized at once) would
    show as a difference or a NaN."""
    opts = _template_backward(backward={"dense": "on", "warp_spec": "on", "warp_spec_kinds": (kind,)})
    seen = _bwd_path_spy(monkeypatch)
    shape = Shape("gpu_ws_repeat", B=4, Hq=16, Hkv=16, L=2048, S=2048, D=128, Dv=128, block=128)
    gen = torch.Generator().manual_seed(seed_of("gpu_ws_repeat", mod_name))
    q, k, v = (t.cuda().requires_grad_() for t in shape.qkv(torch.bfloat16, "cpu", gen))
    score_mod, _ = make_mods(mod_name, shape, "cuda", gen)
    grad_out = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
    first = None
    for _ in range(8):
        grads = torch.autograd.grad(flex_attention(q, k, v, score_mod=score_mod, kernel_options=opts), (q, k, v),
                                    grad_out)
        assert all(torch.isfinite(g).all() for g in grads)
        if first is None:
            first = grads
        assert all(torch.equal(a, b) for a, b in zip(grads, first))
    assert seen and all(flags[1:] == (True, kind == "dkdv", kind == "dq") for flags in seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [None, True, False], ids=["tuned", "one-launch", "two-launches"])
@pytest.mark.parametrize("mod_name,dq_block_n", [("noop", 64), ("causal", 128), ("softcap", 64),
                                                 ("alibi", 64)])
def test_dq_tiles_by_mod_gpu(monkeypatch, fused, mod_name, dq_block_n):
    """At head dim 128 the dQ programs step over 64 keys with a score_mod or a dense mask and over
    128 with a partial mask alone (docs/decisions.md#backward-tiles), in either launch layout; gradients
    against float64. On the mask's own 128x128 tables: the finer tables (forward.refine) take
    64-key tiles of their own."""
    layout = {None: "auto", True: "on", False: "off"}[fused]
    opts = _template_backward(backward={"fused": layout}, forward={"refine": "off"})
    seen = set()

    def record(constexprs):  # one launch (PHASE 0) or the dQ programs' own (PHASE 2)
        if constexprs.get("PHASE") in (0, 2):
            seen.add(constexprs["DQ_BLOCK_N"])

    _bwd_launch_spy(monkeypatch, record)
    check_backward(_GPU_SHAPES["gpu_1k"], mod_name, torch.bfloat16, seed=seed_of("gpu_dq_tiles", mod_name),
                   device="cuda", kernel_options=opts)
    assert seen == {dq_block_n}, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("learnable", LEARNABLE)
def test_captured_gradients_gpu(learnable):
    shape = Shape("gpu_cap", B=2, Hq=8, Hkv=2, L=1000, S=1531, D=64, Dv=64, block=128)
    check_backward(shape, "causal", torch.bfloat16, seed=seed_of("gpucap", learnable), learnable=learnable,
                   device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused,tma", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["two-launches", "two-launches-tma", "one-launch", "one-launch-tma"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_launch_layouts_gpu(monkeypatch, fused, tma, head_dim):
    opts = _template_backward(backward={"fused": "on" if fused else "off", "tma": "on" if tma else "off"})
    shape = Shape("gpu_layout", B=2, Hq=8, Hkv=2, L=1000, S=1531, D=head_dim, Dv=head_dim, block=128)
    check_backward(shape, "document", torch.bfloat16, seed=seed_of("gpulayout", fused, tma, head_dim),
                   device="cuda", kernel_options=opts)
    check_backward(shape, "alibi", torch.bfloat16, seed=seed_of("gpulayout-alibi", fused, tma, head_dim),
                   device="cuda", kernel_options=opts)
    check_backward(shape, "causal", torch.float32, seed=seed_of("gpulayout-cap", fused, tma, head_dim),
                   learnable="alibi_slope", device="cuda", kernel_options=opts)
    check_backward(shape, "causal", torch.bfloat16, seed=seed_of("gpulayout-cap16", fused, tma, head_dim),
                   learnable="alibi_slope", device="cuda", kernel_options=opts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deterministic_gpu():
    shape = Shape("gpu_det", B=2, Hq=4, Hkv=4, L=4096, S=4096, D=64, Dv=64, block=128)
    opts = KernelOptions(deterministic=True)
    runs = [check_backward(shape, "causal", torch.bfloat16, seed=5, learnable=name, kernel_options=opts,
                           device="cuda", return_grads=True)
            for name in ("relative_table", "relative_table", "alibi_slope", "alibi_slope")]
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, b in zip(runs[2], runs[3]):
        assert torch.equal(a, b)


def test_backward_module_is_built_once_per_mods():
    # The backward's module is cached by the mods' sources: later calls skip filling the template.
    from flexcore.kernels import backward as bwd
    from flexcore.lowering import lower_mask_mod, lower_score_mod
    from flexcore.lowering.vjp import lower_score_mod_backward

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 3

    def other(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 4

    score = lower_score_mod(None)
    score_bwd = lower_score_mod_backward(None, score)
    first = bwd.backward_module(score, score_bwd, lower_mask_mod(window))
    assert bwd.backward_module(score, score_bwd, lower_mask_mod(window)) is first
    assert bwd.backward_module(score, score_bwd, lower_mask_mod(other)) is not first


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mod", ["softcap", "alibi_learnable", "alibi_learnable_causal"])
def test_activation_checkpointing(mod, compiled):
    """flex_attention inside torch.utils.checkpoint (non-reentrant) on its first call: the
    lowering's traces set the checkpoint's saved-tensor hooks aside (torch.func refused to run
    under them, and the traces' saved tensors made the recomputation count fewer). Gradients
    equal the call without checkpointing, and match float64. Compiled: torch.compile without
    fullgraph (Dynamo runs the checkpointed region eagerly)."""
    from torch.utils.checkpoint import checkpoint

    from flexcore.lowering.api import clear_cache

    clear_cache()
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("checkpoint", mod, compiled))
    slopes = (torch.rand(2, generator=gen) + 0.1).requires_grad_(True)
    if mod == "softcap":
        def score_mod(score, b, h, q_idx, kv_idx):
            return 4.0 * torch.tanh(score / 4.0)
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)
    bm = None
    if mod.endswith("causal"):
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 64, 64,
                               device=DEVICE, BLOCK_SIZE=32)
    x = torch.randn(1, 2, 64, 16, generator=gen, requires_grad=True)
    weights = torch.randn(1, 2, 64, 16, generator=gen)
    tensors = (x, slopes)

    def layer(x, attention=flex_attention):
        return attention(x * 0.5, x, x.flip(2), score_mod=score_mod, block_mask=bm)

    def checkpointed(x):
        return checkpoint(layer, x, use_reentrant=False)

    run = torch.compile(checkpointed, backend="aot_eager") if compiled else checkpointed
    got = torch.autograd.grad((run(x) * weights).sum(), tensors, allow_unused=True, materialize_grads=True)
    plain = torch.autograd.grad((layer(x) * weights).sum(), tensors, allow_unused=True, materialize_grads=True)
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    gold = torch.autograd.grad((layer(x, flex_attention_reference) * weights).sum(), tensors,
                               allow_unused=True, materialize_grads=True)
    for a, b in zip(got, gold):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)
    assert got[0].abs().sum() > 0


def test_reference_under_activation_checkpointing():
    """The float64 reference's index checks trace the mod on its first call: under a checkpoint's
    saved-tensor hooks that made the recomputation save fewer tensors (CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    from flexcore.lowering.api import clear_cache

    clear_cache()
    gen = torch.Generator().manual_seed(seed_of("reference_checkpoint"))
    slopes = (torch.rand(2, generator=gen, dtype=torch.float64) + 0.1).requires_grad_(True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    x = torch.randn(1, 2, 32, 8, generator=gen, dtype=torch.float64, requires_grad=True)

    def layer(x):
        return flex_attention_reference(x, x, x, score_mod=alibi)

    got = torch.autograd.grad(checkpoint(layer, x, use_reentrant=False).sum(), (x, slopes))
    plain = torch.autograd.grad(layer(x).sum(), (x, slopes))
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["sign_of_score", "bucket_of_score", "additive"])
def test_gradient_of_a_table_indexed_by_the_score(form):
    """A captured tensor indexed by a value of the score (not of q or kv): each position adds its
    gradient at its own address (the backward summed the tile and added the total at every
    address it read). Against autograd through the float64 reference."""
    gen = torch.Generator().manual_seed(seed_of("score_index", form))
    bias = torch.randn(2, 4, generator=gen, requires_grad=True)
    mods = {
        "sign_of_score": lambda score, b, h, q_idx, kv_idx: score * bias[h, (score > 0).long()],
        "bucket_of_score": lambda score, b, h, q_idx, kv_idx:
            score + bias[h, (score.abs() * 2).long().clamp_max(3)],
        "additive": lambda score, b, h, q_idx, kv_idx: score + bias[h, (score > 0).long()],
    }
    score_mod = mods[form]
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen, requires_grad=True) for _ in range(3))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 64, 64,
                           device=DEVICE, BLOCK_SIZE=32)
    weights = torch.randn(1, 2, 64, 16, generator=gen)
    tensors = (q, k, v, bias)
    got = torch.autograd.grad((flex_attention(q, k, v, score_mod=score_mod, block_mask=bm) * weights).sum(),
                              tensors)
    gold = torch.autograd.grad((flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)
                                * weights).sum(), tensors)
    base = torch.autograd.grad((flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=bm,
                                                         upcast=False) * weights).sum(), tensors)
    from tests.flexcore.compare import rel_err

    for name, g, expected, b in zip(("dq", "dk", "dv", "dbias"), got, gold, base):
        assert rel_err(g, expected) <= 2 * rel_err(b, expected) + 1e-5, name
