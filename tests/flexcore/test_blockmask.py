"""BlockMask, create_block_mask and create_mask against dense evaluation and against torch."""
from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from flexcore import blockmask as bmod
from flexcore.blockmask import BlockCounts, BlockMask, create_block_mask, create_mask
from flexcore.errors import ControlFlowError, InputError, ModError, ModReturnError, ModSignatureError
from flexcore.masks import and_masks, noop_mask, or_masks
from tests.flexcore.helpers import TABLES, causal


# ------------------------------------------------------------------------------------------------
# Mask families, each a factory of a pure index function (captured tensors are fresh random data)
# ------------------------------------------------------------------------------------------------

def generate_sliding_window(window):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (kv_idx - q_idx <= window)
    sliding_window.__name__ = f"sliding_window_{window}"
    return sliding_window


def generate_prefix_lm(prefix):
    def prefix_part(b, h, q_idx, kv_idx):
        return kv_idx < prefix
    return or_masks(prefix_part, causal)


def random_doc_ids(length, num_docs, generator):
    """Sorted document ids: ``num_docs`` contiguous documents of random lengths."""
    cuts = torch.randperm(length - 1, generator=generator)[:num_docs - 1] + 1
    ids = torch.zeros(length, dtype=torch.int64)
    ids[cuts] = 1
    return ids.cumsum(0)


def generate_document(q_doc, kv_doc):
    def document(b, h, q_idx, kv_idx):
        return q_doc[q_idx] == kv_doc[kv_idx]
    return document


def generate_head_batch(windows, lengths):
    """Depends on h (per-head window) and b (per-batch key length)."""
    def head_batch(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= windows[h]) & (kv_idx < lengths[b])
    return head_batch


def mask_families(Q, KV, seed):
    g = torch.Generator().manual_seed(seed)
    q_doc, kv_doc = random_doc_ids(Q, 4, g), random_doc_ids(KV, 4, g)
    windows = torch.randint(1, 40, (3,), generator=g)
    lengths = torch.randint(KV // 2, KV + 1, (2,), generator=g)
    document = generate_document(q_doc, kv_doc)
    return {
        "causal": causal,
        "sliding": generate_sliding_window(int(torch.randint(5, 40, (), generator=g))),
        "prefix_lm": generate_prefix_lm(int(torch.randint(1, KV, (), generator=g))),
        "document": document,
        "causal_document": and_masks(causal, document),
        "prefix_or_sliding_document": or_masks(generate_prefix_lm(7),
                                               and_masks(generate_sliding_window(9), document)),
        "head_batch": generate_head_batch(windows, lengths),
    }


# 97 and 191 are prime, so every block size leaves a ragged last block; 64x300 is cross-attention
# with a ragged key edge.
SHAPES = [(97, 97), (191, 191), (64, 300)]
BLOCK_SIZES = [16, 32, (16, 32)]
BH = [(None, None), (2, 3)]


@functools.lru_cache(maxsize=None)
def families_with_dense(Q, KV, B, H):
    """The families and their dense masks (shared by the block-size parametrisations)."""
    return {name: (mod, create_mask(mod, B, H, Q, KV, device="cpu"))
            for name, mod in mask_families(Q, KV, seed=Q + KV).items()}


def expected_block_map(dense, block_size):
    """Classify blocks by direct inspection of the dense mask (in-range positions only)."""
    BQ, BK = (block_size, block_size) if isinstance(block_size, int) else block_size
    B, H, Q, KV = dense.shape
    QB, KB = -(-Q // BQ), -(-KV // BK)
    out = torch.zeros(B, H, QB, KB, dtype=torch.int8)
    for i, j in itertools.product(range(QB), range(KB)):
        block = dense[:, :, i * BQ:(i + 1) * BQ, j * BK:(j + 1) * BK].flatten(2)
        out[:, :, i, j] = torch.where(block.all(-1), 2, torch.where(block.any(-1), 1, 0))
    return out


def dense_from_table(num, indices, n_cols):
    """Dense 0/1 (B, H, R, n_cols) from an ordered table, written with plain loops."""
    B, H, R = num.shape
    out = torch.zeros(B, H, R, n_cols, dtype=torch.int32)
    for b, h, r in itertools.product(range(B), range(H), range(R)):
        for j in range(int(num[b, h, r])):
            out[b, h, r, int(indices[b, h, r, j])] = 1
    return out


def check_ordered(num, indices):
    """Listed entries first and strictly increasing; every row is a permutation (valid padding)."""
    n_cols = indices.shape[-1]
    assert num.dtype == indices.dtype == torch.int32
    for row_num, row in zip(num.flatten().tolist(), indices.flatten(0, 2).tolist()):
        listed = row[:row_num]
        assert listed == sorted(listed) and len(set(listed)) == len(listed)
        assert sorted(row) == list(range(n_cols))


# ------------------------------------------------------------------------------------------------
# create_mask
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("Q,KV", SHAPES)
@pytest.mark.parametrize("B,H", BH)
def test_create_mask_matches_torch(Q, KV, B, H):
    for name, mod in mask_families(Q, KV, seed=Q * KV).items():
        ours = create_mask(mod, B, H, Q, KV, device="cpu")
        theirs = torch_flex.create_mask(mod, B, H, Q, KV, device="cpu")
        assert ours.dtype == torch.bool and ours.shape == (B or 1, H or 1, Q, KV)
        assert torch.equal(ours, theirs), name


def test_create_mask_accepts_score_mod():
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx + kv_idx + h) % 3 == 0, float("-inf"), score * 2)

    ours = create_mask(score_mod, 2, 2, 37, 41, device="cpu")
    theirs = torch_flex.create_mask(score_mod, 2, 2, 37, 41, device="cpu")
    assert torch.equal(ours, theirs)
    assert 0 < ours.sum() < ours.numel()


