"""flexcore's BlockMask, mask combinators and kernel_options against torch 2.13's
``torch.nn.attention.flex_attention`` on the same inputs: conversions both ways, pytree, numel /
as_tuple / _adjust, attribute assignment (the FlexDecoding recipe), torch's kernel_options keys,
and_masks() / or_masks(), from_kv_blocks on int64 unordered tables, sparsity()."""
from __future__ import annotations

import gc
import typing
import warnings
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch.nn.attention import flex_attention as tfa

from flexcore import flex_attention, options
from flexcore.blockmask import BlockMask, create_block_mask, create_mask, sliced_mask_mod
from flexcore.errors import InputError
from flexcore.interop import _converted, coerce_block_mask, is_torch_block_mask
from flexcore.masks import MaskModTypeError, and_masks, noop_mask, or_masks
from flexcore.options import KernelOptions, KernelOptionsConflict
from tests.flexcore.compare import assert_matches_reference, rel_err, seed_of
from tests.flexcore.helpers import TABLES, causal



def generate_document(doc):
    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return document


def qkv(B, H, L, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g), torch.randn(B, H, S, D, generator=g),
            torch.randn(B, H, S, D, generator=g))


def assert_same_tables(a, b, names=TABLES):
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


# -- conversions -----------------------------------------------------------------------------------

def test_to_torch_and_from_torch_share_the_tables():
    mask = create_block_mask(causal, 2, 1, 96, 160, device="cpu", BLOCK_SIZE=32)
    theirs = mask.to_torch()
    assert isinstance(theirs, tfa.BlockMask) and is_torch_block_mask(theirs)
    assert not is_torch_block_mask(mask)
    assert theirs.kv_indices is mask.kv_indices and theirs.mask_mod is causal
    assert theirs.seq_lengths == (96, 160) and theirs.BLOCK_SIZE == (32, 32)
    # Lengths that are multiples of the block: torch builds the very same tables.
    built = tfa.create_block_mask(causal, 2, 1, 96, 160, device="cpu", BLOCK_SIZE=32)
    assert_same_tables(theirs, built)
    back = BlockMask.from_torch(built)
    assert_same_tables(back, mask)
    assert back.mask_mod is causal and back.seq_lengths == (96, 160)
    # The marks of a sliced mask and the noop mask map to each other's.
    assert mask[:, :, 1].to_torch().mask_mod is tfa._sliced_mask_mod_error
    assert BlockMask.from_torch(built[:, :, 1]).mask_mod is sliced_mask_mod
    assert BlockMask.from_torch(mask.with_mask_mod(None).to_torch()).mask_mod is noop_mask
    with pytest.raises(InputError, match="expected a torch.nn.attention.flex_attention.BlockMask"):
        BlockMask.from_torch(mask)


@pytest.mark.parametrize("L,S", [(96, 96), (100, 150)], ids=["aligned", "ragged"])
def test_torch_mask_attends_as_flexcore_mask(L, S):
    # 100 x 150 leaves ragged edge blocks, which torch calls partial and flexcore full.
    q, k, v = qkv(2, 2, L, S, 16, seed_of("torch_mask", L, S))
    doc = torch.arange(S) // 37
    mod = generate_document(doc)
    theirs = tfa.create_block_mask(mod, 2, None, L, S, device="cpu", BLOCK_SIZE=32)
    converted = coerce_block_mask(theirs)
    out, lse = flex_attention(q, k, v, block_mask=converted, return_lse=True)
    assert_matches_reference(q, k, v, None, converted, out, lse, f"converted {L}x{S}")
    native = create_block_mask(mod, 2, None, L, S, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(converted.to_dense(), native.to_dense())
    assert rel_err(out, flex_attention(q, k, v, block_mask=native)) < 1e-6
    torch_out = tfa.flex_attention(q, k, v, block_mask=theirs)
    assert rel_err(out, torch_out) < 1e-5


def test_flex_attention_takes_a_torch_mask():
    q, k, v = qkv(1, 2, 64, 64, 16, seed_of("direct"))
    theirs = tfa.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    want = flex_attention(q, k, v, block_mask=coerce_block_mask(theirs))
    assert torch.equal(flex_attention(q, k, v, block_mask=theirs), want)
    # Inside torch.compile too (the compiled call converts it as the eager one does).
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, m: flex_attention(q, k, v, block_mask=m), fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(q, k, v, theirs), want)


