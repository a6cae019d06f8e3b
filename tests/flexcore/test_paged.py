"""PagedAttention: the page allocator, cache writes, and paged decoding equal to a contiguous cache."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flexcore import create_block_mask, flex_attention
from flexcore.decoding import offset_mask_mod, offset_score_mod
from flexcore.errors import InputError
from flexcore.kernels import codegen
from flexcore.lowering import lower_score_mod
from flexcore.paged import PagedAttention
from tests.flexcore.compare import assert_matches_reference, rel_err, seed_of
from tests.flexcore.helpers import run_decode

DEVICE = "cpu"


def logical_cache(paged: PagedAttention, cache: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """(H, length, D): a sequence's positions gathered from the physical cache through the page table."""
    pos = torch.arange(length)
    pages = paged.page_table[batch, pos // paged.page_size].cpu()
    return cache[0][:, (pages * paged.page_size + pos % paged.page_size).to(cache.device)]


def snapshot(paged: PagedAttention):
    return (paged.page_table.clone(), paged.physical_to_logical.clone(), paged.capacity.clone(),
            list(paged.empty_pages))


def assert_same_state(paged: PagedAttention, before):
    table, p2l, capacity, empty = before
    assert torch.equal(paged.page_table, table)
    assert torch.equal(paged.physical_to_logical, p2l)
    assert torch.equal(paged.capacity, capacity)
    assert paged.empty_pages == empty


# -- allocator ----------------------------------------------------------------------------------

def test_reserve_allocates_whole_pages():
    paged = PagedAttention(n_pages=8, page_size=16, max_batch_size=3, device=DEVICE)
    paged.reserve(torch.tensor(1), torch.tensor(20))  # 2 pages
    assert paged.capacity.tolist() == [0, 32, 0]
    assert paged.reserved_length(1) == 32
    pages = paged.page_table[1, :2].tolist()
    assert len(set(pages)) == 2 and (paged.page_table[1, 2:] == -1).all()
    assert paged.physical_to_logical[1, pages].tolist() == [0, 1]
    paged.reserve(1, 30)  # already covered: nothing changes
    assert paged.capacity[1] == 32 and len(paged.empty_pages) == 6
    paged.reserve(1, 33)  # grows by one page, keeping the first two
    assert paged.page_table[1, :2].tolist() == pages and paged.page_table[1, 2] >= 0
    assert paged.physical_to_logical[1, paged.page_table[1, 2]] == 2
    assert paged.capacity[1] == 48 and len(paged.empty_pages) == 5


def test_erase_frees_pages_for_reuse():
    paged = PagedAttention(n_pages=4, page_size=16, max_batch_size=2, device=DEVICE)
    paged.reserve(0, 64)
    owned = sorted(paged.page_table[0].tolist())
    assert owned == [0, 1, 2, 3] and not paged.empty_pages
    paged.erase(torch.tensor(0))
    assert (paged.page_table[0] == -1).all() and (paged.physical_to_logical[0] == -1).all()
    assert paged.capacity[0] == 0 and sorted(paged.empty_pages) == owned
    paged.reserve(1, 40)
    assert paged.capacity[1] == 48 and len(paged.empty_pages) == 1


def test_out_of_pages_is_an_error_and_changes_nothing():
    paged = PagedAttention(n_pages=4, page_size=16, max_batch_size=2, device=DEVICE)
    paged.reserve(0, 40)
    before = snapshot(paged)
    with pytest.raises(InputError, match=r"out of pages: needs 2 more pages .* only 1 of 4 are free"):
        paged.reserve(1, 17)
    assert_same_state(paged, before)


def test_bad_batch_indices():
    paged = PagedAttention(n_pages=4, page_size=16, max_batch_size=2, device=DEVICE)
    with pytest.raises(InputError, match=r"batch_idx 2 is out of range \[0, 2\)"):
        paged.reserve(2, 10)
    with pytest.raises(InputError, match="holds no pages"):
        paged.erase(0)
    paged.reserve(0, 10)
    paged.erase(0)
    with pytest.raises(InputError, match="already erased"):
        paged.erase(0)
    with pytest.raises(InputError, match="positive int"):
        PagedAttention(n_pages=0, page_size=16, max_batch_size=2, device=DEVICE)


def test_assign_writes_logical_positions():
    gen = torch.Generator().manual_seed(1)
    paged = PagedAttention(n_pages=10, page_size=8, max_batch_size=3, device=DEVICE)
    H, D, Dv = 2, 16, 8
    k_cache, v_cache = torch.zeros(1, H, 80, D), torch.zeros(1, H, 80, Dv)
    paged.reserve(2, 19)
    paged.reserve(0, 30)
    k, v = torch.randn(2, H, 19, D, generator=gen), torch.randn(2, H, 19, Dv, generator=gen)
    paged.assign(torch.tensor([2, 0]), torch.arange(19).expand(2, 19), k, v, k_cache, v_cache)
    for row, batch in enumerate([2, 0]):
        assert torch.equal(logical_cache(paged, k_cache, batch, 19), k[row])
        assert torch.equal(logical_cache(paged, v_cache, batch, 19), v[row])
    # Single-token writes at scattered positions (a decode step for each sequence).
    k1, v1 = torch.randn(2, H, 1, D, generator=gen), torch.randn(2, H, 1, Dv, generator=gen)
    paged.assign(torch.tensor([0, 2]), torch.tensor([[29], [3]]), k1, v1, k_cache, v_cache)
    assert torch.equal(logical_cache(paged, k_cache, 0, 30)[:, 29], k1[0, :, 0])
    assert torch.equal(logical_cache(paged, v_cache, 2, 19)[:, 3], v1[1, :, 0])


def test_assign_errors_leave_the_cache_untouched():
    paged = PagedAttention(n_pages=6, page_size=8, max_batch_size=3, device=DEVICE)
    H, D = 2, 16
    k_cache, v_cache = torch.randn(1, H, 48, D), torch.randn(1, H, 48, D)
    saved = k_cache.clone(), v_cache.clone()
    paged.reserve(0, 10)  # 16 tokens reserved
    k, v = torch.randn(1, H, 4, D), torch.randn(1, H, 4, D)
    with pytest.raises(InputError, match=r"input_pos\[0, 3\] = 16 is past the reserved length 16"):
        paged.assign(torch.tensor([0]), torch.tensor([[13, 14, 15, 16]]), k, v, k_cache, v_cache)
    with pytest.raises(InputError, match="batch_idx 1 holds no pages"):
        paged.assign(torch.tensor([1]), torch.tensor([[0, 1, 2, 3]]), k, v, k_cache, v_cache)
    paged.reserve(2, 8)
    paged.erase(2)
    with pytest.raises(InputError, match="batch_idx 2 holds no pages"):
        paged.assign(torch.tensor([2]), torch.tensor([[0, 1, 2, 3]]), k, v, k_cache, v_cache)
    with pytest.raises(InputError, match=r"k_val has shape \(1, 2, 4, 8\)"):
        paged.assign(torch.tensor([0]), torch.tensor([[0, 1, 2, 3]]), k[..., :8], v, k_cache, v_cache)
    with pytest.raises(InputError, match="v_cache has shape"):
        paged.assign(torch.tensor([0]), torch.tensor([[0, 1, 2, 3]]), k, v, k_cache, v_cache[:, :, :40])
    # Two writes to one slot (index_copy_ keeps no defined one): a position repeated, or one
    # sequence named twice with a shared position.
    with pytest.raises(InputError, match="two new tokens have one cache slot"):
        paged.assign(torch.tensor([0]), torch.tensor([[0, 1, 1, 3]]), k, v, k_cache, v_cache)
    with pytest.raises(InputError, match="two new tokens have one cache slot"):
        paged.assign(torch.tensor([0, 0]), torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]]), k.expand(2, -1, -1, -1),
                     v.expand(2, -1, -1, -1), k_cache, v_cache)
    assert torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1])


