"""Finer block tables for the forward (flexcore.blockmask.refine_block_map, forward.refined): the
refined map against a direct classification at the finer size, the forward over them against the
float64 reference, the rule that takes them, and their lifetime."""
from __future__ import annotations

import pytest
import torch

from flexcore import and_masks, create_block_mask, flex_attention
from flexcore.blockmask import refine_block_map
from flexcore.kernels import forward as fwd
from tests.flexcore.cases import Shape, make_case, make_mods
from tests.flexcore.compare import assert_matches_reference, seed_of
from tests.flexcore.helpers import backward_tables_spy, check_backward, forward_tables_spy
from tests.flexcore.policies import policy_options

DEVICE = "cpu"
# 128-row mask blocks (the default), ragged lengths, GQA: the finer tables are 64x64.
RAGGED = Shape("ragged128", B=2, Hq=2, Hkv=1, L=300, S=331, D=32, Dv=32, block=128)


def _short_documents(lengths, device=DEVICE):
    """A causal document mask over documents of the given lengths (cycled to cover 4096)."""
    cycled = torch.tensor(lengths).repeat(4096 // min(lengths) // len(lengths) + 1)
    ids = torch.repeat_interleave(torch.arange(cycled.numel()), cycled)[:4096].to(device)

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return document


@pytest.mark.parametrize("mod_name", ["causal", "sliding_window", "prefix_lm", "document", "and_or", "stripes"])
@pytest.mark.parametrize("block,fine", [(128, 64), ((128, 64), 64), (64, (32, 16))])
def test_refined_map_is_the_classification_at_the_finer_size(mod_name, block, fine):
    # prefix_lm differs per batch element (B=2 stored); stripes at a 128-wide block are 64 wide.
    shape = Shape("r", B=2, Hq=3, Hkv=3, L=300, S=331, D=32, Dv=32, block=block)
    gen = torch.Generator().manual_seed(seed_of("refine", mod_name, str(block)))
    _, mask_mod = make_mods(mod_name, shape, DEVICE, gen)
    bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=block)
    direct = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=fine)
    refined = refine_block_map(bm, fine if isinstance(fine, tuple) else (fine, fine))
    assert refined.dtype == torch.int8
    assert torch.equal(refined, direct.block_map())


def test_refined_map_gives_up_where_it_cannot_evaluate():
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, 2, None, 256, 256, device=DEVICE)
    assert refine_block_map(bm, (64, 64), max_elements=128 * 128) is None  # two partial blocks
    assert refine_block_map(bm[0], (64, 64)) is None  # a sliced mask's placeholder mod raises
    with pytest.raises(ValueError, match="must divide"):
        refine_block_map(bm, (48, 64))


# Kernel options that take the finer tables wherever the mask's tables divide.
REFINED = policy_options(forward={"refine": "on"})


@pytest.mark.parametrize("mod_name", ["causal", "document", "prefix_lm", "and_or", "alibi", "relative_table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_over_finer_tables_matches_reference(monkeypatch, mod_name, dtype):
    seen = forward_tables_spy(monkeypatch)
    q, k, v, score_mod, bm = make_case(RAGGED, mod_name, dtype, seed_of("refined", mod_name, str(dtype)), DEVICE)
    if bm is None:  # relative_table has no mask_mod: a causal one over it
        bm = create_block_mask(lambda b, h, i, j: i + 31 >= j, None, None, RAGGED.L, RAGGED.S, device=DEVICE)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True,
                              kernel_options=REFINED)
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, f"refined/{mod_name}/{dtype}")
    assert seen == [(64, 64)]