def test_create_mask_chunked_equals_unchunked(monkeypatch):
    mod = mask_families(97, 131, seed=3)["prefix_or_sliding_document"]
    full = create_mask(mod, 2, 3, 97, 131, device="cpu")
    monkeypatch.setattr(bmod, "_CHUNK_ELEMENTS", 1000)
    assert torch.equal(create_mask(mod, 2, 3, 97, 131, device="cpu"), full)


# ------------------------------------------------------------------------------------------------
# create_block_mask: classification and tables
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("Q,KV", SHAPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=str)
@pytest.mark.parametrize("B,H", BH)
def test_block_map_matches_dense_evaluation(Q, KV, block_size, B, H):
    for name, (mod, dense) in families_with_dense(Q, KV, B, H).items():
        bm = create_block_mask(mod, B, H, Q, KV, device="cpu", BLOCK_SIZE=block_size)
        expected = expected_block_map(dense, block_size)
        assert torch.equal(bm.block_map(), expected), name
        assert torch.equal(bm.to_dense(), (expected > 0).to(torch.int32)), name
        assert bm.to_dense().dtype == torch.int32
        assert bm.shape == (B or 1, H or 1, Q, KV)
        assert bm.BLOCK_SIZE == ((block_size, block_size) if isinstance(block_size, int)
                                 else block_size)
        assert bm.mask_mod is mod


@pytest.mark.parametrize("block_size", [16, (16, 32)], ids=str)
def test_tables_equal_torch_on_aligned_lengths(block_size):
    # Lengths that are multiples of the block: torch's classification coincides with ours, and the
    # tables (including padding order) must be identical.
    Q, KV = 96, 160
    for name, mod in mask_families(Q, KV, seed=11).items():
        ours = create_block_mask(mod, 2, 3, Q, KV, device="cpu", BLOCK_SIZE=block_size)
        theirs = torch_flex.create_block_mask(mod, 2, 3, Q, KV, device="cpu", BLOCK_SIZE=block_size)
        for table in TABLES:
            assert torch.equal(getattr(ours, table), getattr(theirs, table)), (name, table)
        assert ours.sparsity() == pytest.approx(theirs.sparsity())