def test_coerce_converts_once_and_follows_changes():
    assert coerce_block_mask(None) is None
    native = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    assert coerce_block_mask(native) is native
    theirs = tfa.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    first = coerce_block_mask(theirs)
    assert isinstance(first, BlockMask) and coerce_block_mask(theirs) is first
    # The FlexDecoding recipe assigns attributes of torch's mask: the conversion follows.
    theirs.mask_mod = generate_document(torch.arange(64) // 20)
    second = coerce_block_mask(theirs)
    assert second is not first and second.mask_mod is theirs.mask_mod
    # An in-place edit of a table (its version counter) makes a new conversion too.
    theirs.kv_num_blocks[0, 0, 1] = 1
    third = coerce_block_mask(theirs)
    assert third is not second and third.kv_num_blocks[0, 0, 1] == 1
    # The cache holds torch's mask weakly.
    assert theirs in _converted
    count = len(_converted)
    del theirs
    gc.collect()
    assert len(_converted) == count - 1


# -- pytree, numel, as_tuple, _adjust --------------------------------------------------------------

def test_pytree_round_trip():
    mask = create_block_mask(causal, 2, 1, 100, 70, device="cpu", BLOCK_SIZE=32)
    leaves, spec = pytree.tree_flatten(mask)
    assert len(leaves) == 8 and all(a is getattr(mask, n) for a, n in zip(leaves, TABLES))
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, BlockMask) and rebuilt is not mask
    assert_same_tables(rebuilt, mask)
    assert rebuilt.mask_mod is causal and rebuilt.seq_lengths == (100, 70)
    assert rebuilt.BLOCK_SIZE == (32, 32)
    assert pytree.tree_flatten(rebuilt)[1] == spec
    # tree_map replaces the tables: the leaves are exactly the tensors.
    cloned = pytree.tree_map(torch.clone, mask)
    assert cloned.kv_indices is not mask.kv_indices
    assert_same_tables(cloned, mask)
    keyed, _ = pytree.tree_flatten_with_path(mask)
    assert [pytree.keystr(path) for path, _ in keyed][:2] == [".kv_num_blocks", ".kv_indices"]
    # Tables that are None are not leaves, and come back as None.
    no_q = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, compute_q_blocks=False)
    leaves, spec = pytree.tree_flatten(no_q)
    assert len(leaves) == 2
    assert pytree.tree_unflatten(leaves, spec).q_indices is None
    # A nested structure flattens through the mask.
    assert len(pytree.tree_leaves({"mask": mask, "x": torch.zeros(1)})) == 9


def test_block_mask_passes_through_torch_compile():
    # A compiled function reads the tables, slices the mask and rebuilds it from its leaves
    # without a graph break; check_unmodified is a no-op while tracing.
    mask = create_block_mask(causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)

    def fn(x, bm):
        bm.check_unmodified()
        leaves, spec = pytree.tree_flatten(bm)
        rebuilt = pytree.tree_unflatten([t + 0 for t in leaves], spec)
        return x + rebuilt.kv_indices.sum() + bm[:, :, 1].full_kv_num_blocks.sum() + bm.seq_lengths[0]

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(torch.zeros(2), mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.zeros(2), mask), fn(torch.zeros(2), mask))