def test_the_rule_takes_finer_tables_where_they_save_work(monkeypatch):
    from flexcore.attention import kv_blocks
    from flexcore.options import KernelOptions

    seen = forward_tables_spy(monkeypatch)
    gen = torch.Generator().manual_seed(seed_of("refine", "rule"))
    q, k, v = (torch.randn(1, 2, 1024, 32, generator=gen) for _ in range(3))
    # Documents of 100-300 tokens: most 128-blocks straddle a boundary (finer cost ~0.6).
    documents = _short_documents([100, 300, 180, 250, 140])
    bm = create_block_mask(documents, None, None, 1024, 1024, device=DEVICE)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert_matches_reference(q, k, v, None, bm, out, lse, "rule/documents")
    assert seen == [(64, 64)]
    blocks = kv_blocks(bm, 1, 2)
    assert fwd.refined(blocks, q, k, v, _identity(), _lowered(documents), 0.1, KernelOptions()) is not blocks
    # Kernel options that pin a tile keep the mask's own tables.
    assert fwd.refined(blocks, q, k, v, _identity(), _lowered(documents), 0.1, KernelOptions(BLOCK_M=64)) is blocks
    # A causal mask's finer tables save only the diagonal's empty quarters: at 4096 (2%) they are
    # evaluated and left; at 8192 the bound on the saving (a partial block keeps at least one
    # partial sub-block) skips them without evaluating the mask. Documents are taken.
    calls = []
    real = attention_module()._finer_tables
    monkeypatch.setattr("flexcore.attention._finer_tables", lambda *a: calls.append(a[0]) or real(*a))
    causal = lambda b, h, i, j: i >= j  # noqa: E731
    for name, mask_mod, S, evaluated, taken in (("causal", causal, 4096, True, False),
                                                ("causal", causal, 8192, False, False),
                                                ("documents", documents, 4096, True, True)):
        calls.clear()
        long_q = torch.empty(1, 2, S, 32)
        bm = create_block_mask(mask_mod, None, None, S, S, device=DEVICE)
        blocks = kv_blocks(bm, 1, 2)
        chosen = fwd.refined(blocks, long_q, long_q, long_q, _identity(), _lowered(mask_mod), 0.1,
                             KernelOptions())
        assert len(calls) == evaluated, (name, S)
        assert (chosen is not blocks) == taken, (name, S)


def test_forced_gluon_forward_keeps_the_masks_own_tables(monkeypatch):
    # By the rule, the Gluon masked forward yields to the finer tables where rows are skewed; forced
    # (the policy's gluon.masked "on"), it keeps the mask's own tables, which it can read.
    from flexcore.attention import kv_blocks
    from flexcore.kernels import hopper

    documents = _short_documents([700, 60, 60, 60, 60, 84])  # one long document: skewed rows
    bm = create_block_mask(documents, None, None, 1024, 1024, device=DEVICE)
    blocks = kv_blocks(bm, 1, 2)
    q = torch.empty(1, 2, 1024, 32)
    monkeypatch.setattr(hopper, "applies_masked", lambda *a: True)
    for forced, kept in (("auto", False), ("on", True)):
        opts = policy_options(gluon={"masked": forced})
        chosen = fwd.refined(blocks, q, q, q, _identity(), _lowered(documents), 0.1, opts)
        assert (chosen is blocks) == kept, forced


@pytest.mark.parametrize("D, kept", [(128, True), (64, False)])
def test_gluon_forward_at_head_dim_64_yields_to_the_finer_tables(monkeypatch, D, kept):
    # Rows alike (documents of 96 tokens): at head dim 128 the Gluon masked forward keeps the mask's
    # own tables; at head dim 64 (three warpgroups, gluon.union_yields) the template over the finer
    # tables takes the call, unless the Gluon kernel is forced.
    from flexcore.attention import kv_blocks
    from flexcore.kernels import hopper
    from flexcore.options import KernelOptions

    documents = _short_documents([96] * 10 + [64])
    bm = create_block_mask(documents, None, None, 1024, 1024, device=DEVICE)
    blocks = kv_blocks(bm, 1, 2)
    q = torch.empty(1, 2, 1024, D)
    monkeypatch.setattr(hopper, "applies_masked", lambda *a: True)
    chosen = fwd.refined(blocks, q, q, q, _identity(), _lowered(documents), 0.1, KernelOptions())
    assert (chosen is blocks) == kept
    forced = policy_options(gluon={"masked": "on"})
    assert fwd.refined(blocks, q, q, q, _identity(), _lowered(documents), 0.1, forced) is blocks


def attention_module():
    import flexcore.attention

    return flexcore.attention


def _identity():
    from flexcore.lowering import lower_score_mod

    return lower_score_mod(None)


def _lowered(mask_mod):
    from flexcore.lowering import lower_mask_mod

    return lower_mask_mod(mask_mod)