def test_ragged_edge_block_is_full_when_all_in_range_positions_are_kept():
    # torch pads the ragged edge with "masked" and calls such blocks partial; flexcore ignores
    # out-of-range positions, so a kept ragged block is full.
    bm = create_block_mask(noop_mask, None, None, 40, 50, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(bm.block_map()[0, 0], torch.full((2, 2), 2, dtype=torch.int8))
    assert bm.counts() == BlockCounts(full=4, partial=0, empty=0)


@pytest.mark.parametrize("B,H", BH)
def test_tables_are_ordered_and_q_tables_are_the_transpose(B, H):
    Q, KV = 191, 97
    mod = mask_families(Q, KV, seed=5)["prefix_or_sliding_document"]
    bm = create_block_mask(mod, B, H, Q, KV, device="cpu", BLOCK_SIZE=(16, 32))
    QB, KB = bm.kv_indices.shape[-2:]
    assert (QB, KB) == (12, 4)
    for prefix in ("", "full_"):
        kv_num, kv_idx = getattr(bm, prefix + "kv_num_blocks"), getattr(bm, prefix + "kv_indices")
        q_num, q_idx = getattr(bm, prefix + "q_num_blocks"), getattr(bm, prefix + "q_indices")
        check_ordered(kv_num, kv_idx)
        check_ordered(q_num, q_idx)
        assert q_num.shape == (B or 1, H or 1, KB) and q_idx.shape == (B or 1, H or 1, KB, QB)
        kv_dense = dense_from_table(kv_num, kv_idx, KB)
        assert torch.equal(dense_from_table(q_num, q_idx, QB), kv_dense.transpose(-2, -1))
    block_map = bm.block_map()
    assert torch.equal(dense_from_table(bm.kv_num_blocks, bm.kv_indices, KB),
                       (block_map == 1).to(torch.int32))
    assert torch.equal(dense_from_table(bm.full_kv_num_blocks, bm.full_kv_indices, KB),
                       (block_map == 2).to(torch.int32))


def test_counts_and_sparsity_are_consistent():
    Q, KV = 191, 191
    for name, mod in mask_families(Q, KV, seed=9).items():
        bm = create_block_mask(mod, 2, 3, Q, KV, device="cpu", BLOCK_SIZE=32)
        block_map = bm.block_map()
        counts = bm.counts()
        assert counts == BlockCounts(full=int((block_map == 2).sum()),
                                     partial=int((block_map == 1).sum()),
                                     empty=int((block_map == 0).sum())), name
        assert isinstance(counts.full, int)
        # torch's definition: computed blocks count whole against the positions (191 is ragged).
        computed = (counts.full + counts.partial) * 32 * 32
        assert bm.sparsity() == pytest.approx(100 * (1 - computed / (2 * 3 * Q * KV)))
    causal_bm = create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=32)
    assert causal_bm.counts() == BlockCounts(full=28, partial=8, empty=28)
    assert causal_bm.sparsity() == pytest.approx(100 * 28 / 64)


