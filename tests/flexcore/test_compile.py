"""flex_attention under torch.compile (flexcore.ops), and the eager call's cache of prepared calls.

A compiled model must trace in one graph (``torch._dynamo.explain`` counts no break), and give
eager's outputs and gradients, captured tensors' included, with static and dynamic shapes. The
model test runs Inductor end to end; the variations run the ``aot_eager`` backend, which traces
the same graph and the same autograd through the ops without compiling the linear layers (each
Inductor compile takes seconds on the CPU). Everything runs flexcore's real kernels under Triton's
interpreter, at tiny shapes.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from flexcore import AuxRequest, create_block_mask, flex_attention, ops
from flexcore import attention
from flexcore.errors import UnsupportedOpError
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference
from tests.flexcore.compare import seed_of
from tests.flexcore.helpers import BLOCK_HEAD_DIM as D
from tests.flexcore.helpers import BLOCK_HEADS as H
from tests.flexcore.helpers import AttentionBlock, causal, run_block


def assert_same(got, expected, what):
    out, grads = got
    out0, grads0 = expected
    torch.testing.assert_close(out, out0, rtol=1e-5, atol=1e-5, msg=f"{what}: output")
    assert grads.keys() == grads0.keys()
    for name in grads0:
        torch.testing.assert_close(grads[name], grads0[name], rtol=1e-4, atol=1e-5,
                                   msg=f"{what}: gradient of {name}")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_model_matches_eager_and_float64(dynamic):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed_of("model", dynamic))
    model = AttentionBlock()
    L = 64
    x = torch.randn(2, L, H * D, generator=g)
    weights = torch.randn(2, L, H * D, generator=g)
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)

    assert torch._dynamo.explain(model)(x, bm).graph_break_count == 0
    eager = run_block(model, x, bm, weights)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    got = run_block(compiled, x, bm, weights)
    assert_same(got, eager, "compiled")
    assert got[1]["slopes"].abs().min() > 0

    # The same model on the float64 reference; torch's own float32 error sets the tolerance.
    golden = AttentionBlock(lambda *a, **kw: flex_attention_reference(*a, **kw, upcast=True)).double()
    golden.load_state_dict(model.state_dict())
    gold = run_block(golden, x.double(), bm, weights.double())
    baseline = AttentionBlock(lambda *a, **kw: flex_attention_reference(*a, **kw, upcast=False))
    baseline.load_state_dict(model.state_dict())
    base = run_block(baseline, x, bm, weights)
    assert_close_to_reference(got[0], gold[0], base[0], name="out", metric="rel_fro")
    for name in gold[1]:
        assert_close_to_reference(got[1][name], gold[1][name], base[1][name], name=name,
                                  metric="rel_fro")

    # Another batch size (dynamic: the same graph) and another length with its own mask.
    for B, L2 in ((3, 64), (2, 32)):
        x2 = torch.randn(B, L2, H * D, generator=g)
        w2 = torch.randn(B, L2, H * D, generator=g)
        bm2 = bm if L2 == L else create_block_mask(causal, None, None, L2, L2, device="cpu",
                                                   BLOCK_SIZE=32)
        assert_same(run_block(compiled, x2, bm2, w2), run_block(model, x2, bm2, w2), f"B={B} L={L2}")


# -- the forms a score_mod takes, with the tensors it reads ------------------------------------

GLOBAL_BIAS = torch.randn(H, requires_grad=True)


def global_bias(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_BIAS[h]


class Forms(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.slopes = nn.Parameter(torch.rand(H) + 0.1)
        self.table = torch.randn(64, 64, requires_grad=True)  # a plain tensor with a gradient

    def method(self, score, b, h, q_idx, kv_idx):
        return score - self.slopes[h] * (q_idx - kv_idx).abs()

    def forward(self, q, k, v, block_mask):
        table = self.table

        def nested_self(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx >= kv_idx, score * self.slopes[h], score)

        def nested_table(score, b, h, q_idx, kv_idx):  # nested indexing: per-element semantics
            return score + table[q_idx][kv_idx]

        mods = {"method": self.method, "nested_self": nested_self, "nested_table": nested_table,
                "global": global_bias}
        return flex_attention(q, k, v, score_mod=mods[self.form], block_mask=block_mask)


def run_attention(fn, tensors, weights):
    """(output, gradients of ``tensors``) of (fn() * weights).sum(); gradients are reset."""
    for t in tensors:
        t.grad = None
    out = fn()
    (out * weights).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


def qkv(L, S=None, Hkv=H, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    S = L if S is None else S
    return (torch.randn(B, H, L, D, generator=g, requires_grad=True),
            torch.randn(B, Hkv, S, D, generator=g, requires_grad=True),
            torch.randn(B, Hkv, S, D, generator=g, requires_grad=True))


@pytest.mark.parametrize("form", ["method", "nested_self", "nested_table", "global"])
def test_score_mod_forms(form):
    torch._dynamo.reset()
    model = Forms(form)
    q, k, v = qkv(64, seed=seed_of("forms", form))
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    captured = {"method": [model.slopes], "nested_self": [model.slopes],
                "nested_table": [model.table], "global": [GLOBAL_BIAS]}[form]
    tensors = [q, k, v, *captured]
    weights = torch.randn(q.shape)
    assert torch._dynamo.explain(model)(q, k, v, bm).graph_break_count == 0
    eager = run_attention(lambda: model(q, k, v, bm), tensors, weights)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, grads = run_attention(lambda: compiled(q, k, v, bm), tensors, weights)
    torch.testing.assert_close(out, eager[0], rtol=1e-6, atol=1e-6)
    for got, expected in zip(grads, eager[1]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert grads[-1].abs().sum() > 0


def test_mask_mod_reading_a_tensor():
    """A document mask whose ids tensor is a graph input: updating it in place (to documents of
    the same blocks) reaches the kernel without recompiling."""
    torch._dynamo.reset()
    L = 64
    doc = torch.tensor([0] * 20 + [1] * 30 + [2] * 14)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    bm = create_block_mask(document, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    q, k, v = qkv(L, seed=3)
    weights = torch.randn(q.shape)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=bm)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for step in range(2):
        got = run_attention(lambda: compiled(q, k, v), [q, k, v], weights)
        eager = run_attention(lambda: fn(q, k, v), [q, k, v], weights)
        gold = flex_attention_reference(q, k, v, block_mask=bm)
        torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
        for a, b in zip(got[1], eager[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(got[0], gold.float(), rtol=1e-4, atol=1e-5)
        doc[25:30] = 7  # a new document inside blocks the mask already lists as partial


@pytest.mark.parametrize("case", ["no_mask", "gqa", "decode"])
def test_call_variants(case):
    """No BlockMask (the all-full mask), grouped-query heads, and a decoding-length query (the
    decode kernel, whose backward derives the row statistics from its lse)."""
    torch._dynamo.reset()
    if case == "no_mask":
        q, k, v = qkv(64, seed=5)
        bm, kwargs = None, {}
    elif case == "gqa":
        q, k, v = qkv(64, Hkv=1, seed=6)
        bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
        kwargs = {"enable_gqa": True}
    else:
        q, k, v = qkv(8, 64, seed=7)

        def cache_causal(b, h, q_idx, kv_idx):
            return q_idx + 56 >= kv_idx

        bm = create_block_mask(cache_causal, None, None, 8, 64, device="cpu", BLOCK_SIZE=32)
        kwargs = {}
    weights = torch.randn(q.shape)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=bm, **kwargs)

    assert torch._dynamo.explain(fn)(q, k, v).graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = run_attention(lambda: compiled(q, k, v), [q, k, v], weights)
    eager = run_attention(lambda: fn(q, k, v), [q, k, v], weights)
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
    for a, b in zip(got[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    gold = flex_attention_reference(q, k, v, block_mask=bm, **kwargs)
    torch.testing.assert_close(got[0], gold.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("L,S", [(64, 64), (8, 64)], ids=["forward", "decode"])
def test_compiled_aux(L, S):
    """return_aux under torch.compile: lse and max_scores as eager's, and the lse's gradient."""
    torch._dynamo.reset()
    q, k, v = qkv(L, S, seed=seed_of("aux", L))
    slopes = torch.rand(H, requires_grad=True)
    offset = S - L

    def gapped(b, h, q_idx, kv_idx):
        return (q_idx + offset >= kv_idx) & (q_idx % 5 != 2)

    bm = create_block_mask(gapped, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    w_lse = torch.randn(q.shape[:3])

    def fn(q, k, v):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + offset - kv_idx)

        out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=bm,
                                  return_aux=AuxRequest(lse=True, max_scores=True))
        lse = torch.where(torch.isinf(aux.lse), 0.0, aux.lse)
        return out, lse, aux.max_scores

    def run(f):
        for t in (q, k, v, slopes):
            t.grad = None
        out, lse, max_scores = f(q, k, v)
        assert not max_scores.requires_grad
        (out.sum() + (lse * w_lse).sum()).backward()
        return out.detach(), lse.detach(), max_scores, [t.grad.clone() for t in (q, k, v, slopes)]

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, eager = run(compiled), run(fn)
    for a, b in zip(got[:3], eager[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(got[3], eager[3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.isinf(got[2]).any() and got[3][3].abs().sum() > 0


def test_inference_and_kernel_options():
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=9)
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)

    def fn(q, k, v):
        with torch.no_grad():
            return flex_attention(q, k, v, block_mask=bm,
                                  kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})

    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert not out.requires_grad
    torch.testing.assert_close(out, fn(q, k, v), rtol=0, atol=0)


def test_kernel_options_from_arguments_that_change():
    """A compiled function whose kernel options come from its arguments: on the second value
    Dynamo makes the argument a symbolic int, which the call specialises on (one graph per value)
    instead of failing to pass it as a constant. Each call runs with its own tiles."""
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=11)
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)

    def fn(q, k, v, block_m):
        return flex_attention(q, k, v, block_mask=bm, kernel_options={"BLOCK_M": block_m, "BLOCK_N": 16})

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for block_m in (16, 32, 16):
        torch.testing.assert_close(compiled(q, k, v, block_m), fn(q, k, v, block_m), rtol=0, atol=0,
                                   msg=f"BLOCK_M={block_m}")
        assert any(spec.opts.BLOCK_M == block_m and spec.opts.BLOCK_N == 16
                   for spec in ops._calls.values()), block_m


def test_a_mask_built_inside_a_compiled_function():
    """create_block_mask inside the compiled function runs eagerly between graphs (a mask that
    depends on an argument gives each call its own mask); with fullgraph=True the error says so
    and what to do, instead of failing inside its host-side work."""
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=12)

    def fn(q, k, v, shift):
        def shifted(b, h, q_idx, kv_idx):
            return q_idx + shift >= kv_idx
        bm = create_block_mask(shifted, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
        return flex_attention(q, k, v, block_mask=bm)

    compiled = torch.compile(fn, backend="aot_eager")
    for shift in (0, 8):
        torch.testing.assert_close(compiled(q, k, v, shift), fn(q, k, v, shift), rtol=0, atol=0,
                                   msg=f"shift={shift}")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="create_block_mask runs eagerly: build the mask outside"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, 0)
    from flexcore import create_mask

    with pytest.raises(Exception, match="create_mask runs eagerly"):
        torch.compile(lambda q: q * create_mask(causal, None, None, 64, 64, device="cpu")[0, 0, :, :16],
                      fullgraph=True, backend="aot_eager")(q[0, 0])


def test_kernel_options_come_back_from_their_plain_form_unchanged():
    # What Dynamo passes to register_call as a constant, and back: dataclasses at any depth,
    # inside dicts and tuples, and tuples of plain values.
    from flexcore import KernelOptions
    from flexcore.kernels.policy import DispatchPolicy

    policy = DispatchPolicy().replace(forward={"refine": "off"})
    for options in (None, {"BLOCK_M": 16, "policy": policy}, KernelOptions(BLOCK_N=32, policy=policy),
                    {"pair": (policy, 3), "dims": (64, 128)}):
        plain = ops._plain(options)
        back = ops._rebuilt(plain)
        assert (dict(back) if isinstance(options, dict) else back) == options, options


@pytest.mark.parametrize("form", ["options", "dict"])
def test_kernel_options_holding_a_policy(form):
    """kernel_options holding a DispatchPolicy (nested frozen dataclasses), as a KernelOptions or
    inside a dict, compile in one graph and reach the call unchanged; the same compiled function
    given another policy recompiles and registers it."""
    from flexcore import KernelOptions
    from flexcore.kernels.policy import DispatchPolicy

    torch._dynamo.reset()
    q, k, v = qkv(64, seed=10)
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    block_n = {"options": 16, "dict": 32}[form]  # each form registers calls of its own
    held = {}
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=bm,
                                                      kernel_options=held["options"]),
                       fullgraph=True, backend="aot_eager")
    results = []
    for refine in ("off", "on"):
        policy = DispatchPolicy().replace(forward={"refine": refine}, launch={"inline": "off"})
        held["options"] = (KernelOptions(BLOCK_M=16, BLOCK_N=block_n, policy=policy) if form == "options"
                           else {"BLOCK_M": 16, "BLOCK_N": block_n, "policy": policy})
        results.append(fn(q, k, v))
        expected = KernelOptions(BLOCK_M=16, BLOCK_N=block_n, policy=policy)
        assert any(spec.opts == expected for spec in ops._calls.values()), refine
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


TABLE = torch.randn(H, 8)


@pytest.mark.parametrize("form", ["slice", "new_axis", "step_ellipsis"])
def test_indexing_with_slices_and_new_axes(form):
    """A captured tensor indexed by an index tensor beside slices or ``None``: eager's values and
    gradients (the table's included), where Dynamo used to read the 0-d index's value."""
    torch._dynamo.reset()
    table = (TABLE + 0).requires_grad_(True)
    mods = {
        "slice": lambda score, b, h, q_idx, kv_idx: score + table[h, 0:4][kv_idx % 4],
        "new_axis": lambda score, b, h, q_idx, kv_idx: score * table[None, h][0, q_idx % 8],
        "step_ellipsis": lambda score, b, h, q_idx, kv_idx: score + table[h, ::2][..., (q_idx + kv_idx) % 4],
    }
    score_mod = mods[form]
    q, k, v = qkv(64, seed=seed_of("slices", form))
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    tensors = [q, k, v, table]
    weights = torch.randn(q.shape)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, grads = run_attention(lambda: compiled(q, k, v), tensors, weights)
    eager = run_attention(lambda: fn(q, k, v), tensors, weights)
    torch.testing.assert_close(out, eager[0], rtol=1e-6, atol=1e-6)
    for got, expected in zip(grads, eager[1]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert grads[-1].abs().sum() > 0
    gold = run_attention(lambda: flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=bm),
                         tensors, weights)
    torch.testing.assert_close(out, gold[0].float(), rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, gold[1]):
        torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("when", ["after_first_call", "before_first_call"])
def test_tables_edited_in_place_are_refused_as_in_eager(when):
    """A BlockMask table edited in place leaves the transposed tables stale: the compiled call
    refuses it as eager does, whether the edit came before its first run or between runs. A mask
    rebuilt from the edited tables runs."""
    from flexcore.blockmask import BlockMask
    from flexcore.errors import InputError

    torch._dynamo.reset()
    q, k, v = qkv(64, seed=seed_of("in_place", when))
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    masks = {"bm": bm}

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=masks["bm"])

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    if when == "after_first_call":
        compiled(q, k, v).sum().backward()
    bm.kv_num_blocks[0, 0, 1] = 0  # query block 1 drops its partial (diagonal) block
    for call in (fn, compiled):
        with pytest.raises(InputError, match="kv_num_blocks was modified in place"):
            call(q, k, v).sum().backward()
    copy.copy(bm)  # a copy over the same tables keeps their recorded versions
    with pytest.raises(InputError, match="kv_num_blocks was modified in place"):
        compiled(q, k, v)

    # Tables refilled in place (here with their first contents) and a mask built anew over them:
    # the user vouches for the contents again, so it runs, with caches of its own.
    bm.kv_num_blocks[0, 0, 1] = 1
    masks["bm"] = BlockMask(**{f.name: getattr(bm, f.name) for f in dataclasses.fields(bm)})
    weights = torch.randn(q.shape)
    out, grads = run_attention(lambda: compiled(q, k, v), [q, k, v], weights)
    eager = run_attention(lambda: fn(q, k, v), [q, k, v], weights)
    torch.testing.assert_close(out, eager[0], rtol=0, atol=0)
    for got, expected in zip(grads, eager[1]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

    masks["bm"] = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                           bm.full_kv_indices, BLOCK_SIZE=32, mask_mod=causal,
                                           seq_lengths=(64, 64))
    weights = torch.randn(q.shape)
    out, grads = run_attention(lambda: compiled(q, k, v), [q, k, v], weights)
    gold = run_attention(lambda: flex_attention_reference(q, k, v, block_mask=masks["bm"]), [q, k, v],
                         weights)
    torch.testing.assert_close(out, gold[0].float(), rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, gold[1]):
        torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-4)


def test_python_constants_of_a_mod_are_guarded():
    """A mod's Python constant (a bias scale) is part of the recorded program: changing it
    retraces, and the compiled call follows."""
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=10)
    setting = {"scale": 0.5}

    def fn(q, k, v):
        c = setting["scale"]

        def linear_bias(score, b, h, q_idx, kv_idx):
            return score - c * (q_idx - kv_idx)

        return flex_attention(q, k, v, score_mod=linear_bias)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    outs = []
    for c in (0.5, 0.125):
        setting["scale"] = c
        outs.append(compiled(q, k, v))
        torch.testing.assert_close(outs[-1], fn(q, k, v), rtol=0, atol=0)
    assert not torch.allclose(outs[0], outs[1])


def test_unsupported_mod_fails_with_its_name():
    """The lowering's own error, naming the mod and the op, from the compiled call's first run."""
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=11)

    def bessel(score, b, h, q_idx, kv_idx):
        return torch.special.bessel_j0(score)

    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=bessel), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(UnsupportedOpError,
                       match=r"in bessel: torch.special.bessel_j0 .*torch.compile"):
        compiled(q, k, v)


@pytest.mark.parametrize("case", ["read_from_values", "static", "in_range"])
def test_compiled_index_checks_read_the_calls_tensors(case):
    """The compiled call checks its indices on the call's own captured tensors (the lowering
    traced stand-ins of them), with eager's ModIndexError, also where the check evaluates the
    index over the grid inside the op's kernel; an index in range runs and matches float64."""
    from flexcore.errors import ModIndexError

    torch._dynamo.reset()
    q, k, v = qkv(64, seed=13)
    table = torch.randn(10)
    picks = torch.tensor([0, 3]) if case == "in_range" else torch.tensor([0, 100])

    def by_head(score, b, h, q_idx, kv_idx):
        return score * table[picks[h]]

    def by_query(score, b, h, q_idx, kv_idx):  # 64 queries into 10 entries
        return score + table[q_idx]

    mod = by_query if case == "static" else by_head
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=mod), fullgraph=True,
                             backend="aot_eager")
    if case == "in_range":
        with torch.no_grad():
            got, eager = compiled(q, k, v), flex_attention(q, k, v, score_mod=mod)
        torch.testing.assert_close(got, eager, rtol=0, atol=0)
        gold = flex_attention_reference(q, k, v, score_mod=mod)
        torch.testing.assert_close(got, gold.float(), rtol=1e-4, atol=1e-5)
        return
    with pytest.raises(ModIndexError, match=r"index out of range.*size 10.*torch\.compile"):
        compiled(q, k, v)
    with pytest.raises(ModIndexError, match=r"index out of range.*size 10"):  # eager says the same
        flex_attention(q, k, v, score_mod=mod)


