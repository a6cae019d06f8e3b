"""Per-call plans (flexcore.kernels.launch, forward, backward): a call repeated with the same
shapes, strides, dtypes, mask, mods, scale and options launches what the first one decided, and
any change of those decides again.

Under triton's interpreter plans launch the real kernels through it, so these tests run the plans'
argument tuples, allocations and descriptors on the real kernels, and check every call's output
and gradients against the float64 reference with fresh inputs. The GPU test
(test_attention_gpu.py, test_plans_gpu) runs them on compiled kernels.
"""
from __future__ import annotations

import pytest
import torch

from flexcore import KernelOptions, create_block_mask, flex_attention
from flexcore.kernels import launch as L
from tests.flexcore.cases import CPU_SHAPES, Shape, make_mods
from tests.flexcore.compare import seed_of
from tests.flexcore.policies import policy_options
from tests.flexcore.helpers import case_mods, check_call


def _plans(kind: str) -> int:
    return sum(1 for key in L._plans if kind in key)


CASES = [
    # (shape, mask/score variant, learnable captured tensor, dtype)
    (CPU_SHAPES[0], "causal", "temperature", torch.float32),     # partial blocks, captured gradient
    # bf16 with a learnable ALiBi slope: the plan replays the delta pass (policy backward.exact_delta)
    (Shape("bf16_slope", B=1, Hq=2, Hkv=2, L=128, S=128, D=32, Dv=32, block=32), "causal", "alibi_slope",
     torch.bfloat16),
    (CPU_SHAPES[3], "document", None, torch.float32),            # GQA, short rows
    (CPU_SHAPES[4], "sliding_window", "relative_table", torch.float32),  # D=80, Dv=48, ragged
    (Shape("bf16", B=1, Hq=2, Hkv=2, L=64, S=64, D=32, Dv=32, block=32), "noop", None, torch.bfloat16),
]


@pytest.mark.parametrize("shape,mod_name,learnable,dtype", CASES,
                         ids=[f"{c[0].name}-{c[1]}-{c[2]}" for c in CASES])
def test_repeated_calls_run_their_plans(decided, shape, mod_name, learnable, dtype):
    """The first call decides and keeps a plan for the forward and one for the backward; the next
    calls (fresh inputs, captured tensors updated in place) run the plans, and every call matches
    the reference, captured gradients included."""
    gen = torch.Generator().manual_seed(seed_of("plans", shape.name, mod_name, learnable))
    score_mod, gold_mod, caps, caps64, bm, refill = case_mods(shape, mod_name, learnable, gen)
    for call in range(3):
        check_call(shape, dtype, gen, score_mod, gold_mod, caps, caps64, bm, f"call {call}")
        refill()
    assert decided == {"forward": 1, "backward": 1}
    assert _plans("forward") == 1 and _plans("backward") == 1


def test_changes_of_the_call_decide_again(decided):
    """Strides, scale, options and the dtype are in the plans' keys: each change takes the full
    path once (and keeps its own plan), and every call matches the reference."""
    shape = Shape("small", B=1, Hq=2, Hkv=2, L=64, S=64, D=32, Dv=32, block=32)  # the keys, not the size
    gen = torch.Generator().manual_seed(seed_of("plans", "changes"))
    score_mod, gold_mod, caps, caps64, bm, _ = case_mods(shape, "causal", "temperature", gen)
    calls = [dict(), dict(layout="heads_inner"), dict(scale=0.3),
             dict(kernel_options=KernelOptions(deterministic=True)), dict()]
    expected = [1, 2, 3, 4, 4]  # the last call repeats the first: its plan
    for i, (kwargs, count) in enumerate(zip(calls, expected)):
        check_call(shape, torch.float32, gen, score_mod, gold_mod, caps, caps64, bm, f"call {i} {kwargs}",
                    **kwargs)
        assert decided == {"forward": count, "backward": count}, (i, kwargs)
    check_call(shape, torch.bfloat16, gen, score_mod, gold_mod, caps, caps64, bm, "bf16")
    assert decided == {"forward": 5, "backward": 5}


def test_a_new_mask_decides_again(decided):
    """Plans are kept per mask: another BlockMask of the same shape decides again."""
    shape = CPU_SHAPES[1]
    gen = torch.Generator().manual_seed(seed_of("plans", "masks"))
    for i, mod_name in enumerate(["causal", "prefix_lm", "causal"]):
        score_mod, gold_mod, caps, caps64, bm, _ = case_mods(shape, mod_name, None, gen)
        check_call(shape, torch.float32, gen, score_mod, gold_mod, caps, caps64, bm, mod_name)
        assert decided["forward"] == i + 1


def test_plans_of_host_descriptors(decided):
    """K and V through descriptors made on the host over all rows (policy forward.kv_rows): the plan
    makes each call's descriptors over the call's K and V with the tile that the first call launched."""
    opts = policy_options(forward={"tma": "on", "kv_rows": "on"})
    shape = Shape("kv_rows", B=2, Hq=2, Hkv=2, L=64, S=64, D=32, Dv=32, block=32)
    gen = torch.Generator().manual_seed(seed_of("plans", "kv_rows"))
    score_mod, gold_mod, caps, caps64, bm, _ = case_mods(shape, "causal", None, gen)
    for call in range(3):
        check_call(shape, torch.bfloat16, gen, score_mod, gold_mod, caps, caps64, bm, f"call {call}",
                    kernel_options=opts)
    assert decided == {"forward": 1, "backward": 1}
    plan, = (p for key, p in L._plans.items() if "forward" in key)
    assert plan.kv_desc == ((2 * 2 * 64, 2 * 2 * 64), 32)


