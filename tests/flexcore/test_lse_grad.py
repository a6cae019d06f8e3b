"""The lse as the kernels return it: its gradient (``grad_lse`` of flexcore.kernels.backward.backward)
on every backward path, its value on edge rows, and the row max (max_scores), against the float64
reference's autograd and torch's flex_attention.

The kernels are called directly, as an autograd function with a differentiable lse calls them
(:func:`kernel_grads`): the forward kernel (the decode kernel for short queries), then the backward
with ``grad_lse``. Every gradient must satisfy ``err(ours) <= 2 * err(torch, same dtype) + eps``
against the float64 golden of the loss ``(out * g).sum() + (lse * h).sum()``.
"""
from __future__ import annotations

import math

import pytest
import torch

from flexcore import KernelOptions, create_block_mask
from flexcore.errors import InputError
from flexcore.kernels import backward as bwd
from flexcore.kernels import forward as fwd
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference
from tests.flexcore.cases import Shape, make_mods
from tests.flexcore.compare import seed_of
from tests.flexcore.helpers import backward_tables_spy, check_lse_grads, kernel_grads, reference_grads
from tests.flexcore.policies import policy_options

DEVICE = "cpu"


SMALL = Shape("small", B=2, Hq=2, Hkv=2, L=128, S=128, D=32, Dv=32, block=64)
RAGGED = Shape("ragged", B=1, Hq=2, Hkv=2, L=100, S=150, D=32, Dv=16, block=32)  # ragged ends, Dv != D
GQA = Shape("gqa", B=1, Hq=4, Hkv=2, L=96, S=96, D=32, Dv=32, block=32)
DECODE = Shape("decode", B=2, Hq=4, Hkv=2, L=8, S=200, D=32, Dv=32, block=64)  # the decode kernel's forward
WS = Shape("ws", B=1, Hq=2, Hkv=2, L=128, S=128, D=32, Dv=32, block=32)  # lengths dividing the tiles


@pytest.mark.parametrize("case", ["split", "fused", "bf16_lse2", "bf16_row_stats", "tables", "runs", "ragged",
                                  "gqa", "dense", "warp_spec", "decode"])
def test_lse_gradient_on_every_template_path(monkeypatch, case):
    """grad_lse enters every layout and loop of the template backward: two launches and one, lse2
    and (m, 1/l) probabilities, block tables and runs of full blocks, ragged and GQA shapes, the dense
    and warp-specialized loops, and the rows of the decode kernel's forward."""
    backward = {"fused": "on" if case == "fused" else "off"}
    forward = {}
    if case == "bf16_row_stats":
        backward["p_from_lse"] = False
    if case == "tables":
        backward["full_runs"] = forward["full_runs"] = False
    if case in ("dense", "warp_spec"):
        backward.update(dense="on", warp_spec="on" if case == "warp_spec" else "off")
    opts = policy_options(forward=forward, backward=backward)
    seen = []
    real = bwd.launch

    def spy(kernel, grid, args, bm, bn, meta, constexprs, **kw):
        seen.append((constexprs["PHASE"], constexprs["DENSE"], constexprs["DKDV_WARP_SPEC"]))
        return real(kernel, grid, args, bm, bn, meta, constexprs, **kw)

    monkeypatch.setattr(bwd, "launch", spy)
    shape, mod_name = {"ragged": (RAGGED, "document"), "gqa": (GQA, "sliding_window"), "dense": (SMALL, "noop"),
                       "warp_spec": (WS, "noop"), "decode": (DECODE, "causal"),
                       "tables": (SMALL, "document"), "runs": (SMALL, "prefix_lm")}.get(case, (SMALL, "causal"))
    dtype = torch.bfloat16 if case in ("bf16_lse2", "bf16_row_stats", "gqa", "warp_spec", "decode") else torch.float32
    check_lse_grads(shape, mod_name, dtype, seed_of("lse_grad", case), opts=opts)
    if case == "fused":
        assert seen == [], seen  # one launch goes through run, not launch
    else:
        assert [s[0] for s in seen] == [1, 2], seen
    if case in ("dense", "warp_spec"):
        assert all(s[1] and s[2] == (case == "warp_spec") for s in seen), seen