def test_a_scale_that_changes_between_compiled_calls():
    """A scale Dynamo makes symbolic (it changed between calls) is checked in flexcore's op, where
    its value is known: finite ones run as eager calls do, NaN is refused."""
    from flexcore.errors import InputError

    torch._dynamo.reset()
    q, k, v = (t.detach() for t in qkv(64, seed=15))
    compiled = torch.compile(lambda q, k, v, s: flex_attention(q, k, v, scale=s), fullgraph=True,
                             backend="aot_eager")
    for scale in (0.3, 0.4, 0.5):
        torch.testing.assert_close(compiled(q, k, v, scale), flex_attention(q, k, v, scale=scale),
                                   rtol=0, atol=0)
    with pytest.raises(InputError, match="scale must be a finite real number.*nan"):
        compiled(q, k, v, math.nan)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_mod_reading_a_value_in_python_fails_as_eager(fullgraph):
    """.item() on an index in a mod under torch.compile: eager's ControlFlowError, not the
    value the recording saw (0) kept as a constant."""
    from flexcore.errors import ControlFlowError

    torch._dynamo.reset()
    q, k, v = qkv(64, seed=14)

    def by_item(score, b, h, q_idx, kv_idx):
        return score * (kv_idx.item() + 1)

    def by_log(score, b, h, q_idx, kv_idx):  # what follows the use must trace on the stand-in value
        return score + math.log(float(kv_idx)) / int(q_idx)

    for mod in (by_item, by_log):
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=mod),
                                 fullgraph=fullgraph, backend="aot_eager")
        with pytest.raises(ControlFlowError, match=rf"in {mod.__name__}.*needs the tensor's value"):
            compiled(q, k, v)