def test_numel_as_tuple_and_adjust_match_torch():
    ours = create_block_mask(causal, 2, 3, 256, 192, device="cpu", BLOCK_SIZE=64)
    theirs = tfa.create_block_mask(causal, 2, 3, 256, 192, device="cpu", BLOCK_SIZE=64)
    assert ours.numel() == theirs.numel() == 2 * 3 * 256 * 192
    for flatten in (True, False):
        mine, torch_tuple = ours.as_tuple(flatten), theirs.as_tuple(flatten)
        assert len(mine) == len(torch_tuple)
        for i, (a, b) in enumerate(zip(mine, torch_tuple)):
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b), i
            else:
                assert a == b, i
    for new in [(128, 128), (100, 192), (256, 64)]:
        adjusted, expected = ours._adjust(*new), theirs._adjust(*new)
        assert adjusted.seq_lengths == expected.seq_lengths == new
        assert torch.equal(adjusted.to_dense(), expected.to_dense()), new
        for name in TABLES:
            mine = getattr(adjusted, name)
            num = name.replace("indices", "num_blocks")
            if name.endswith("indices"):  # the listed prefix of each row, as torch lists it
                n = getattr(adjusted, num)
                listed = torch.arange(mine.shape[-1]) < n[..., None]
                assert torch.equal(mine[listed], getattr(expected, name)[listed]), (new, name)
            else:
                assert torch.equal(mine, getattr(expected, name)), (new, name)
    with pytest.raises(InputError, match="can only be cropped"):
        ours._adjust(320, 192)


# -- assigning attributes --------------------------------------------------------------------------