def test_finer_tables_follow_the_captured_tensors(monkeypatch, decided):
    # The finer tables hold for the mask_mod's captured tensors as they were: modified in place,
    # they are computed again (and the per-call plan with them). Here the mask's own 128-blocks
    # stay right for the new limit; its finer ones do not (keys 160-191 of the last 64 queries).
    limit = torch.tensor([200])

    def below_limit(b, h, q_idx, kv_idx):
        return kv_idx < limit[0]

    mask_mod = and_masks(lambda b, h, i, j: i >= j, below_limit)
    bm = create_block_mask(mask_mod, None, None, 256, 256, device=DEVICE)
    gen = torch.Generator().manual_seed(seed_of("refine", "captured"))
    q, k, v = (torch.randn(1, 2, 256, 32, generator=gen) for _ in range(3))
    for step, value in enumerate([200, 200, 160]):
        if value != int(limit):
            limit.fill_(value)
        out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=REFINED)
        assert_matches_reference(q, k, v, None, bm, out, lse, f"limit {value}")
    assert decided["forward"] == 2  # the repeated call ran its plan; the modified tensor decided anew


def test_finer_tables_inside_a_graph_capture(monkeypatch):
    # A capture cannot read back: it gets the finer tables only where a call outside computed them.
    from flexcore.attention import kv_blocks

    bm = create_block_mask(_short_documents([100, 300, 180]), None, None, 512, 512, device=DEVICE)
    blocks = kv_blocks(bm, 1, 2)
    lowered = _lowered(bm.mask_mod)
    assert blocks.refine(lowered, False) is None
    fine, transposed, ratio = blocks.refine(lowered, True)
    assert fine.sparse_block == transposed.sparse_block == (64, 64) and ratio < 0.9
    assert blocks.refine(lowered, False)[0] is fine
    assert fine.num_blocks.shape == transposed.num_blocks.shape == (1, 2, 8)


def test_finer_tables_leave_with_their_mask():
    import gc
    import weakref

    from flexcore.attention import kv_blocks

    bm = create_block_mask(_short_documents([100, 300, 180]), None, None, 512, 512, device=DEVICE)
    blocks = kv_blocks(bm, 1, 2)
    fine, transposed, _ = blocks.refine(_lowered(bm.mask_mod), True)
    tables = weakref.ref(fine.indices), weakref.ref(transposed.indices)
    del bm, blocks, fine, transposed
    gc.collect()
    assert tables[0]() is None and tables[1]() is None


@pytest.mark.parametrize("mod_name", ["document", "sliding_window"])
def test_finer_tables_with_longest_first_order(monkeypatch, mod_name):
    # The finer tables' rows ordered longest first (only rows of 8+ blocks take it by default).
    opts = policy_options(forward={"refine": "on", "schedule_min_blocks": 0.0, "schedule_group": 2})
    q, k, v, score_mod, bm = make_case(RAGGED, mod_name, torch.float32, seed_of("refined", "order", mod_name), DEVICE)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True,
                              kernel_options=opts)
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, f"refined/order/{mod_name}")


# Each mod in one dtype (the tables do not depend on it), both dtypes over the plain causal mask.
@pytest.mark.parametrize("mod_name,learnable,dtype", [
    ("document", None, torch.float32), ("and_or", None, torch.float32),
    ("causal", "alibi_slope", torch.float32), ("causal", None, torch.bfloat16),
    ("alibi", None, torch.bfloat16)], ids=["fp32-document", "fp32-and_or", "fp32-causal-alibi_slope",
                                           "bf16-causal", "bf16-alibi"])
def test_backward_over_finer_tables_matches_reference(monkeypatch, mod_name, learnable, dtype):
    # Both kinds of backward program read the finer tables (dQ the key-block ones, dK/dV their
    # transpose), with the forward's; every gradient against float64.

    seen = backward_tables_spy(monkeypatch)
    check_backward(RAGGED, mod_name, dtype, seed_of("refined", "bwd", mod_name, learnable, str(dtype)),
                   learnable=learnable, kernel_options=REFINED)
    assert seen == [(64, 64)]


def test_backward_configurations_over_64_blocks(monkeypatch):
    # The GPU's tiles over 64x64 blocks: 4 warps for both kinds of program (docs/decisions.md#finer-tables).
    from flexcore.kernels import backward as bwd
    from flexcore.options import KernelOptions

    monkeypatch.setattr(bwd, "use_interpreter", lambda: False)
    for head_dim in (64, 128):
        dkdv, dq = bwd._tiles(KernelOptions(), head_dim, 2, 64, 64)
        assert (dkdv[:2], dq[:2]) == ((64, 64), (64, 64))
        assert (dkdv[2]["num_warps"], dq[2]["num_warps"]) == (4, 4)
    dkdv, dq = bwd._tiles(KernelOptions(), 128, 2, 128, 128)
    assert dkdv[2]["num_warps"] == 8  # the mask's own 128-blocks keep theirs
    assert fwd._candidates(128, 2, False, (64, 64)) == fwd._FINE_CONFIGS[128]
    assert fwd._candidates(128, 2, False, (128, 128)) == fwd.gpu_configs(128, 2)