def test_plans_can_be_switched_off(decided):
    opts = policy_options(launch={"plans": False})
    shape = CPU_SHAPES[1]
    gen = torch.Generator().manual_seed(seed_of("plans", "off"))
    score_mod, gold_mod, caps, caps64, bm, _ = case_mods(shape, "causal", None, gen)
    for _ in range(2):
        check_call(shape, torch.float32, gen, score_mod, gold_mod, caps, caps64, bm, "off", kernel_options=opts)
    assert decided == {"forward": 2, "backward": 2}
    assert not L._plans


def test_no_plan_from_inside_a_graph_capture(monkeypatch):
    """Decisions made inside a CUDA graph capture stand in for ones that need the GPU (no tuning,
    no statistics): they are not kept."""
    monkeypatch.setattr(L, "capturing", lambda: True)
    L.keep_plan(("key",), object())
    assert not L._plans
    monkeypatch.setattr(L, "capturing", lambda: False)
    L.keep_plan(("key",), plan := object())
    assert L.get_plan(("key",)) is plan


def test_plans_leave_with_their_mask():
    """A plan lives as long as its mask's tables: a loop that builds a new mask per batch keeps
    neither the plans nor the tables of the masks it dropped (nor reuses a plan for a new mask
    that happens to take a dropped one's id)."""
    import gc
    import weakref

    shape = CPU_SHAPES[1]
    gen = torch.Generator().manual_seed(seed_of("plans", "lifetime"))
    score_mod, gold_mod, caps, caps64, bm, _ = case_mods(shape, "causal", None, gen)
    check_call(shape, torch.float32, gen, score_mod, gold_mod, caps, caps64, bm, "first")
    assert _plans("forward") == 1 and _plans("backward") == 1
    tables = weakref.ref(bm.kv_num_blocks)
    del bm
    gc.collect()
    assert not L._plans
    assert tables() is None
    for i in range(3):  # new masks, possibly at recycled addresses: each decides anew and is right
        score_mod, gold_mod, caps, caps64, bm, _ = case_mods(shape, "prefix_lm" if i % 2 else "causal", None, gen)
        check_call(shape, torch.float32, gen, score_mod, gold_mod, caps, caps64, bm, f"mask {i}")
        del bm
        gc.collect()
        assert not L._plans


def test_a_mod_over_new_tensors_reuses_its_plan(decided):
    """A score_mod over a tensor recomputed at every step (a bias from an embedding) lowers anew at
    each step, to the same source: the steps share one plan, each reading its own tensor, and the
    plans' keys hold no tensor and no lowered mod (nothing of a step outlives it through them)."""
    from flexcore.lowering.api import LoweredMod

    shape = CPU_SHAPES[1]
    gen = torch.Generator().manual_seed(seed_of("plans", "new_tensors"))
    _, mask_mod = make_mods("causal", shape, "cpu", gen)
    bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device="cpu", BLOCK_SIZE=shape.block)
    for step in range(3):
        # A per-head scale (a bias that depends on h alone would have a zero gradient).
        bias = (0.8 + 0.4 * torch.rand(shape.Hq, generator=gen)).requires_grad_()
        bias64 = bias.detach().double().requires_grad_()

        def factory(b_):
            def head_scale(score, b, h, q_idx, kv_idx):
                return score * b_[h]
            return head_scale

        check_call(shape, torch.float32, gen, factory(bias), factory(bias64), [bias], [bias64], bm,
                    f"step {step}")
    assert decided == {"forward": 1, "backward": 1}
    parts = [x for key in L._plans for x in key]
    assert not any(isinstance(x, (torch.Tensor, LoweredMod)) for x in parts)


@pytest.mark.parametrize("layout", ["bshd", "hbsd", "bhsd"])
def test_outputs_keep_the_query_order(decided, layout):
    """The output has the query's stride order, as torch's flex_attention's (which a model that
    reshapes (B, H, L, D) outputs back to (B, L, H * D) relies on for a free view), on the call
    that decides and on the plan's replays."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from flexcore import AuxRequest
    from tests.flexcore.compare import assert_matches_reference

    shape = Shape("order", B=2, Hq=3, Hkv=3, L=64, S=64, D=16, Dv=16, block=32)
    gen = torch.Generator().manual_seed(seed_of("plans", "order", layout))
    _, mask_mod = make_mods("causal", shape, "cpu", gen)
    bm = create_block_mask(mask_mod, None, None, shape.L, shape.S, device="cpu", BLOCK_SIZE=shape.block)
    permute = {"bshd": (0, 2, 1, 3), "hbsd": (1, 0, 2, 3), "bhsd": (0, 1, 2, 3)}[layout]
    for call in range(3):
        q, k, v = shape.qkv(torch.float32, "cpu", gen)
        q = q.permute(permute).contiguous().permute(permute)  # the same values in that memory order
        out, aux = flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True))
        lse = aux.lse
        assert out.stride() == torch_flex(q, k, v).stride() == q.stride(), (call, out.stride(), q.stride())
        assert_matches_reference(q, k, v, None, bm, out, lse, f"{layout} call {call}")
    assert decided["forward"] == 1