def test_flexdecoding_recipe_assigns_mask_mod_and_lengths():
    # The blog's decoding step: slice the row of the current position, give it a mask_mod that
    # adds the offset, set its lengths to one query.
    S, D, H = 192, 16, 2
    block_mask = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=64)
    pos = 150
    offset = torch.tensor(pos)

    def get_mask_mod_w_offset(mask_mod):
        def _mask_mod(b, h, q, kv):
            return mask_mod(b, h, q + offset, kv)
        return _mask_mod

    block_mask_slice = block_mask[:, :, pos // 64]
    before = block_mask_slice.version
    block_mask_slice.mask_mod = get_mask_mod_w_offset(causal)
    block_mask_slice.seq_lengths = (1, S)
    assert block_mask_slice.version != before
    q, k, v = qkv(1, H, 1, S, D, seed_of("recipe"))
    out, lse = flex_attention(q, k, v, block_mask=block_mask_slice, return_lse=True)
    # The same step as torch runs it, and the reference with the dense offset mask.
    theirs = tfa.create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=64)
    torch_slice = theirs[:, :, pos // 64]
    torch_slice.mask_mod = get_mask_mod_w_offset(causal)
    torch_slice.seq_lengths = (1, S)
    assert rel_err(out, tfa.flex_attention(q, k, v, block_mask=torch_slice)) < 1e-5
    assert_matches_reference(q, k, v, None, block_mask_slice, out, lse, "decoding recipe")
    gold = torch.softmax((q @ k.transpose(-1, -2) / D ** 0.5).masked_fill(
        torch.arange(S) > pos, float("-inf")), -1) @ v
    assert rel_err(out, gold) < 1e-5


def test_assignments_are_checked_and_change_the_version():
    mask = create_block_mask(causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    versions = {mask.version}
    with pytest.raises(InputError, match="mask_mod must be callable"):
        mask.mask_mod = "causal"
    with pytest.raises(InputError, match="seq_lengths must be a pair"):
        mask.seq_lengths = 128
    with pytest.raises(InputError, match="BLOCK_SIZE must be a positive int"):
        mask.BLOCK_SIZE = 0
    assert mask.version in versions and mask.mask_mod is causal  # refused: nothing changed
    mask.mask_mod = None  # None means keep everything, as in the constructor
    assert mask.mask_mod is noop_mask
    versions.add(mask.version)
    mask.BLOCK_SIZE = 32
    assert mask.BLOCK_SIZE == (32, 32) and mask.version not in versions
    versions.add(mask.version)
    # A key-block table: checked, and the transposed tables derived from the old one dropped.
    wider = mask.kv_num_blocks.clone()
    mask.kv_num_blocks = wider
    assert mask.q_indices is None and mask.full_q_indices is None
    assert mask.version not in versions
    past = mask.kv_indices.clone()
    past[0, 0, 2, 0] = 4
    with pytest.raises(InputError, match=r"cannot assign|kv_indices\[0, 0, 2, 0\] = 4 points past"):
        mask.kv_indices = past
    assert mask.kv_indices is not past
    with pytest.raises(InputError, match="cannot assign BlockMask.kv_num_blocks.*from_kv_blocks"):
        mask.kv_num_blocks = mask.kv_num_blocks[:, :, :2]
    # Other attributes are plain, as on torch's BlockMask; masks stay hashable and weak-referenceable.
    mask.note = "mine"
    assert weakref.ref(mask)() is mask and {mask: 1}[mask] == 1


# -- kernel_options --------------------------------------------------------------------------------

def _example_value(name: str, annotation):
    args = typing.get_args(annotation)
    inner = args[0] if args else annotation
    if name == "BACKEND":
        return "AUTO"
    if inner is bool or "bool" in str(inner):
        return True
    return 64


def test_every_torch_kernel_option_is_accepted(monkeypatch):
    monkeypatch.setattr(options, "_WARNED", set())
    hints = typing.get_type_hints(tfa.FlexKernelOptions, include_extras=False)
    assert set(hints) >= {"BACKEND", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS",
                          "WRITE_DQ", "USE_TMA", "FORCE_USE_FLEX_ATTENTION"}
    for name, annotation in hints.items():
        for key in (name, "fwd_" + name, "bwd_" + name):
            if key.endswith("BACKEND") and key != "BACKEND":
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                KernelOptions.from_any({key: _example_value(name, annotation)})


def test_torch_kernel_options_map_or_warn_once(monkeypatch):
    monkeypatch.setattr(options, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing ignored: no warning
        assert KernelOptions.from_any({"BACKEND": "TRITON"}).decode is False
        assert KernelOptions.from_any({"BACKEND": "TRITON_DECODE"}).decode is True
        assert KernelOptions.from_any({"BACKEND": "AUTO"}).decode is None
        assert KernelOptions.from_any({"FORCE_USE_FLEX_ATTENTION": True}).decode is False
        defaults = {"PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "WRITE_DQ": True,
                    "BLOCKS_ARE_CONTIGUOUS": False, "USE_TMA": False, "BLOCK_M": 32}
        assert KernelOptions.from_any(defaults) == KernelOptions(BLOCK_M=32)
    asked = {"PRESCALE_QK": True, "bwd_BLOCK_M1": 32, "BLOCKS_ARE_CONTIGUOUS": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert KernelOptions.from_any(asked) == KernelOptions()
        KernelOptions.from_any({"BACKEND": "FLASH"})
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # one per distinct set of ignored keys
    assert "['BLOCKS_ARE_CONTIGUOUS', 'PRESCALE_QK', 'bwd_BLOCK_M1']" in messages[0]
    assert "['BACKEND']" in messages[1]
    with pytest.raises(InputError, match="unknown kernel_options \\['BLOCK_Q'\\].*valid keys.*BACKEND"):
        KernelOptions.from_any({"BLOCK_Q": 64})
    with pytest.raises(ValueError, match="BACKEND'\\] = 'CUTE'"):
        KernelOptions.from_any({"BACKEND": "CUTE"})
    with pytest.raises(RuntimeError, match="cannot be combined"):
        KernelOptions.from_any({"BACKEND": "AUTO", "FORCE_USE_FLEX_ATTENTION": True})
    with pytest.raises(KernelOptionsConflict, match="decode=True contradicts BACKEND='TRITON'"):
        KernelOptions.from_any({"BACKEND": "TRITON", "decode": True})
    assert KernelOptions.from_any({"check_indices": True}).check_indices is True
    assert KernelOptions().check_indices is False


def test_torch_kernel_options_in_a_call(monkeypatch):
    monkeypatch.setattr(options, "_WARNED", set())
    q, k, v = qkv(1, 2, 64, 64, 16, seed_of("options_call"))
    mask = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    plain = flex_attention(q, k, v, block_mask=mask)
    torch_style = {"BACKEND": "TRITON", "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False,
                   "BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True, "USE_TMA": False}
    assert torch.equal(flex_attention(q, k, v, block_mask=mask, kernel_options=torch_style), plain)


# -- create_block_mask, and_masks / or_masks, from_kv_blocks, sparsity ----------------------------

def test_create_block_mask_takes_torch_arguments():
    ours = create_block_mask(causal, 2, None, 96, 160, device="cpu", BLOCK_SIZE=32, _compile=True)
    assert_same_tables(ours, create_block_mask(causal, 2, None, 96, 160, device="cpu", BLOCK_SIZE=32))
    flat = create_block_mask(causal, 2, None, 96, 160, device="cpu", BLOCK_SIZE=32,
                             separate_full_blocks=False)
    theirs = tfa.create_block_mask(causal, 2, None, 96, 160, device="cpu", BLOCK_SIZE=32,
                                   separate_full_blocks=False)
    assert_same_tables(flat, theirs)
    assert flat.full_kv_indices is None and flat.counts().full == 0


def test_empty_and_or_masks_match_torch():
    for ours, theirs in ((and_masks(), tfa.and_masks()), (or_masks(), tfa.or_masks())):
        assert torch.equal(create_mask(ours, 2, 2, 40, 50, device="cpu"),
                           tfa.create_mask(theirs, 2, 2, 40, 50, device="cpu"))
    assert bool(create_mask(and_masks(), 1, 1, 8, 8, device="cpu").all())
    assert not bool(create_mask(or_masks(), 1, 1, 8, 8, device="cpu").any())
    # Attention with nothing kept: zero rows and -inf log-sum-exp, as torch gives.
    q, k, v = qkv(1, 2, 64, 64, 16, seed_of("or_masks"))
    none_kept = create_block_mask(or_masks(), None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=none_kept, return_lse=True)
    theirs = tfa.create_block_mask(tfa.or_masks(), None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    torch_out, torch_lse = tfa.flex_attention(q, k, v, block_mask=theirs, return_lse=True)
    assert torch.equal(out, torch_out) and not out.any()
    assert torch.equal(lse, torch_lse) and bool(torch.isneginf(lse).all())
    all_kept = create_block_mask(and_masks(), None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    assert rel_err(flex_attention(q, k, v, block_mask=all_kept), tfa.flex_attention(q, k, v)) < 1e-5
    # Torch raises RuntimeError on a non-callable; flexcore's error is that and a TypeError.
    for combine in (and_masks, or_masks):
        with pytest.raises(RuntimeError, match="argument 1 is int"):
            combine(causal, 3)
        with pytest.raises(TypeError):
            combine(causal, 3)
    assert issubclass(MaskModTypeError, RuntimeError) and issubclass(InputError, ValueError)


def test_from_kv_blocks_takes_int64_and_unordered_rows_like_torch():
    g = torch.Generator().manual_seed(seed_of("unordered"))
    B, H, R, C = 2, 2, 4, 5
    block_map = torch.randint(0, 3, (B, H, R, C), generator=g)  # 0 empty, 1 partial, 2 full

    def shuffled_listing(value):
        num = (block_map == value).sum(-1)
        idx = torch.zeros(B, H, R, C, dtype=torch.int64)
        for b in range(B):
            for h in range(H):
                for r in range(R):
                    cols = (block_map[b, h, r] == value).nonzero().flatten()
                    cols = cols[torch.randperm(cols.numel(), generator=g)]
                    idx[b, h, r, :cols.numel()] = cols
        return num, idx

    (num, idx), (fnum, fidx) = shuffled_listing(1), shuffled_listing(2)
    assert num.dtype == idx.dtype == torch.int64
    ours = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=16)
    theirs = tfa.BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=16)
    assert torch.equal(ours.block_map(), block_map.to(torch.int8))
    assert torch.equal(ours.to_dense(), theirs.to_dense().to(torch.int32))
    assert all(getattr(ours, n).dtype == torch.int32 for n in TABLES)
    for name in ("kv_indices", "full_kv_indices"):  # listed entries now increase in each row
        table, count = getattr(ours, name), getattr(ours, name.replace("indices", "num_blocks"))
        for row, n in zip(table.flatten(0, 2).tolist(), count.flatten().tolist()):
            assert row[:n] == sorted(row[:n])
    # torch transposes through the dense form: its q tables are ordered, and equal ours.
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    # Attention over the converted tables, against the reference and torch. torch's eager
    # flex_attention reads the mask_mod only (its compiled kernels read the tables), so it gets
    # the tables' meaning spelled out: full blocks kept, partial blocks where the mod keeps.
    q, k, v = qkv(B, H, R * 16, C * 16, 16, seed_of("unordered_attn"))

    def checker(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 3 != 0

    def tables_meaning(b, h, q_idx, kv_idx):
        state = block_map[b, h, q_idx // 16, kv_idx // 16]
        return (state == 2) | ((state == 1) & checker(b, h, q_idx, kv_idx))

    ours.mask_mod = checker
    out, lse = flex_attention(q, k, v, block_mask=ours, return_lse=True)
    assert_matches_reference(q, k, v, None, ours, out, lse, "int64 unordered tables")
    torch_out = tfa.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: torch.where(
        tables_meaning(b, h, q_idx, kv_idx), s, float("-inf")))
    fin = ~torch.isnan(torch_out)  # rows that keep nothing: torch's eager math gives NaN there
    assert rel_err(out[fin], torch_out[fin]) < 1e-5


@pytest.mark.parametrize("B,H", [(None, None), (2, 3)])
def test_sparsity_matches_torch_on_ragged_lengths(B, H):
    # 200 x 300 in blocks of 128: the ragged edge blocks count whole against the positions.
    doc = torch.arange(300) // 70
    for mod in (causal, noop_mask, generate_document(doc), or_masks()):
        ours = create_block_mask(mod, B, H, 200, 300, device="cpu", BLOCK_SIZE=128)
        theirs = tfa.create_block_mask(mod, B, H, 200, 300, device="cpu", BLOCK_SIZE=128)
        assert ours.sparsity() == theirs.sparsity(), mod.__name__
    assert create_block_mask(noop_mask, None, None, 200, 300, device="cpu").sparsity() < 0


# -- errors ----------------------------------------------------------------------------------------

def test_meta_tensors_are_refused_and_fake_tensors_pass():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexcore._validate import check_qkv

    meta = torch.empty(1, 2, 8, 16, device="meta")
    real = torch.randn(1, 2, 8, 16)
    with pytest.raises(InputError, match=r"key is a meta tensor \(1, 2, 8, 16\) \(device='meta'\)"):
        flex_attention(real, meta, real)
    with pytest.raises(ValueError, match="query is a meta tensor"):
        check_qkv(meta, meta, meta, False)
    # torch.compile traces with FakeTensors, which report the device they stand for.
    with FakeTensorMode():
        fake = torch.empty(1, 2, 8, 16)
    assert fake.device.type == "cpu"
    check_qkv(fake, fake, fake, False)


def test_every_public_name_of_torch_flex_attention_is_in_flexcore():
    import flexcore
    import torch.nn.attention.flex_attention as torch_flex

    missing = [name for name in torch_flex.__all__ if not hasattr(flexcore, name)]
    assert not missing, f"torch.nn.attention.flex_attention names missing from flexcore: {missing}"
    assert set(torch_flex.__all__) <= set(flexcore.__all__)


def test_a_mask_cropped_by_torchs_adjust_runs_as_torch_runs_it():
    """torch's _adjust recounts cropped rows by comparing index values with counts, so a row cut to
    3 key blocks may still list block 3; torch skips it, and so does the conversion."""
    tm = tfa.create_block_mask(causal, 1, 1, 100, 70, device="cpu", BLOCK_SIZE=16)._adjust(50, 35)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 50, 16, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, 1, 35, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = tfa.flex_attention(q, k, v, block_mask=tm)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=tm), expected)
    assert torch.equal(BlockMask.from_torch(tm).to_dense(), tm.to_dense())