def test_convert_needs_page_sized_blocks():
    paged = PagedAttention(n_pages=4, page_size=32, max_batch_size=1, device=DEVICE)
    paged.reserve(0, 64)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    with pytest.raises(InputError, match="key BLOCK_SIZE 16 but page_size is 32"):
        paged.convert_logical_block_mask(bm)


def test_convert_errors_name_the_batch():
    paged = PagedAttention(n_pages=4, page_size=16, max_batch_size=3, device=DEVICE)
    paged.reserve(0, 20)
    paged.reserve(1, 20)
    paged.erase(1)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, 2, None, 1, 32, device=DEVICE, BLOCK_SIZE=16)
    with pytest.raises(InputError, match="batch_idx 1 holds no pages"):
        paged.convert_logical_block_mask(bm)
    paged.reserve(1, 5)
    paged.reserve(2, 5)
    with pytest.raises(InputError, match="block_mask has batch 2 but batch_idx has 3"):
        paged.convert_logical_block_mask(bm, batch_idx=torch.tensor([0, 1, 2]))
    with pytest.raises(InputError, match=r"kv_len must be a \(2,\) int tensor"):
        paged.convert_logical_block_mask(bm, kv_len=torch.tensor([3]))
    # The wrappers check what they wrap (else the wrapped call fails later, under their name).
    with pytest.raises(InputError, match="get_mask_mod: mask_mod must be None or a callable"):
        paged.get_mask_mod(5)
    with pytest.raises(InputError, match="get_score_mod: score_mod must be None or a callable"):
        paged.get_score_mod("x")
    with pytest.raises(InputError, match=r"get_mask_mod: kv_len must be None or a \(B,\) integer tensor"):
        paged.get_mask_mod(None, kv_len=[5, 6])