@pytest.mark.parametrize("exact_delta", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_gradient_of_a_captured_tensor(monkeypatch, exact_delta, dtype):
    """A learnable bias: with the policy's backward.exact_delta the pass that recomputes
    delta = rowsum(P * dP) also takes grad_lse off; without it the preprocessing kernel does."""
    opts = policy_options(backward={"exact_delta": exact_delta})
    phases = []
    real = bwd.launch
    monkeypatch.setattr(bwd, "launch", lambda kernel, grid, args, bm, bn, meta, constexprs, **kw: (
        phases.append(constexprs["PHASE"]), real(kernel, grid, args, bm, bn, meta, constexprs, **kw))[1])
    check_lse_grads(SMALL, "causal", dtype, seed_of("lse_grad_bias", exact_delta, str(dtype)), learnable=True,
                    opts=opts)
    assert phases[0] == 3 if exact_delta else 3 not in phases, phases


def test_lse_gradient_over_finer_tables(monkeypatch):
    """The backward over the mask's tables refined to 64x64 blocks (the policy's forward.refine)."""
    sizes = backward_tables_spy(monkeypatch)
    shape = Shape("refine", B=1, Hq=2, Hkv=2, L=256, S=256, D=32, Dv=32, block=128)
    check_lse_grads(shape, "document", torch.float32, seed_of("lse_grad_refine"),
                    opts=policy_options(forward={"refine": "on"}))
    assert sizes == [(64, 64)], sizes


def test_zero_grad_lse_is_none_bit_for_bit():
    gen = torch.Generator().manual_seed(seed_of("lse_grad_zero"))
    q, k, v = SMALL.qkv(torch.float32, DEVICE, gen)
    _, mask_mod = make_mods("causal", SMALL, DEVICE, gen)
    bm = create_block_mask(mask_mod, None, None, SMALL.L, SMALL.S, device=DEVICE, BLOCK_SIZE=SMALL.block)
    grad_out = torch.randn(q.shape, generator=gen)
    _, _, _, none = kernel_grads(q, k, v, None, bm, grad_out, None)
    _, _, _, zero = kernel_grads(q, k, v, None, bm, grad_out, torch.zeros(q.shape[:3]))
    for a, b in zip(none, zero):
        assert torch.equal(a, b)


def test_plans_replay_the_new_grad_lse(decided):
    """A plan replays its launches with each call's grad_lse (not the first call's); None and a
    given grad_lse are different plans."""
    gen = torch.Generator().manual_seed(seed_of("lse_grad_plans"))
    q, k, v = SMALL.qkv(torch.float32, DEVICE, gen)
    _, mask_mod = make_mods("causal", SMALL, DEVICE, gen)
    bm = create_block_mask(mask_mod, None, None, SMALL.L, SMALL.S, device=DEVICE, BLOCK_SIZE=SMALL.block)
    grad_out = torch.randn(q.shape, generator=gen)
    lses = [torch.randn(q.shape[:3], generator=gen), torch.randn(q.shape[:3], generator=gen), None, None]
    expected_decisions = [1, 1, 2, 2]
    for grad_lse, decisions in zip(lses, expected_decisions):
        h = torch.zeros(q.shape[:3]) if grad_lse is None else grad_lse
        _, _, _, ours = kernel_grads(q, k, v, None, bm, grad_out, grad_lse)
        _, _, golden = reference_grads(q, k, v, None, bm, grad_out, h, upcast=True)
        _, _, baseline = reference_grads(q, k, v, None, bm, grad_out, h, upcast=False)
        for name, a, g, b in zip(("dq", "dk", "dv"), ours, golden, baseline):
            assert_close_to_reference(a, g, b, metric="rel_fro", atol=1e-6, name=f"call {decisions}: {name}")
        assert decided["backward"] == decisions


def _late_causal(b, h, q_idx, kv_idx):  # query rows below 40 keep nothing
    return (q_idx >= 40) & (kv_idx <= q_idx)


def _rows_without_keys(device):
    """grad_lse on rows whose every key is masked (lse = -inf) against the reference and, where
    given a device on which torch's flex_attention has a backward, against torch's."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    L = S = 96
    gen = torch.Generator().manual_seed(seed_of("lse_grad_empty_rows"))
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(device) for n in (L, S, S))
    grad_out = torch.randn(q.shape, generator=gen).to(device)
    grad_lse = torch.randn(q.shape[:3], generator=gen).to(device)
    bm = create_block_mask(_late_causal, None, None, L, S, device=device, BLOCK_SIZE=32)
    _, lse, _, ours = kernel_grads(q, k, v, None, bm, grad_out, grad_lse)
    assert torch.isinf(lse[..., :40]).all() and (lse[..., :40] < 0).all()
    assert all(torch.isfinite(g).all() for g in ours)
    assert ours[0][..., :40, :].abs().max() == 0  # no key: no query gradient
    _, _, golden = reference_grads(q, k, v, None, bm, grad_out, grad_lse, upcast=True)
    for name, a, g in zip(("dq", "dk", "dv"), ours, golden):
        assert (a.double() - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name
    torch_bm = torch_block_mask(_late_causal, None, None, L, S, device=device)
    if device == "cpu":  # torch's eager flex_attention has no backward on the CPU: its lse only
        _, lse_t = torch_flex(q, k, v, block_mask=torch_bm, return_lse=True)
        assert torch.equal(torch.isinf(lse_t), torch.isinf(lse))
        return
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out_t, lse_t = torch_flex(*inputs, block_mask=torch_bm, return_lse=True)
    torch_grads = torch.autograd.grad((out_t, lse_t), inputs, (grad_out, grad_lse))
    for name, a, t in zip(("dq", "dk", "dv"), ours, torch_grads):
        assert torch.isfinite(t).all()
        assert (a - t).abs().max() <= 1e-4 * max(1.0, t.abs().max().item()), name


def test_rows_without_keys_get_no_lse_gradient():
    """Rows whose every key is masked take no gradient from their grad_lse: zero dq there, finite
    gradients equal to the reference's."""
    _rows_without_keys(DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_without_keys_as_torch_gpu():
    """The same on the GPU, also against torch's flex_attention's gradients (lse included)."""
    _rows_without_keys("cuda")


def test_grad_lse_of_a_wrong_shape_or_dtype_is_refused():
    gen = torch.Generator().manual_seed(0)
    q, k, v = SMALL.qkv(torch.float32, DEVICE, gen)
    grad_out = torch.randn(q.shape, generator=gen)
    with pytest.raises(InputError, match=r"grad_lse must have the lse's shape \(B, Hq, L\) = \(2, 2, 128\)"):
        kernel_grads(q, k, v, None, None, grad_out, torch.zeros(2, 2, 127))
    with pytest.raises(InputError, match="grad_lse must be a floating-point tensor"):
        kernel_grads(q, k, v, None, None, grad_out, torch.zeros(2, 2, 128, dtype=torch.int64))


# -- the lse and the row max on edge rows ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("decode", [False, True])
def test_lse_is_inf_where_a_score_is_inf(dtype, decode):
    """+inf in k gives +inf scores (for positive q components): lse +inf there, as torch's and the
    float64 reference's (it was NaN); the output is NaN there, as theirs."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    gen = torch.Generator().manual_seed(seed_of("lse_inf", str(dtype), decode))
    L = 8 if decode else 64
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=dtype) for n in (L, 96, 96))
    k[0, 0, 5, 0] = float("inf")
    k[0, 1, 70, 3] = float("inf")
    out, lse, row_stats, _ = kernel_grads(q, k, v, None, None, None, None, opts={"decode": decode})
    gold, gold_lse = flex_attention_reference(q, k, v, return_lse=True)
    torch_out, torch_lse = torch_flex(q, k, v, return_lse=True)
    plus = torch.cat([q[0, 0, :, 0] > 0, q[0, 1, :, 3] > 0]).view(1, 2, L)
    assert plus.any() and (~plus).any()  # both kinds of rows are there
    assert torch.equal(lse == float("inf"), plus) and torch.equal(gold_lse == float("inf"), plus)
    assert torch.equal(torch_lse == float("inf"), plus)
    assert torch.equal(out.isnan(), gold.isnan()) and torch.equal(out.isnan(), torch_out.isnan())
    fin = ~plus
    assert (lse[fin].double() - gold_lse[fin]).abs().max() <= (1e-12 if dtype == torch.float64 else 1e-5)
    if not decode or dtype == torch.float64:  # the forward kernel's own row statistics
        assert torch.equal(fwd.max_scores(row_stats) == float("inf"), plus)


def _row_max_golden(q, k, score_mod, bm, scale=None):
    """The row max of the modded, masked scores in float64 (-inf where a row keeps nothing)."""
    from flexcore.blockmask import create_mask

    q64, k64 = q.double(), k.double()
    s = (q64 @ k64.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    B, H, L, S = s.shape
    if score_mod is not None:
        idx = [torch.arange(n).view(*shape) for n, shape in
               ((B, (-1, 1, 1, 1)), (H, (1, -1, 1, 1)), (L, (1, 1, -1, 1)), (S, (1, 1, 1, -1)))]
        s = score_mod(s, *idx).double()
    if bm is not None:
        keep = create_mask(bm.mask_mod, B, H, L, S, device=q.device)
        s = s.masked_fill(~keep, float("-inf"))
    return s.amax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mod_name", ["causal_empty_rows", "alibi"])
def test_max_scores_of_the_forward(dtype, mod_name):
    """flexcore.kernels.forward.max_scores(row_stats): the row max in natural units, -inf on rows
    without a kept key; within float32 rounding of the float64 max (float64: to rounding)."""
    shape = Shape("max", B=2, Hq=2, Hkv=2, L=96, S=96, D=32, Dv=32, block=32)
    gen = torch.Generator().manual_seed(seed_of("max_scores", str(dtype), mod_name))
    q, k, v = shape.qkv(dtype, DEVICE, gen)
    if mod_name == "alibi":
        score_mod, mask_mod = make_mods("alibi", shape, DEVICE, gen)
    else:
        score_mod = None

        def mask_mod(b, h, q_idx, kv_idx):  # rows below 20 keep nothing
            return (q_idx >= 20) & (kv_idx <= q_idx)
    bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=shape.block)
    _, _, row_stats, _ = kernel_grads(q, k, v, score_mod, bm, None, None)
    got = fwd.max_scores(row_stats)
    gold = _row_max_golden(q, k, score_mod, bm)
    assert got.shape == gold.shape and got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(torch.isinf(got), torch.isinf(gold))
    if mod_name != "alibi":
        assert torch.isinf(got[..., :20]).all() and (got[..., :20] < 0).all()
    fin = torch.isfinite(gold)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    assert (got[fin].double() - gold[fin]).abs().max() <= tol * max(1.0, gold[fin].abs().max().item())


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_scores_of_the_decode_kernel(dtype, num_splits):
    """decode(..., return_max_scores=True): the same row max from one split or merged over several
    (float64 runs the forward kernel, see decode's docstring), -inf on rows without a key, +inf on a
    row with a +inf score."""
    from flexcore import attention
    from flexcore.kernels.decode import decode
    from flexcore.lowering import lower_mask_mod, lower_score_mod

    shape = Shape("dec", B=2, Hq=4, Hkv=2, L=4, S=300, D=32, Dv=32, block=64)
    gen = torch.Generator().manual_seed(seed_of("decode_max", str(dtype), num_splits))
    q, k, v = shape.qkv(dtype, DEVICE, gen)
    k[1, 1, 250, 0] = float("inf")  # heads 2 and 3 of batch 1 read KV head 1

    def mask_mod(b, h, q_idx, kv_idx):  # head 0 keeps nothing
        return (h > 0) & (kv_idx <= q_idx + 296)
    bm = create_block_mask(mask_mod, None, shape.Hq, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=shape.block)
    score, mask = lower_score_mod(None, torch.float64 if dtype == torch.float64 else torch.float32), \
        lower_mask_mod(mask_mod)
    out, lse, got = decode(q, k, v, score, mask, attention.kv_blocks(bm, shape.B, shape.Hq), shape.D ** -0.5,
                           KernelOptions(), num_splits=num_splits, return_max_scores=True)
    gold = _row_max_golden(q, k.repeat_interleave(2, dim=1), None, bm)
    assert got.dtype == lse.dtype
    assert torch.equal(torch.isinf(got), torch.isinf(gold)) and torch.equal(got == math.inf, gold == math.inf)
    assert torch.isinf(got[:, 0]).all() and (got[:, 0] < 0).all()
    fin = torch.isfinite(gold)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    assert (got[fin].double() - gold[fin]).abs().max() <= tol * max(1.0, gold[fin].abs().max().item())
    # The plain call returns (out, lse) as before, the same values.
    out2, lse2 = decode(q, k, v, score, mask, attention.kv_blocks(bm, shape.B, shape.Hq), shape.D ** -0.5,
                        KernelOptions(), num_splits=num_splits)
    assert torch.equal(out.nan_to_num(), out2.nan_to_num()) and torch.equal(lse, lse2)