def test_mods_returning_scalars_or_partial_broadcasts():
    def q_only(b, h, q_idx, kv_idx):  # shape (1, 1, Lq, 1)
        return q_idx < 50

    def constant_false(b, h, q_idx, kv_idx):
        return torch.tensor(False)

    bm = create_block_mask(q_only, 2, None, 97, 64, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(bm.block_map()[0, 0, :, 0], torch.tensor([2, 1, 0, 0], dtype=torch.int8))
    assert torch.equal(create_block_mask(noop_mask, None, None, 97, 64, device="cpu",
                                         BLOCK_SIZE=32).block_map(),
                       torch.full((1, 1, 4, 2), 2, dtype=torch.int8))
    empty = create_block_mask(constant_false, None, None, 97, 64, device="cpu", BLOCK_SIZE=32)
    assert empty.counts() == BlockCounts(full=0, partial=0, empty=8)
    assert empty.sparsity() == 100.0


def test_default_device_and_int32_indices():
    seen = {}

    def recording(b, h, q_idx, kv_idx):
        seen.update(b=b, h=h, q=q_idx, kv=kv_idx)
        return q_idx >= kv_idx

    bm = create_block_mask(recording, 2, 3, 40, 24, BLOCK_SIZE=16)
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert bm.kv_indices.device.type == expected_device
    assert seen["b"].shape == (2, 1, 1, 1) and seen["h"].shape == (1, 3, 1, 1)
    assert seen["q"].shape == (1, 1, 40, 1) and seen["kv"].shape == (1, 1, 1, 24)
    assert all(t.dtype == torch.int32 for t in seen.values())


# ------------------------------------------------------------------------------------------------
# Bounded memory
# ------------------------------------------------------------------------------------------------

def recorded_tiles(monkeypatch) -> list[int]:
    """The sizes (B·H·Lq·Lk) of the tiles create_block_mask evaluates its mod on, from now on.
    Recorded beside the mod, not inside it: a mod that appends to a captured list is a new mod at
    every call, and would be traced again per tile."""
    sizes = []
    evaluate = bmod._evaluate_mask

    def recorded(fn, kind, b, h, q, kv, device):
        sizes.append((b[1] - b[0]) * (h[1] - h[0]) * (q[1] - q[0]) * (kv[1] - kv[0]))
        return evaluate(fn, kind, b, h, q, kv, device)

    monkeypatch.setattr(bmod, "_evaluate_mask", recorded)
    return sizes


# The small budgets split every block into thousands of chunks: few batches and heads keep them short.
@pytest.mark.parametrize("budget,block_size,B,H", [(30000, 16, 2, 3), (3000, 16, 2, 3), (3000, (16, 32), 2, 3),
                                                  (100, 32, 1, 2)],
                         ids=["q_strips", "kv_runs", "kv_runs_rect", "inside_blocks"])
def test_chunked_classification_is_bounded_and_exact(monkeypatch, budget, block_size, B, H):
    Q, KV = 97, 131
    mod = mask_families(Q, KV, seed=21)["prefix_or_sliding_document"]
    reference = create_block_mask(mod, B, H, Q, KV, device="cpu", BLOCK_SIZE=block_size)
    monkeypatch.setattr(bmod, "_CHUNK_ELEMENTS", budget)
    monkeypatch.setattr(bmod, "_TABLE_CHUNK_ELEMENTS", 50)
    sizes = recorded_tiles(monkeypatch)
    chunked = create_block_mask(mod, B, H, Q, KV, device="cpu", BLOCK_SIZE=block_size)
    assert len(sizes) > 1 and max(sizes) <= budget
    for table in TABLES:
        assert torch.equal(getattr(chunked, table), getattr(reference, table)), table


def test_long_sequence_is_evaluated_in_bounded_tiles(monkeypatch):
    # 16384^2 = 268M positions, 4x the default budget: must be split, and the result is exact.
    S = 16384
    sizes = recorded_tiles(monkeypatch)
    bm = create_block_mask(causal, None, None, S, S, device="cpu")
    assert len(sizes) >= 4 and max(sizes) <= bmod._CHUNK_ELEMENTS
    QB = S // 128
    assert bm.counts() == BlockCounts(full=QB * (QB - 1) // 2, partial=QB,
                                      empty=QB * (QB - 1) // 2)
    assert torch.equal(bm.kv_num_blocks, torch.ones(1, 1, QB, dtype=torch.int32))
    assert torch.equal(bm.full_kv_num_blocks[0, 0], torch.arange(QB, dtype=torch.int32))
    assert torch.equal(bm.full_q_num_blocks[0, 0], torch.arange(QB - 1, -1, -1, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["causal", "document"])
def test_one_million_tokens_on_gpu(family):
    S = 1 << 20
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    doc = random_doc_ids(S, 64, g).to(device)
    mod = causal if family == "causal" else generate_document(doc, doc)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    bm = create_block_mask(mod, None, None, S, S, device=device)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    QB = S // 128
    table_bytes = QB * QB * 4
    # The four int32 index tables are needed; everything else stays below ~2.5 tables more.
    assert peak <= 6.5 * table_bytes, f"peak {peak / 2**30:.2f} GiB"
    counts = bm.counts()
    if family == "causal":
        assert counts == BlockCounts(full=QB * (QB - 1) // 2, partial=QB, empty=QB * (QB - 1) // 2)
    else:
        diagonal = bm.block_map()[0, 0].diagonal()
        assert bool((diagonal > 0).all())
        assert counts.full + counts.partial < QB * QB // 8


# ------------------------------------------------------------------------------------------------
# Slicing, round trips, conversions
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", [0, -1, (slice(None), 1), (slice(None), slice(None), slice(2, 5)),
                                   (1, slice(0, 2), 3),
                                   (slice(None), slice(None), torch.tensor([4, 0, 2])),
                                   (slice(None), torch.tensor(2)), (slice(None), slice(None), slice(10, None)),
                                   (slice(None), slice(None), torch.tensor([], dtype=torch.long))],
                         ids=["b0", "b-1", "h1", "rows2:5", "b1_h0:2_row3", "rows_tensor", "h_0d", "no_rows",
                              "no_rows_tensor"])
def test_slicing_equals_slicing_the_dense_form(index):
    mod = mask_families(97, 131, seed=4)["head_batch"]
    bm = create_block_mask(mod, 2, 3, 97, 131, device="cpu", BLOCK_SIZE=16)
    sliced = bm[index]
    full_index = index if isinstance(index, tuple) else (index,)
    dense = bm.block_map()
    for dim, item in enumerate(full_index):
        if isinstance(item, int):
            item = slice(item % dense.shape[dim], item % dense.shape[dim] + 1)
        elif isinstance(item, torch.Tensor):
            item = item.reshape(-1)
        dense = dense[(slice(None),) * dim + (item,)]
    assert sliced.kv_indices.dim() == 4
    assert torch.equal(sliced.block_map(), dense)
    assert sliced.seq_lengths == bm.seq_lengths and sliced.BLOCK_SIZE == bm.BLOCK_SIZE
    KB, QB = sliced.kv_indices.shape[-1], sliced.kv_indices.shape[-2]
    assert torch.equal(dense_from_table(sliced.q_num_blocks, sliced.q_indices, QB),
                       (dense == 1).to(torch.int32).transpose(-2, -1))
    assert torch.equal(dense_from_table(sliced.full_q_num_blocks, sliced.full_q_indices, QB),
                       (dense == 2).to(torch.int32).transpose(-2, -1))
    assert sliced.kv_indices.shape[-1] == KB
    with pytest.raises(InputError, match="with_mask_mod"):
        sliced.mask_mod(*bmod._index_tensors((0, 1), (0, 1), (0, 2), (0, 2), torch.device("cpu")))


def test_slicing_errors():
    bm = create_block_mask(causal, None, 2, 64, 64, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(IndexError, match="size-1 dim broadcasts"):
        bm[1]
    with pytest.raises(IndexError, match="head index 5"):
        bm[:, 5]
    with pytest.raises(IndexError, match="at most 3"):
        bm[0, 0, 0, 0]
    with pytest.raises(IndexError, match="1-d integer or bool"):
        bm[:, :, torch.zeros(2, 2, dtype=torch.int64)]


def test_with_mask_mod_and_dataclass_replace():
    bm = create_block_mask(causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    row = bm[:, :, 2]

    def shifted(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx + 70, kv_idx)

    decoded = row.with_mask_mod(shifted, seq_lengths=(1, 128))
    assert decoded.mask_mod is shifted and decoded.seq_lengths == (1, 128)
    assert decoded.kv_indices is row.kv_indices
    replaced = dataclasses.replace(row, mask_mod=shifted, seq_lengths=(1, 128))
    assert replaced.shape == (1, 1, 1, 128)
    assert replaced.kv_indices is row.kv_indices and replaced.version != row.version


def test_from_kv_blocks_round_trip():
    mod = mask_families(97, 131, seed=8)["causal_document"]
    bm = create_block_mask(mod, 2, 3, 97, 131, device="cpu", BLOCK_SIZE=(16, 32))
    rebuilt = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                       bm.full_kv_indices, BLOCK_SIZE=(16, 32), mask_mod=mod,
                                       seq_lengths=(97, 131))
    for table in TABLES:
        assert torch.equal(getattr(rebuilt, table), getattr(bm, table)), table
    no_q = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, compute_q_blocks=False,
                                    BLOCK_SIZE=16)
    assert no_q.q_indices is None and no_q.full_kv_indices is None
    assert no_q.seq_lengths == (7 * 16, 5 * 16) and no_q.mask_mod is noop_mask
    # Without full blocks, every listed block counts as partial.
    assert torch.equal(no_q.block_map(), (bm.block_map() == 1).to(torch.int8))


def test_from_kv_blocks_lifts_missing_batch_and_head_dims():
    num = torch.tensor([1, 2, 1], dtype=torch.int32)
    idx = torch.tensor([[0, 1, 2], [0, 2, 1], [2, 0, 1]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=8)
    assert bm.kv_indices.shape == (1, 1, 3, 3)
    assert torch.equal(bm.to_dense()[0, 0], torch.tensor([[1, 0, 0], [1, 0, 1], [0, 0, 1]],
                                                         dtype=torch.int32))
    assert torch.equal(bm.q_num_blocks[0, 0], torch.tensor([2, 0, 2], dtype=torch.int32))
    assert bm.q_indices[0, 0, 2, :2].tolist() == [1, 2]


def test_from_block_map_matches_create_block_mask():
    mod = mask_families(97, 97, seed=2)["sliding"]
    bm = create_block_mask(mod, None, 3, 97, 97, device="cpu", BLOCK_SIZE=16)
    again = BlockMask.from_block_map(bm.block_map(), 16, (97, 97), mod)
    for table in TABLES:
        assert torch.equal(getattr(again, table), getattr(bm, table)), table
    with pytest.raises(InputError, match="0 \\(empty\\), 1 \\(partial\\) or 2"):
        BlockMask.from_block_map(bm.block_map() * 2, 16, (97, 97))
    with pytest.raises(InputError, match="integer tensor"):
        BlockMask.from_block_map(bm.block_map().float(), 16, (97, 97))


def test_to_device_keeps_everything():
    bm = create_block_mask(causal, 2, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    moved = bm.to("cpu")
    assert moved is not bm and moved.mask_mod is causal and moved.seq_lengths == bm.seq_lengths
    for table in TABLES:
        assert torch.equal(getattr(moved, table), getattr(bm, table))


def test_text_forms():
    bm = create_block_mask(causal, None, 2, 64, 64, device="cpu", BLOCK_SIZE=16)
    text = bm.to_string()
    lines = text.splitlines()
    assert lines[1] == "b=0, h=0"
    assert lines[2:6] == ["▓▓      ", "██▓▓    ", "████▓▓  ", "██████▓▓"]
    coarse = bm.to_string(grid_size=2, limit=1).splitlines()
    # 2x2 blocks per cell: upper left has partial and empty, lower left is all full.
    assert coarse[2:4] == ["░░  ", "██░░"]
    assert "1 more" in coarse[-1]
    assert "sparsity=37.50%" in str(bm)
    r = repr(bm)
    assert "kv_indices=(1, 2, 4, 4)" in r and "mask_mod=causal" in r and "BLOCK_SIZE=(16, 16)" in r
    with pytest.raises(InputError, match="grid_size"):
        bm.to_string(grid_size=0)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def test_wrong_mod_arity_names_the_mod():
    def three(b, q_idx, kv_idx):
        return q_idx >= kv_idx

    def looks_like_score_mod(score, b, h, q_idx, kv_idx):
        return score

    with pytest.raises(ModSignatureError, match="three takes 3") as info:
        create_block_mask(three, None, None, 32, 32, device="cpu")
    assert info.value.lineno == three.__code__.co_firstlineno
    assert info.value.filename == __file__
    with pytest.raises(ModSignatureError, match="looks like a score_mod"):
        create_block_mask(looks_like_score_mod, None, None, 32, 32, device="cpu")
    with pytest.raises(ModSignatureError, match="4 positional arguments\\) or a score_mod"):
        create_mask(three, None, None, 8, 8, device="cpu")
    with pytest.raises(InputError, match="callable"):
        create_block_mask("causal", None, None, 32, 32, device="cpu")


def test_non_bool_result_is_reported():
    def distance(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def bad_shape(b, h, q_idx, kv_idx):
        return torch.ones(5, 5, dtype=torch.bool)

    with pytest.raises(ModReturnError, match="bool tensor.*torch.int32"):
        create_block_mask(distance, None, None, 32, 32, device="cpu")
    with pytest.raises(ModReturnError, match="does not broadcast"):
        create_block_mask(bad_shape, None, None, 32, 32, device="cpu")


def test_errors_inside_mods_name_the_line():
    ids = torch.zeros(10, dtype=torch.int64)

    def too_short(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]  # ids has 10 entries, the mask 32 positions

    def branches(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return q_idx > 0
        return kv_idx > 0

    # Refused before evaluation, with the tensor, its size and the first index out of range.
    with pytest.raises(ModError, match=r"`ids` \(captured, shape \(10,\)\) has size 10.*is 10") as info:
        create_block_mask(too_short, None, None, 32, 32, device="cpu")
    assert isinstance(info.value, IndexError)
    assert info.value.lineno == too_short.__code__.co_firstlineno + 1
    with pytest.raises(ControlFlowError, match="torch.where"):
        create_block_mask(branches, None, None, 32, 32, device="cpu")

    def takes_a_value(b, h, q_idx, kv_idx):
        return q_idx.item() > 3  # MARK-item

    def returns_nothing(b, h, q_idx, kv_idx):
        q_idx >= kv_idx  # noqa: B015 - the missing return is the test

    # As the lowering says for a score_mod: the value taken into Python, the missing return.
    with pytest.raises(ControlFlowError, match=r"value taken into Python \(.item\(\)") as info:
        create_block_mask(takes_a_value, None, None, 32, 32, device="cpu")
    assert info.value.lineno == takes_a_value.__code__.co_firstlineno + 1
    with pytest.raises(ModReturnError, match="bool tensor.*returned NoneType"):
        create_block_mask(returns_nothing, None, None, 32, 32, device="cpu")
    with pytest.raises(InputError, match="device='meta'.*build it on 'cpu' or 'cuda'"):
        create_block_mask(branches, None, None, 32, 32, device="meta")


@pytest.mark.parametrize("kwargs,match", [
    (dict(Q_LEN=0), "Q_LEN must be a positive int"),
    (dict(KV_LEN=-3), "KV_LEN must be a positive int"),
    (dict(Q_LEN=32.0), "Q_LEN must be a positive int"),
    (dict(B=0), "B must be a positive int or None"),
    (dict(H="2"), "H must be a positive int or None"),
    (dict(BLOCK_SIZE=0), "BLOCK_SIZE must be a positive int or a pair"),
    (dict(BLOCK_SIZE=(16,)), "length 1"),
    (dict(BLOCK_SIZE=(16, -16)), "BLOCK_SIZE must be a positive int or a pair"),
    (dict(BLOCK_SIZE=16.0), "BLOCK_SIZE must be a positive int or a pair"),
    (dict(BLOCK_SIZE=True), "BLOCK_SIZE must be a positive int or a pair"),
])
def test_bad_arguments(kwargs, match):
    args = dict(B=None, H=None, Q_LEN=32, KV_LEN=32, device="cpu", BLOCK_SIZE=16)
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        create_block_mask(causal, **args)


def test_from_kv_blocks_validation():
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    num, idx = bm.kv_num_blocks, bm.kv_indices
    fnum, fidx = bm.full_kv_num_blocks, bm.full_kv_indices
    with pytest.raises(InputError, match="integer tensor"):
        BlockMask.from_kv_blocks(num.float(), idx)
    with pytest.raises(InputError, match="must equal kv_indices.shape\\[:3\\]"):
        BlockMask.from_kv_blocks(num[:, :, :2], idx)
    with pytest.raises(InputError, match="given together"):
        BlockMask.from_kv_blocks(num, idx, fnum, None)
    with pytest.raises(InputError, match="full_kv_indices must have shape"):
        BlockMask.from_kv_blocks(num, idx, fnum[:, :, :2], fidx[:, :, :2])
    bad = idx.clone()
    bad[0, 0, 3, 0] = 7
    with pytest.raises(InputError, match="kv_indices\\[0, 0, 3, 0\\] = 7 points past the last key "
                                         "block.*must lie in \\[0, 4\\)"):
        BlockMask.from_kv_blocks(num, bad)
    # An int64 value that int32 would wrap into range is refused before the conversion.
    wrapped = idx.long()
    wrapped[0, 0, 3, 0] = 2 ** 32 + 1
    with pytest.raises(InputError, match="= 4294967297 points past the last key block"):
        BlockMask.from_kv_blocks(num.long(), wrapped)
    repeated = torch.tensor([[[[2, 0, 2, 3]]]], dtype=torch.int32)
    with pytest.raises(InputError, match="block 2 is listed twice"):
        BlockMask.from_kv_blocks(torch.tensor([[[3]]], dtype=torch.int32), repeated)
    with pytest.raises(InputError, match="each count must lie in \\[0, 4\\]"):
        BlockMask.from_kv_blocks(num + 4, idx)
    with pytest.raises(InputError, match="both as partial"):
        BlockMask.from_kv_blocks(num + fnum, fidx * 0 + torch.arange(4, dtype=torch.int32),
                                 fnum, fidx)


# ------------------------------------------------------------------------------------------------
# Validation of the tables: at construction, and unmodified afterwards
# ------------------------------------------------------------------------------------------------

def table_fields(bm, **changes):
    fields = {name: getattr(bm, name) for name in TABLES}
    fields.update(seq_lengths=bm.seq_lengths, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod)
    fields.update(changes)
    return fields


def test_constructor_validates_the_tables():
    bm = create_block_mask(causal, 2, None, 128, 96, device="cpu", BLOCK_SIZE=32)
    again = BlockMask(**table_fields(bm))  # valid tables pass
    assert again.shape == bm.shape and torch.equal(again.block_map(), bm.block_map())
    past = bm.kv_indices.clone()
    past[1, 0, 1, 0] = 5
    with pytest.raises(InputError, match=r"kv_indices\[1, 0, 1, 0\] = 5 points past the last key "
                                         r"block: .* must lie in \[0, 3\) \(3 key blocks"):
        BlockMask(**table_fields(bm, kv_indices=past))
    negative = bm.full_q_indices.clone()
    negative[0, 0, 0, 0] = -1
    with pytest.raises(InputError, match=r"full_q_indices\[0, 0, 0, 0\] = -1 points before the "
                                         r"first query block.*\[0, 4\)"):
        BlockMask(**table_fields(bm, full_q_indices=negative))
    counts = bm.full_kv_num_blocks + 3
    with pytest.raises(InputError, match=r"full_kv_num_blocks\[0, 0, 1\] = 4: each count must lie "
                                         r"in \[0, 3\]"):
        BlockMask(**table_fields(bm, full_kv_num_blocks=counts))
    unordered = bm.full_kv_indices.clone()
    unordered[..., 3, :2] = unordered[..., 3, :2].flip(-1)  # row 3 lists [1, 0, 2]
    with pytest.raises(InputError, match=r"full_kv_indices\[0, 0, 3\] lists \[1, 0, 2\]: they must "
                                         r"be strictly increasing \(BlockMask.from_kv_blocks sorts"):
        BlockMask(**table_fields(bm, full_kv_indices=unordered))
    both = bm.kv_indices.clone()
    both[..., 1, 0] = 0  # row 1 lists block 0 as partial; it is full already
    with pytest.raises(InputError, match=r"block \[0, 0, 1, 0\] is listed both as partial"):
        BlockMask(**table_fields(bm, kv_indices=both))
    with pytest.raises(InputError, match="int32.*from_kv_blocks, which converts"):
        BlockMask(**table_fields(bm, kv_indices=bm.kv_indices.long()))
    with pytest.raises(InputError, match="q_indices must have shape"):
        BlockMask(**table_fields(bm, q_indices=bm.q_indices[:, :, :2],
                                 q_num_blocks=bm.q_num_blocks[:, :, :2]))


def test_in_place_edit_is_detected():
    bm = create_block_mask(causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    bm.check_unmodified()
    row = bm[:, :, 2:4]  # a view of the parent's tables: it shares their version counters
    rows = bm[:, :, torch.tensor([0, 1])]  # a copy of those rows
    copy = bm.with_mask_mod(causal)
    bm.kv_indices[0, 0, 3, 0] = 7  # past the last key block, after construction
    for mask in (bm, copy, row):
        with pytest.raises(InputError, match=r"kv_indices was modified in place after the "
                                             r"BlockMask was built; rebuild it with "
                                             r"BlockMask.from_kv_blocks\(\.\.\.\)"):
            mask.check_unmodified()
    rows.check_unmodified()
    for derive in (lambda: bm[:, :, 1], lambda: bm.with_mask_mod(causal), lambda: bm.to("cpu"),
                   lambda: bm._adjust(64, 64), lambda: bm.to_torch()):
        with pytest.raises(InputError, match="modified in place"):
            derive()
    # A new mask from the edited tables checks them again.
    with pytest.raises(InputError, match=r"kv_indices\[0, 0, 3, 0\] = 7 points past"):
        dataclasses.replace(bm)
    with pytest.raises(InputError, match=r"cannot assign|kv_indices\[0, 0, 3, 0\] = 7 points past"):
        bm.kv_indices = bm.kv_indices
    bm.kv_indices[0, 0, 3, 0] = 3
    # Assigning the edited table checks it again, and drops the transposed tables made from it.
    bm.kv_indices = bm.kv_indices
    bm.check_unmodified()
    assert bm.q_indices is None
    fixed = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                     bm.full_kv_indices, BLOCK_SIZE=32)
    fixed.check_unmodified()
    # Copies record the versions of their own tensors.
    import copy as copy_module
    import pickle
    copy_module.deepcopy(fixed).check_unmodified()
    pickle.loads(pickle.dumps(fixed.with_mask_mod(None))).check_unmodified()


def test_tables_made_in_inference_mode_are_accepted():
    with torch.inference_mode():
        bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    bm.check_unmodified()  # inference tensors have no version counter: nothing to compare
    assert bm[:, :, 1].counts().partial == 1


def test_check_unmodified_is_cheap():
    # It runs before every launch: a few attribute reads and integer comparisons on the host.
    bm = create_block_mask(causal, 2, 2, 256, 256, device="cpu", BLOCK_SIZE=32)
    import timeit
    per_call = min(timeit.repeat(bm.check_unmodified, number=2000, repeat=5)) / 2000
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per call"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_validation_on_gpu_tables():
    bm = create_block_mask(causal, 2, 4, 4096, 4096, device="cuda")
    fields = table_fields(bm)
    BlockMask(**fields).check_unmodified()
    past = bm.kv_indices.clone()
    past[1, 2, 5, 0] = 32
    with pytest.raises(InputError, match=r"kv_indices\[1, 2, 5, 0\] = 32 points past the last key "
                                         r"block.*\[0, 32\)"):
        BlockMask(**table_fields(bm, kv_indices=past))
    bm.full_kv_indices[0, 0, 9, 0] = 1
    with pytest.raises(InputError, match="full_kv_indices was modified in place"):
        bm.check_unmodified()


def _kv_below_70(b, h, q_idx, kv_idx):
    return kv_idx < 70


def test_growing_past_a_ragged_edge_lists_that_block_as_partial():
    """The edge block of a length that cuts it short is classified over its in-range positions (so
    here it is full); lengths grown past that edge (by _adjust or seq_lengths) add positions never
    classified: the block becomes partial and the mask_mod decides them, as in torch."""
    from flexcore import flex_attention

    L, S, grown_len = 32, 70, 80
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16, dtype=torch.float64, generator=gen) for n in (L, grown_len, grown_len))
    keep = (torch.arange(grown_len) < 70).expand(L, grown_len)
    expected = torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(~keep, float("-inf")), -1) @ v
    mask = create_block_mask(_kv_below_70, 1, 1, L, S, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask._adjust(L, grown_len)), expected)
    grown = create_block_mask(_kv_below_70, 1, 1, L, S, device="cpu", BLOCK_SIZE=16)
    grown.seq_lengths = (L, grown_len)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=grown), expected)
    # Cropping, or growing past an edge that cut no block short, keeps the tables.
    whole = create_block_mask(_kv_below_70, 1, 1, 32, 64, device="cpu", BLOCK_SIZE=16)
    assert whole._adjust(32, 60).full_kv_num_blocks.tolist() == [[[4, 4]]]
    assert mask._adjust(30, 70).full_kv_num_blocks.tolist() == [[[5, 5]]]
    assert mask._adjust(32, 80).full_kv_num_blocks.tolist() == [[[4, 4]]]
    assert mask._adjust(32, 80).kv_num_blocks.tolist() == [[[1, 1]]]