def test_physical_mask_from_get_mask_mod():
    # torch's other recipe: build the BlockMask directly over the physical cache from get_mask_mod;
    # pages of other sequences and unreserved pages are masked by the wrapped mod itself.
    gen = torch.Generator().manual_seed(12)
    page, Hq, Hkv, D, L = 16, 2, 2, 16, 1
    paged, k, v, k_cache, v_cache = build_paged([40, 23], [1, 0], Hkv, D, page, 10, gen)
    q = torch.randn(2, Hq, L, D, generator=gen)
    offset = torch.tensor([39, 22])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask_mod = offset_mask_mod(causal, offset)
    physical = create_block_mask(paged.get_mask_mod(mask_mod, batch_idx=torch.tensor([1, 0])), 2, None,
                                 L, k_cache.shape[2], device=DEVICE, BLOCK_SIZE=page)
    out, _ = run_decode(q, k_cache, v_cache, None, physical)
    logical = create_block_mask(mask_mod, 2, None, L, k.shape[2], device=DEVICE, BLOCK_SIZE=page)
    gold, _ = run_decode(q, k, v, None, logical)
    assert rel_err(out, gold) < 1e-6


# -- paged attention == contiguous attention ----------------------------------------------------

def build_paged(lengths, slots, Hkv, D, page_size, n_pages, gen, dtype=torch.float32):
    """A paged cache holding random sequences of the given lengths, and the same data contiguous."""
    paged = PagedAttention(n_pages=n_pages, page_size=page_size, max_batch_size=max(slots) + 2,
                           device=DEVICE)
    k_cache = torch.zeros(1, Hkv, n_pages * page_size, D, dtype=dtype)
    v_cache = torch.zeros(1, Hkv, n_pages * page_size, D, dtype=dtype)
    S = max(lengths)
    k = torch.randn(len(lengths), Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(len(lengths), Hkv, S, D, generator=gen).to(dtype)
    paged.reserve(max(slots) + 1, 2 * page_size)  # another sequence's pages sit in between
    for i, (slot, n) in enumerate(zip(slots, lengths)):
        paged.reserve(slot, n)
        paged.assign(torch.tensor([slot]), torch.arange(n)[None], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                     k_cache, v_cache)
    return paged, k, v, k_cache, v_cache


@pytest.mark.parametrize("variant", ["noop", "causal_alibi", "sliding_window", "document"])
def test_paged_equals_contiguous(variant):
    gen = torch.Generator().manual_seed(seed_of("paged", variant))
    page, Hq, Hkv, D, L = 32, 4, 2, 32, 2
    lengths, slots = [70, 130, 33], [2, 0, 3]
    paged, k, v, k_cache, v_cache = build_paged(lengths, slots, Hkv, D, page, 20, gen)
    B, S = len(lengths), max(lengths)
    q = torch.randn(B, Hq, L, D, generator=gen)
    offset = torch.tensor([n - L for n in lengths])
    slopes = torch.rand(Hq, generator=gen)
    doc_ids = torch.arange(S) // 25

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)

    def document(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

    score_mod = offset_score_mod(alibi, offset) if variant == "causal_alibi" else None
    mask_mod = {"noop": offset_mask_mod(causal, offset), "causal_alibi": offset_mask_mod(causal, offset),
                "sliding_window": offset_mask_mod(sliding_window, offset),
                "document": offset_mask_mod(document, offset)}[variant]
    if variant == "noop":
        # Every position of every sequence (S is the longest): the valid lengths come from kv_len.
        mask_mod = None
    logical = create_block_mask(mask_mod or (lambda b, h, q_idx, kv_idx: kv_idx >= 0), B, None, L, S,
                                device=DEVICE, BLOCK_SIZE=(16, page))
    kv_len = torch.tensor(lengths) if variant == "noop" else None
    contiguous_bm = logical
    if kv_len is not None:
        contiguous_bm = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < kv_len[b], B, None, L, S,
                                          device=DEVICE, BLOCK_SIZE=(16, page))
    out, lse = run_decode(q, k, v, score_mod, contiguous_bm, num_splits=2)
    assert_matches_reference(q, k, v, score_mod, contiguous_bm, out, lse, variant)

    batch_idx = torch.tensor(slots)
    paged_bm = paged.convert_logical_block_mask(logical, batch_idx=batch_idx, kv_len=kv_len)
    assert paged_bm.seq_lengths == (L, k_cache.shape[2])
    paged_score = paged.get_score_mod(score_mod, batch_idx=batch_idx)
    paged_out, paged_lse = run_decode(q, k_cache, v_cache, paged_score, paged_bm, num_splits=2)
    assert rel_err(paged_out, out) < 1e-6 and torch.allclose(paged_lse, lse, atol=1e-5)