def _grads_against_reference(q, k, v, bm, what):
    """dq, dk, dv of a loss on the output against the float64 reference, within twice torch's
    own float32 error."""
    from flexcore.reference import flex_attention_reference
    from flexcore.testing import assert_close_to_reference

    gen = torch.Generator().manual_seed(seed_of("refine", "grads", what))
    weights = torch.randn(q.shape, generator=gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad((flex_attention(*leaves, block_mask=bm, kernel_options=REFINED) * weights).sum(),
                                leaves)
    gold_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gold = torch.autograd.grad((flex_attention_reference(*gold_leaves, block_mask=bm) * weights.double()).sum(),
                               gold_leaves)
    base_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    base = torch.autograd.grad((flex_attention_reference(*base_leaves, block_mask=bm, upcast=False)
                                * weights).sum(), base_leaves)
    for name, ours, ref, same in zip(("dq", "dk", "dv"), grads, gold, base):
        assert_close_to_reference(ours, ref, same, name=f"{what} {name}", metric="rel_fro")


@pytest.mark.parametrize("over", ["heads", "batch"])
def test_finer_tables_of_a_broadcast_mask_whose_mask_mod_reads_the_head(over):
    # A mask built for one head (H=None) whose mask_mod reads h only inside partial blocks: every
    # head has the same block map, so the mask holds for all, but the finer tables differ by head.
    gen = torch.Generator().manual_seed(seed_of("refine", "broadcast", over))
    window = torch.tensor([8, 100])

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window[h if over == "heads" else b])

    q, k, v = (torch.randn(2, 2, 256, 16, generator=gen) for _ in range(3))
    bm = create_block_mask(per_head_window, None, None, 256, 256, device=DEVICE)  # BLOCK_SIZE 128
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=REFINED)
    assert_matches_reference(q, k, v, None, bm, out, lse, f"per-{over} window, broadcast mask")
    _grads_against_reference(q, k, v, bm, f"per-{over} window")


WINDOW = 8


def test_finer_tables_follow_a_rebound_global():
    # The coarse map is the same for both windows; the finer tables are not.
    global WINDOW

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    gen = torch.Generator().manual_seed(seed_of("refine", "rebound"))
    q, k, v = (torch.randn(1, 2, 256, 16, generator=gen) for _ in range(3))
    bm = create_block_mask(window, None, None, 256, 256, device=DEVICE)
    try:
        for value in (8, 100):
            WINDOW = value
            assert torch.equal(bm.block_map(), create_block_mask(window, None, None, 256, 256,
                                                                 device=DEVICE).block_map())
            out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=REFINED)
            assert_matches_reference(q, k, v, None, bm, out, lse, f"window {value}")
    finally:
        WINDOW = 8


def test_finer_tables_of_a_mask_mod_reading_an_inference_tensor():
    # Inference tensors have no version counter, so an edit in place cannot be seen: such a
    # mask_mod runs on the mask's own tables, before and after its documents change inside blocks.
    gen = torch.Generator().manual_seed(seed_of("refine", "inference"))
    with torch.inference_mode():
        ids = torch.repeat_interleave(torch.arange(3), torch.tensor([40, 150, 66]))
        q, k, v = (torch.randn(1, 2, 256, 16, generator=gen) for _ in range(3))

        def document(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

        bm = create_block_mask(document, None, None, 256, 256, device=DEVICE)
        edited = torch.repeat_interleave(torch.arange(3), torch.tensor([60, 140, 56]))
        assert torch.equal(bm.block_map(), create_block_mask(
            lambda b, h, q_idx, kv_idx: (edited[q_idx] == edited[kv_idx]) & (q_idx >= kv_idx),
            None, None, 256, 256, device=DEVICE).block_map())
        for what in ("before", "after"):
            out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=REFINED)
            assert_matches_reference(q, k, v, None, bm, out, lse, f"inference-mode document ids, {what} the edit")
            ids.copy_(edited)