# -- the ops themselves --------------------------------------------------------------------------

def registered_call(L=64, seed=12, kernel_options=None):
    """(args of flexcore::flex_attention_forward, slopes) for a causal ALiBi call."""
    attention.ready()
    g = torch.Generator().manual_seed(seed)
    slopes = torch.rand(H, generator=g, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx) * 0.5

    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    device = torch.device("cpu")
    score = ops.record(alibi, "score", torch.float32, device)
    mask = ops.record(causal, "mask", torch.float32, device)
    call = ops.register_call(score.constants, mask.constants, torch.float32, "cpu", kernel_options, False)
    # Queries laid out (B, L, H, D) in memory: the output keeps that order.
    q = torch.randn(2, L, H, D, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, H, L, D, generator=g, requires_grad=True) for _ in range(2))
    tables = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
              bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    args = (q, k, v, *tables, score.captured, mask.captured, score.ints, score.floats, mask.ints,
            mask.floats, [*bm.BLOCK_SIZE, *bm.seq_lengths], call, 1 / math.sqrt(D))
    assert score.floats == [0.5]
    return args, slopes


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_opcheck_forward_op(sinks):
    """Schema, fake implementation (shapes, dtypes, strides), autograd registration and tracing
    with dynamic shapes, as torch.library checks them; with learnable sinks, whose gradient
    the op's autograd gives."""
    args, _ = registered_call()
    if sinks:
        args = (*args, torch.randn(H, generator=torch.Generator().manual_seed(3), requires_grad=True))
    torch.library.opcheck(torch.ops.flexcore.flex_attention_forward.default, args)


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_opcheck_backward_op(sinks):
    args, slopes = registered_call()
    q, k, v = (t.detach() for t in args[:3])
    with_sinks = (torch.randn(H, generator=torch.Generator().manual_seed(4)),) if sinks else ()
    out, lse, row_stats = torch.ops.flexcore.flex_attention_forward(q, k, v, *args[3:], *with_sinks)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    score_caps = [t.detach() for t in args[11]]  # the backward op itself is not differentiable
    bwd_args = (q, k, v, out, row_stats, grad_out, grad_lse, *args[3:11], score_caps, *args[12:],
                *((lse, *with_sinks) if sinks else ()))
    # The backward op has no gradient of its own (no double backward): its aot_dispatch check,
    # which differentiates through the op, does not apply.
    torch.library.opcheck(torch.ops.flexcore.flex_attention_backward.default, bwd_args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    dq, dk, dv, (dslopes,), sink_grads = torch.ops.flexcore.flex_attention_backward(*bwd_args)
    assert dslopes.shape == slopes.shape and dslopes.abs().sum() > 0
    assert len(sink_grads) == int(sinks)
    if sinks:
        # The sink backward op (only the sinks learn) gives the same gradient from the delta pass.
        torch.library.opcheck(torch.ops.flexcore.flex_attention_sink_backward.default, bwd_args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        alone = torch.ops.flexcore.flex_attention_sink_backward(*bwd_args)
        assert alone.shape == (H,) and alone.dtype == with_sinks[0].dtype
        torch.testing.assert_close(alone, sink_grads[0], rtol=1e-5, atol=1e-6)


def test_inline_forward_op_against_float64():
    """The inline forward op (the kernel Inductor launches; eagerly here, through the interpreter)
    on a causal ALiBi call whose queries are laid out (B, L, H, D): output and lse as the float64
    reference within twice torch's own error, the output in the query's stride order, and the
    gradients through its registered autograd equal to those through flexcore's forward op."""
    from flexcore.kernels.policy import DispatchPolicy

    # float32 (the interpreter's) is not inline's by default: the policy asks for it.
    args, slopes = registered_call(L=96, kernel_options={
        "policy": DispatchPolicy().replace(launch={"inline": "on"})})
    q, k, v = args[:3]
    assert ops.inline_call(args) is not None  # the op's body takes the inline forward
    out, lse, _ = torch.ops.flexcore.flex_attention_forward_inline(*args)
    assert out.stride() == torch.ops.flexcore.flex_attention_forward(*args)[0].stride()
    bm = create_block_mask(causal, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)

    def alibi_of(s):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - s[h] * (q_idx - kv_idx) * 0.5
        return alibi

    gold, gold_lse = flex_attention_reference(q.double(), k.double(), v.double(),
                                              score_mod=alibi_of(slopes.double()), block_mask=bm,
                                              return_lse=True, upcast=True)
    base, base_lse = flex_attention_reference(q, k, v, score_mod=alibi_of(slopes), block_mask=bm,
                                              return_lse=True, upcast=False)
    assert_close_to_reference(out, gold, base, name="out", metric="rel_fro")
    assert_close_to_reference(lse, gold_lse, base_lse, name="lse", metric="rel_fro")
    weights = torch.randn_like(out)
    grads = []
    for op in (torch.ops.flexcore.flex_attention_forward_inline, torch.ops.flexcore.flex_attention_forward):
        o, l, _ = op(*args)
        grads.append(torch.autograd.grad((o * weights).sum() + l.sum(), (q, k, v, slopes)))
    for name, a, b in zip(("dq", "dk", "dv", "dslopes"), *grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_inline_forward_choice():
    """The launch policy's inline rule: on CUDA, 16-bit calls with static shapes and numbers up to
    inline_max_flops of dense-equivalent work, and with "on" float32 ones of any size; never
    float64, head dims above 128, CPU tensors (without "on"), decode-length queries, run-time
    index checks, a policy that forces a Gluon forward, symbolic sizes or numbers, or "off"."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from flexcore.kernels.policy import DispatchPolicy

    def choice(dtype=torch.bfloat16, L=1024, D=64, device="meta", numbers=(), **options):
        options.setdefault("policy", DispatchPolicy())
        spec = ops.spec_of(ops.register_call(None, None, dtype, "cpu", options, False))
        q = torch.empty(2, 8, L, D, dtype=dtype, device=device)
        kv = torch.empty(2, 8, 1024, D, dtype=dtype, device=device)
        if device == "meta":  # stands in for CUDA: the rule reads the device type only
            q = FakeCuda(q)
        return ops.inline_forward(spec, q, kv, kv, (128, 128, *numbers, 0.125))

    env = ShapeEnv()
    big = DispatchPolicy().replace(launch={"inline_max_flops": 1e9})
    on = DispatchPolicy().replace(launch={"inline": "on"})
    assert choice()
    assert choice(torch.float16, numbers=(3, 0.5))
    assert not choice(torch.float32)
    assert choice(torch.float32, policy=on)
    assert not choice(torch.float64, policy=on)
    assert not choice(D=256, policy=on)
    assert not choice(device="cpu")  # without "on" under the interpreter
    assert not choice(L=16)
    assert not choice(check_indices=True)
    assert not choice(policy=DispatchPolicy().replace(gluon={"masked": "on"}))
    assert not choice(numbers=(env.create_unbacked_symint(),))
    assert not choice(numbers=(env.create_unbacked_symfloat(),))
    assert not choice(policy=DispatchPolicy().replace(launch={"inline": "off"}))
    assert not choice(policy=big)
    assert choice(policy=big.replace(launch={"inline": "on"}))



def _inline_args(score_mod, mask_mod, L, Hq, Hkv, policy, seed, block_mask=None, **options):
    """(args of the inline forward op, q, k, v, BlockMask or None) of a float32 call (the
    interpreter's dtype) under ``policy``; ``block_mask``: the mask_mod's BlockMask, if not the
    one create_block_mask builds."""
    attention.ready()
    g = torch.Generator().manual_seed(seed)
    device = torch.device("cpu")
    score = None if score_mod is None else ops.record(score_mod, "score", torch.float32, device)
    mask = None if mask_mod is None else ops.record(mask_mod, "mask", torch.float32, device)
    call = ops.register_call(None if score is None else score.constants,
                             None if mask is None else mask.constants, torch.float32, "cpu",
                             {"policy": policy, **options}, False)
    q = torch.randn(2, Hq, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(2, Hkv, L, D, generator=g, requires_grad=True) for _ in range(2))
    bm, block, tables = None, [], [None] * 8
    if mask_mod is not None:
        bm = block_mask or create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=32)
        block = [*bm.BLOCK_SIZE, *bm.seq_lengths]
        tables = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                  bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    pick = lambda r, name: [] if r is None else getattr(r, name)  # noqa: E731
    args = (q, k, v, *tables, pick(score, "captured"), pick(mask, "captured"), pick(score, "ints"),
            pick(score, "floats"), pick(mask, "ints"), pick(mask, "floats"), block, call, 1 / math.sqrt(D))
    return args, q, k, v, bm


@pytest.mark.parametrize("case", ["causal_alibi_lse", "dense_gqa_softcap", "fused_deterministic",
                                  "no_full_blocks"])
def test_inline_backward_op_against_float64(case):
    """The inline backward (the kernels Inductor launches; eagerly here, through the interpreter),
    reached through the inline forward op's registered autograd: dq, dk, dv and a captured tensor's
    gradient as the float64 reference within twice torch's own error, and bit for bit as
    flexcore's backward op. Cases: a causal ALiBi mask whose loss reads the lse; no mask (the dense
    path) with grouped heads, a length the tiles do not divide and a tanh soft-cap; one launch for
    both kinds of program (backward.fused "on") with deterministic captured gradients; a causal
    mask given as tables without full blocks (BlockMask.from_kv_blocks)."""
    from flexcore import BlockMask
    from flexcore.kernels.policy import DispatchPolicy

    g = torch.Generator().manual_seed(seed_of(case))
    Hq, Hkv, L = (4, 2, 80) if case == "dense_gqa_softcap" else (H, H, 96)
    slopes = torch.rand(Hq, generator=g).requires_grad_()

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def softcap(score, b, h, q_idx, kv_idx):
        return 4.0 * torch.tanh(score / 4.0) + slopes[h]

    score_mod = softcap if case == "dense_gqa_softcap" else alibi
    mask_mod = None if case == "dense_gqa_softcap" else causal
    policy = DispatchPolicy().replace(launch={"inline": "on", "inline_backward": "on"},
                                      backward={"fused": "on" if case == "fused_deterministic" else "off"})
    given = None
    if case == "no_full_blocks":  # every kept block listed as partial
        n = L // 32
        given = BlockMask.from_kv_blocks(
            torch.arange(1, n + 1, dtype=torch.int32).view(1, 1, n),
            torch.arange(n, dtype=torch.int32).expand(1, 1, n, n).contiguous(), BLOCK_SIZE=32,
            mask_mod=causal, seq_lengths=(L, L))
        assert given.full_kv_num_blocks is None
    args, q, k, v, bm = _inline_args(score_mod, mask_mod, L, Hq, Hkv, policy, seed_of(case), block_mask=given,
                                     deterministic=case == "fused_deterministic")
    assert ops.inline_backward_call(args) is not None  # the backward op's body takes the inline path
    weights = torch.randn(2, Hq, L, D, generator=g)
    lse_weights = torch.randn(2, Hq, L, generator=g) if case == "causal_alibi_lse" else torch.zeros(2, Hq, L)
    wanted = (q, k, v, slopes)
    grads = {}
    for name, op in (("inline", torch.ops.flexcore.flex_attention_forward_inline),
                     ("flexcore", torch.ops.flexcore.flex_attention_forward)):
        o, lse, _ = op(*args)
        grads[name] = torch.autograd.grad((o * weights).sum() + (lse * lse_weights).sum(), wanted)

    def reference(dtype, upcast):
        leaves = [t.detach().to(dtype).requires_grad_() for t in wanted]
        qr, kr, vr, sr = leaves

        def mod(score, b, h, q_idx, kv_idx):
            return (4.0 * torch.tanh(score / 4.0) + sr[h] if case == "dense_gqa_softcap"
                    else score - sr[h] * (q_idx - kv_idx).abs())
        o, lse = flex_attention_reference(qr, kr, vr, score_mod=mod, block_mask=bm, return_lse=True,
                                          enable_gqa=Hq != Hkv, upcast=upcast)
        loss = (o * weights.to(dtype)).sum() + (lse * lse_weights.to(dtype)).sum()
        return torch.autograd.grad(loss, leaves)

    gold, base = reference(torch.float64, True), reference(torch.float32, False)
    for name, ours, same, ref, torch_same in zip(("dq", "dk", "dv", "dslopes"), grads["inline"],
                                                 grads["flexcore"], gold, base):
        assert_close_to_reference(ours, ref, torch_same, name=f"{case} {name}", metric="rel_fro")
        # The same kernels and tiles as the eager backward under the interpreter.
        torch.testing.assert_close(ours, same, rtol=0, atol=0, msg=f"{case} {name}")


def test_inline_backward_choice():
    """The launch policy's inline_backward rule: auto by default, where the forward's inline
    rule takes the call; on wherever the inline forward applies; never with a forced Gluon
    backward, a mask without its transposed tables, or no mask where the dense path is off."""
    from flexcore.kernels.policy import DispatchPolicy

    def choice(mask=True, **launch):
        policy = DispatchPolicy().replace(launch=launch)
        args = _inline_args(None, causal if mask else None, 64, H, H, policy, 3)[0]
        return ops.inline_backward_call(args) is not None, args

    assert choice(inline="on")[0]  # inline_backward "auto" follows the forward
    assert not choice(inline="on", inline_backward="off")[0]
    assert choice(inline="on", inline_backward="auto")[0]
    assert not choice(inline="auto", inline_backward="auto")[0]  # the interpreter is inline only with "on"
    assert choice(inline="auto", inline_backward="on")[0]
    assert choice(mask=False, inline="off", inline_backward="on")[0]
    forced = DispatchPolicy().replace(launch={"inline_backward": "on"}, gluon={"backward": "on"})
    assert ops.inline_backward_call(_inline_args(None, causal, 64, H, H, forced, 3)[0]) is None
    no_dense = DispatchPolicy().replace(launch={"inline_backward": "on"}, backward={"dense": "off"})
    assert ops.inline_backward_call(_inline_args(None, None, 64, H, H, no_dense, 3)[0]) is None
    assert ops.inline_backward_call(_inline_args(None, causal, 64, H, H, no_dense, 3)[0]) is not None
    _, args = choice(inline_backward="on")
    without_q_tables = (*args[:7], None, None, None, None, *args[11:])
    assert ops.inline_backward_call(without_q_tables) is None


def test_opcheck_inline_backward_op():
    """The inline backward op's schema and autograd registration (its inputs require grad: the
    check runs on them), as torch.library checks them, on the inline path."""
    from flexcore.kernels.policy import DispatchPolicy

    policy = DispatchPolicy().replace(launch={"inline": "on", "inline_backward": "on"})
    args, q, k, v, _ = _inline_args(None, causal, 64, H, H, policy, 5)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, row_stats = torch.ops.flexcore.flex_attention_forward_inline(q, k, v, *args[3:])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bwd_args = (q, k, v, out, row_stats, torch.randn_like(out), torch.randn_like(lse), *args[3:])
    assert ops.inline_backward_call((q, k, v, *args[3:])) is not None
    # Its fake implementation is not checked here: under the interpreter the fake tensors would
    # be launched on (Inductor traces the launches instead, on CUDA).
    torch.library.opcheck(torch.ops.flexcore.flex_attention_backward_inline.default, bwd_args,
                          test_utils=("test_schema", "test_autograd_registration"))


class FakeCuda:
    """A tensor's shape, dtype and a CUDA device, as inline_forward reads them."""

    def __init__(self, t):
        self.shape, self.dtype, self.device = t.shape, t.dtype, torch.device("cuda")


def test_inline_call_leaves_evaluated_index_checks_to_flexcores_op():
    """A mod whose index check evaluates index expressions (not provable from value ranges) is not
    served inline: that check reads tensors, which are fake while Inductor traces the op."""
    from flexcore.kernels.policy import DispatchPolicy

    attention.ready()
    table = torch.ones(64, dtype=torch.int64)

    def roundabout(b, h, q_idx, kv_idx):
        return table[q_idx - kv_idx + kv_idx] > 0

    device = torch.device("cpu")
    mask = ops.record(roundabout, "mask", torch.float32, device)
    options = {"policy": DispatchPolicy().replace(launch={"inline": "on"})}
    call = ops.register_call(None, mask.constants, torch.float32, "cpu", options, False)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    bm = create_block_mask(roundabout, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    tables = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
              bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    args = (q, k, v, *tables, [], mask.captured, [], [], mask.ints, mask.floats,
            [*bm.BLOCK_SIZE, *bm.seq_lengths], call, 0.25)
    assert ops.inline_call(args) is None
    causal_call = ops.register_call(None, ops.record(causal, "mask", torch.float32, device).constants,
                                    torch.float32, "cpu", options, False)
    assert ops.inline_call((*args[:-2], causal_call, 0.25)) is not None


def test_registry_keys_are_structural():
    """A key names a recorded program, not its numbers: the same mod with another number (or
    another closure object) has the same key; another program another key."""
    attention.ready()
    device = torch.device("cpu")

    def make(shift, square=False):
        def mod(score, b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return score + shift * (d * d if square else d)
        return mod

    recorded = [ops.record(make(s, sq), "score", torch.float32, device)
                for s, sq in ((0.5, False), (0.25, False), (0.5, True))]
    keys = [ops.register_call(r.constants, None, torch.float32, "cpu", None, False) for r in recorded]
    assert keys[0] == keys[1] != keys[2]
    assert recorded[0].floats == [0.5] and recorded[1].floats == [0.25]
    spec = ops.spec_of(keys[0])
    half = spec.lowered(((), (0.5,), (), ())).score.source
    assert half == spec.lowered(((), (0.5,), (), ())).score.source
    assert half != spec.lowered(((), (0.25,), (), ())).score.source


# -- the eager call's prepared calls -------------------------------------------------------------

def test_prepared_calls_are_reused_and_follow_the_mask(monkeypatch):
    """A repeated call skips the checks; assigning a BlockMask's mask_mod (a new state) is seen."""
    checks = []
    real = attention.validate_inputs
    monkeypatch.setattr(attention, "validate_inputs", lambda *a: checks.append(1) or real(*a))
    q, k, v = (t.detach() for t in qkv(64, seed=13))
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    first = flex_attention(q, k, v, block_mask=bm)
    second = flex_attention(q, k, v, block_mask=bm)
    assert len(checks) == 1 and torch.equal(first, second)

    def nothing_before_16(b, h, q_idx, kv_idx):  # keeps a subset of each block's causal positions
        return (q_idx >= kv_idx) & (kv_idx >= 16)

    bm.mask_mod = nothing_before_16
    out = flex_attention(q, k, v, block_mask=bm)
    assert len(checks) == 2
    torch.testing.assert_close(out, flex_attention_reference(q, k, v, block_mask=bm).float(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss", ["out", "lse"])
def test_unused_output_gradient_arrives_as_none(loss, monkeypatch):
    """The forward ops' registered backward gets None, not a materialised zero tensor, for an
    output the loss does not read (under torch.compile each zero gradient is one more launch per
    step); a loss on the lse alone still gives the float64 reference's gradients."""
    from flexcore.kernels.policy import DispatchPolicy

    policy = DispatchPolicy().replace(launch={"inline": "on", "inline_backward": "on"})
    args, q, k, v, bm = _inline_args(None, causal, 64, H, H, policy, seed_of(loss))
    seen = []
    backward = ops._backward

    def spy(ctx, grad_out, grad_lse, grad_row_stats, op=None):
        seen.append((grad_out is None, grad_lse is None, grad_row_stats is None))
        return backward(ctx, grad_out, grad_lse, grad_row_stats, op=op)

    monkeypatch.setattr(ops, "_backward", spy)
    for op in (torch.ops.flexcore.flex_attention_forward_inline, torch.ops.flexcore.flex_attention_forward):
        o, lse, _ = op(*args)
        grads = torch.autograd.grad(o.sum() if loss == "out" else lse.sum(), (q, k, v))
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        o_ref, lse_ref = flex_attention_reference(*leaves, block_mask=bm, return_lse=True)
        gold = torch.autograd.grad(o_ref.sum() if loss == "out" else lse_ref.sum(), leaves, allow_unused=True,
                                   materialize_grads=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o_base, lse_base = flex_attention_reference(*leaves, block_mask=bm, return_lse=True, upcast=False)
        base = torch.autograd.grad(o_base.sum() if loss == "out" else lse_base.sum(), leaves, allow_unused=True,
                                   materialize_grads=True)
        for name, ours, ref, same in zip("qkv", grads, gold, base):
            assert_close_to_reference(ours, ref, same, name=f"{loss} d{name}", metric="rel_fro")
    # The inline op's backward looks ``_backward`` up per call; flexcore's op, bound at registration,
    # shares its setup_context, and with it the rule.
    assert seen == [(loss == "lse", loss == "out", True)]


@pytest.mark.parametrize("form", ["abs_score", "abs_mask", "abs_of_sum", "tensor_from_list"])
def test_mods_whose_values_torch_compile_hides_are_refused(form):
    """Dynamo evaluates builtin abs() on a tensor without flexcore's recorder seeing it; a
    tensor built inside the mod from a Python list is not one the call passes in. Both are
    refused with UnsupportedOpError naming the mod, where they used to run as ``abs(0) = 0`` (a
    silently wrong kernel) or fail with a KeyError."""
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=seed_of("hidden", form))
    slopes = torch.rand(H)
    window = 8

    def sym_alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx - kv_idx)

    def band(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) <= window

    def per_head(score, b, h, q_idx, kv_idx):
        return score + torch.tensor([0.5, -0.5, 0.25, 1.0])[h % 4]

    def summed(score, b, h, q_idx, kv_idx):  # a reduction of the arguments is 0-d in every recording
        return score - 0.1 * abs((q_idx - kv_idx).sum())

    score_mod = {"abs_score": sym_alibi, "tensor_from_list": per_head, "abs_of_sum": summed}.get(form)
    bm = create_block_mask(band, None, None, 64, 64, device="cpu", BLOCK_SIZE=32) if form == "abs_mask" else None
    name = {"abs_score": "sym_alibi", "abs_mask": "band", "tensor_from_list": "per_head", "abs_of_sum": "summed"}[form]
    match = r"torch\.abs" if form.startswith("abs") else r"torch\.tensor"
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(UnsupportedOpError, match=rf"in {name}: .*{match}") as raised:
        compiled(q, k, v)
    assert "call it eagerly" not in str(raised.value)  # an eager call runs these mods


@pytest.mark.parametrize("form", ["transpose", "data", "abs_of_table", "dot_of_data"])
def test_values_of_captured_tensors_alone_that_torch_compile_computes(form):
    """``table.T``, ``table.data`` and ``abs(table)`` inside a mod: Dynamo computes them without
    the recorder too, but from the captured tensor alone, so they are captured values: eager's
    output and float64's."""
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=seed_of("captured-alone", form))
    table = torch.randn(4, H, generator=torch.Generator().manual_seed(seed_of("table", form)))
    mods = {
        "transpose": lambda score, b, h, q_idx, kv_idx: score + table.T[h, (q_idx - kv_idx).clamp(0, 3)],
        "data": lambda score, b, h, q_idx, kv_idx: score + table.data[(q_idx - kv_idx).clamp(0, 3), h],
        "abs_of_table": lambda score, b, h, q_idx, kv_idx: score + abs(table)[1, h],
        # a product of per-position vectors, which the recording over wider stand-ins sums itself
        "dot_of_data": lambda score, b, h, q_idx, kv_idx: score + table.data[q_idx % 4] @ table.data[kv_idx % 4],
    }
    score_mod = mods[form]
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod), fullgraph=True,
                             backend="aot_eager")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, flex_attention(q, k, v, score_mod=score_mod), rtol=1e-6, atol=1e-6)
    gold = flex_attention_reference(q.double(), k.double(), v.double(), score_mod=score_mod)
    base = flex_attention_reference(q, k, v, score_mod=score_mod, upcast=False)
    assert_close_to_reference(out, gold, base, name=form, metric="rel_fro")


def test_dynamic_shapes_with_a_captured_tensor_computed_in_the_compiled_function():
    """A captured tensor whose size Dynamo keeps symbolic (``big[::2, 0]`` of a dynamic input):
    its shape is specialised as the lowering needs, where it used to fail to compile."""
    torch._dynamo.reset()
    q, k, v = qkv(64, seed=seed_of("dynamic", "captured"))
    big = torch.rand(2 * H, 3)

    def fn(q, k, v, big):
        slopes = big[::2, 0]

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        return flex_attention(q, k, v, score_mod=alibi)

    out = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")(q, k, v, big)
    torch.testing.assert_close(out, fn(q, k, v, big), rtol=1e-6, atol=1e-6)


def test_a_mask_of_other_lengths_is_named_with_symbolic_lengths():
    """After calls of other lengths Dynamo makes the lengths symbolic; a mask built for other
    lengths is still refused with flexcore's message (formatting symbolic lengths one by one in an
    f-string lost it to Dynamo's BUILD_STRING error)."""
    torch._dynamo.reset()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    f = torch.compile(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm), backend="eager", fullgraph=True)
    bm = create_block_mask(causal, 1, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    q = torch.randn(1, 2, 128, 16)
    f(q, q, q, bm)
    for L in (96, 64):  # each refused; the second recompile makes the lengths symbolic
        with pytest.raises(Exception, match="block_mask was built for lengths"):
            f(*(torch.randn(1, 2, L, 16),) * 3, bm)
    small = create_block_mask(causal, 1, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(Exception, match="block_mask was built for lengths"):
        f(q, q, q, small)
    torch._dynamo.reset()