def test_paged_identity_score_stays_trivial():
    # No score_mod on a converted mask must keep the kernels' fast path (no per-score gather).
    paged = PagedAttention(n_pages=4, page_size=16, max_batch_size=1, device=DEVICE)
    assert lower_score_mod(paged.get_score_mod(None)).is_trivial
    assert not lower_score_mod(paged.get_score_mod(lambda s, b, h, q, kv: s * 2)).is_trivial


def test_new_pages_do_not_recompile():
    gen = torch.Generator().manual_seed(5)
    page, Hq, Hkv, D = 32, 4, 2, 16
    paged, k, v, k_cache, v_cache = build_paged([40, 90], [0, 1], Hkv, D, page, 12, gen)
    offset = torch.tensor([39, 89])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask_mod = offset_mask_mod(causal, offset)
    compiles = None
    for step in range(3):
        q = torch.randn(2, Hq, 1, D, generator=gen)
        logical = create_block_mask(mask_mod, 2, None, 1, k.shape[2], device=DEVICE, BLOCK_SIZE=(16, page))
        paged_bm = paged.convert_logical_block_mask(logical)
        paged_out, _ = run_decode(q, k_cache, v_cache, paged.get_score_mod(None), paged_bm)
        gold = run_decode(q, k, v, None, logical)[0]
        if compiles is None:
            compiles = codegen.compile_count
        assert codegen.compile_count == compiles, f"recompiled at step {step}"
        assert rel_err(paged_out, gold) < 1e-6
        # Next token: grow both sequences by one, crossing into a new page for the first one.
        new_len = [int(offset[0]) + 2 + 24 * step, int(offset[1]) + 2]
        for i, n in enumerate(new_len):
            paged.reserve(i, n)
        k_new = torch.randn(2, Hkv, max(new_len), D, generator=gen)
        v_new = torch.randn(2, Hkv, max(new_len), D, generator=gen)
        k_new[:, :, :k.shape[2]], v_new[:, :, :k.shape[2]] = k, v
        for i, n in enumerate(new_len):
            paged.assign(torch.tensor([i]), torch.arange(n)[None], k_new[i:i + 1, :, :n],
                         v_new[i:i + 1, :, :n], k_cache, v_cache)
        k, v = k_new, v_new
        offset.copy_(torch.tensor(new_len) - 1)


def test_converted_mask_is_refused_after_the_page_table_changes():
    # What this guards against: a mask converted before erase + reserve lists pages that hold
    # another sequence's keys afterwards, and its full blocks would read them unmasked.
    gen = torch.Generator().manual_seed(seed_of("stale paged mask"))
    page, H, D = 16, 2, 16
    paged = PagedAttention(n_pages=6, page_size=page, max_batch_size=2, device=DEVICE)
    k_cache, v_cache = torch.zeros(1, H, 6 * page, D), torch.zeros(1, H, 6 * page, D)
    paged.reserve(0, 40)
    k, v = torch.randn(1, H, 40, D, generator=gen), torch.randn(1, H, 40, D, generator=gen)
    paged.assign(torch.tensor([0]), torch.arange(40)[None], k, v, k_cache, v_cache)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, 1, None, 1, 40,
                                device=DEVICE, BLOCK_SIZE=(16, page))
    old = paged.convert_logical_block_mask(logical)
    version = paged.version
    # Writing keys and reserving what is already reserved move no page: the mask stays valid.
    paged.assign(torch.tensor([0]), torch.tensor([[39]]), k[:, :, :1], v[:, :, :1], k_cache, v_cache)
    paged.reserve(0, 30)
    assert paged.version == version
    old.check_unmodified()
    row = old.with_mask_mod(old.mask_mod)
    paged.reserve(1, 16)  # another sequence's pages: the mask reads none of them
    old.check_unmodified()
    paged.erase(0)
    paged.reserve(1, 40)  # sequence 1 now holds the pages sequence 0 had
    assert paged.version == version + 3
    stale = "pages of batch_idx 0, but erase/reserve changed them since.*Convert the logical mask again"
    for mask in (old, row, dataclasses.replace(old)):
        with pytest.raises(InputError, match=stale):
            mask.check_unmodified()
    with pytest.raises(InputError, match=stale):
        old[:, :, 0]
    paged.reserve(0, 40)
    paged.convert_logical_block_mask(logical).check_unmodified()
    # A mask built over the physical cache from get_mask_mod holds for its page table too.
    physical = create_block_mask(paged.get_mask_mod(None), 2, None, 1, 6 * page, device=DEVICE,
                                 BLOCK_SIZE=page)
    physical.check_unmodified()
    paged.erase(1)
    with pytest.raises(InputError, match="pages of batch_idx 1, but erase/reserve changed them"):
        physical.check_unmodified()


def test_flex_attention_refuses_a_stale_paged_mask():
    from flexcore import flex_attention

    page, H, D = 16, 2, 16
    paged = PagedAttention(n_pages=4, page_size=page, max_batch_size=2, device=DEVICE)
    k_cache, v_cache = torch.randn(1, H, 4 * page, D), torch.randn(1, H, 4 * page, D)
    paged.reserve(0, 32)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, 1, None, 1, 32,
                                device=DEVICE, BLOCK_SIZE=(16, page))
    old = paged.convert_logical_block_mask(logical)
    paged.erase(0)
    paged.reserve(1, 32)
    with pytest.raises(InputError, match="Convert the logical mask again"):
        flex_attention(torch.randn(1, H, 1, D), k_cache, v_cache, block_mask=old)


# -- GPU (run with -m gpu on the device) ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("S", [8192, 65536])
def test_paged_decode_gpu(S):
    """Paged decoding over scattered pages matches the reference, as the contiguous cache does
    (page 128). Its latency against the contiguous cache is measured by the benchmark:
    ``python -m bench run --config decode`` (provider flexlab_paged)."""
    from flexcore.attention import kv_blocks
    from flexcore.kernels.decode import decode
    from flexcore.lowering import lower_mask_mod
    from flexcore.options import KernelOptions

    B, Hq, Hkv, D, page = 8, 32, 8, 128, 128
    dtype, dev = torch.bfloat16, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dtype, generator=gen)
    n_pages = B * S // page
    paged = PagedAttention(n_pages, page, B, device=dev)
    k_cache = torch.zeros(1, Hkv, n_pages * page, D, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # Reserve in interleaved chunks so that each sequence's pages are scattered over the cache.
    for chunk in range(1, 5):
        for b in range(B):
            paged.reserve(b, S * chunk // 4)
    paged.assign(torch.arange(B, device=dev), torch.arange(S, device=dev).expand(B, S), k, v,
                 k_cache, v_cache)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, B, None, 1, S, device=dev)
    paged_bm = paged.convert_logical_block_mask(logical)
    scale = 1.0 / math.sqrt(D)

    def call(qq, kk, vv, bm, score_mod):
        args = (qq, kk, vv, lower_score_mod(score_mod), lower_mask_mod(bm.mask_mod),
                kv_blocks(bm, B, Hq), scale, KernelOptions())
        return lambda: decode(*args)

    contiguous = call(q, k, v, logical, None)
    paged_call = call(q, k_cache, v_cache, paged_bm, paged.get_score_mod(None))
    # Both against the float64 reference (they may differ from each other by rounding: the two
    # layouts can autotune to different tiles).
    # The float64 reference runs two sequences at a time (a 64k cache in float64 is large).
    shared = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, None, None, 1, S, device=dev)
    for what, fn in (("contiguous", contiguous), ("paged", paged_call)):
        out, lse = fn()
        for b in range(0, B, 2):
            part = slice(b, b + 2)
            assert_matches_reference(q[part], k[part], v[part], None, shared, out[part], lse[part],
                                     f"{what} S={S} batch {b}")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_call_refuses_a_conversion_whose_pages_were_erased_and_reused(dynamic):
    """Under torch.compile a converted mask whose sequence was erased (its pages now another
    sequence's) is refused as in an eager call, not attended silently over the new owner's keys."""
    torch._dynamo.reset()
    H, D = 2, 16
    paged = PagedAttention(n_pages=8, page_size=16, max_batch_size=2, device="cpu")
    k_cache, v_cache = torch.randn(1, H, 128, D), torch.randn(1, H, 128, D)
    paged.reserve(torch.tensor(0), torch.tensor(40))
    logical = create_block_mask(lambda b, h, q, kv: kv >= 0, 1, None, 1, 128, BLOCK_SIZE=(16, 16))
    bm = paged.convert_logical_block_mask(logical, batch_idx=torch.tensor([0]),
                                          kv_len=torch.tensor([40]))
    q = torch.randn(1, H, 1, D)
    compiled = torch.compile(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm),
                             backend="eager", dynamic=dynamic)
    compiled(q, k_cache, v_cache, bm)
    paged.erase(torch.tensor(0))
    paged.reserve(torch.tensor(1), torch.tensor(40))
    with pytest.raises(InputError, match="erase/reserve changed them"):
        compiled(q, k_cache, v_cache, bm)
