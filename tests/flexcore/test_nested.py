"""Ragged batches as jagged nested tensors: create_nested_block_mask and nested_flex_attention
against the same packed batch run with a document mask written out by hand (flexcore), the
float64 reference and torch's eager flex_attention."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as tfa

from flexcore import create_block_mask, create_mask, flex_attention
from flexcore.errors import InputError
from flexcore.nested import create_nested_block_mask, nested_flex_attention
from flexcore.reference import flex_attention_reference
from tests.flexcore.compare import assert_matches_reference, rel_err, seed_of

# Ragged lengths summing to 121 (no multiple of a block); the middle one spans two 32-blocks.
Q_LENGTHS = [37, 64, 20]
KV_LENGTHS = [50, 9, 33]


def ragged(lengths, H, D, gen, requires_grad=False):
    """(leaf NJT (N, j, H, D), its packed copy (total, H, D) as a second leaf)."""
    parts = [torch.randn(n, H, D, generator=gen) for n in lengths]
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad)
    packed = torch.cat(parts).requires_grad_(requires_grad)
    return nt, packed


def attention_layout(nt):
    return nt.transpose(1, 2)  # (N, j, H, D) -> (N, H, j, D)


def packed_layout(packed):
    """(total, H, D) -> the packed problem (1, H, total, D). An attention-layout NJT
    (N, H, j, D) holds its values as (H, total, D) already: ``nt.values()[None]``."""
    return packed.transpose(0, 1).unsqueeze(0)


def local_positions(lengths):
    """(sequence id, position within it) of each stacked position, with plain Python."""
    seq, pos = [], []
    for i, n in enumerate(lengths):
        seq += [i] * n
        pos += list(range(n))
    return torch.tensor(seq), torch.tensor(pos)


WINDOWS = torch.tensor([5, 100, 8])  # per sequence: the mods read it at b = sequence index
SEQ_BIAS = torch.tensor([0.5, -1.0, 2.0])


def windowed_causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOWS[b])


def packed_keep(q_lengths, kv_lengths, rule):
    """(total_q, total_kv) bool: ``rule`` on local positions within a sequence, False across."""
    q_seq, q_pos = local_positions(q_lengths)
    kv_seq, kv_pos = local_positions(kv_lengths)
    same = q_seq[:, None] == kv_seq[None, :]
    return same & rule(q_seq[:, None], q_pos[:, None], kv_pos[None, :])


def test_nested_block_mask_keeps_each_sequence_to_itself():
    gen = torch.Generator().manual_seed(seed_of("nested mask"))
    q_nt, _ = ragged(Q_LENGTHS, 2, 8, gen)
    kv_nt, _ = ragged(KV_LENGTHS, 2, 8, gen)
    for kv, kv_lengths in ((None, Q_LENGTHS), (kv_nt, KV_LENGTHS)):
        mask = create_nested_block_mask(windowed_causal, 1, None, q_nt, kv, BLOCK_SIZE=32)
        keep = packed_keep(Q_LENGTHS, kv_lengths,
                           lambda s, q, kv: (q >= kv) & (q - kv <= WINDOWS[s]))
        assert mask.seq_lengths == (sum(Q_LENGTHS), sum(kv_lengths))
        dense = create_mask(mask.mask_mod, 1, 1, *mask.seq_lengths, device="cpu")[0, 0]
        assert torch.equal(dense, keep)
        # Blocks: empty where no position is kept, full where all in range are.
        for i in range(mask.kv_indices.shape[2]):
            for j in range(mask.kv_indices.shape[3]):
                block = keep[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32]
                expected = 2 if block.all() else 1 if block.any() else 0
                assert int(mask.block_map()[0, 0, i, j]) == expected, (i, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nested_forward_equals_packed_document_mask(dtype):
    gen = torch.Generator().manual_seed(seed_of("nested forward", dtype))
    H, D = 2, 16
    (q_nt, q_packed), (k_nt, k_packed), (v_nt, v_packed) = (ragged(Q_LENGTHS, H, D, gen)
                                                            for _ in range(3))
    q_nt, k_nt, v_nt = (attention_layout(t.to(dtype)) for t in (q_nt, k_nt, v_nt))
    slopes = torch.rand(H, generator=gen)

    def alibi(score, b, h, q_idx, kv_idx):  # written for one sequence
        return score - slopes[h] * (q_idx - kv_idx) + SEQ_BIAS[b]

    mask = create_nested_block_mask(windowed_causal, 1, None, q_nt, BLOCK_SIZE=32)
    out, lse = nested_flex_attention(q_nt, k_nt, v_nt, score_mod=alibi, block_mask=mask,
                                     return_lse=True)
    assert out.is_nested and out.shape[:2] == (3, H) and out._ragged_idx == 2
    assert torch.equal(out.offsets(), q_nt.offsets()) and out.dtype == dtype
    assert lse.is_nested and lse.shape[:2] == (3, H) and torch.equal(lse.offsets(), q_nt.offsets())

    # The same batch packed, with the document mask and the bias written out by hand.
    total = sum(Q_LENGTHS)
    keep = packed_keep(Q_LENGTHS, Q_LENGTHS, lambda s, q, kv: (q >= kv) & (q - kv <= WINDOWS[s]))
    seq, pos = local_positions(Q_LENGTHS)
    bias = -slopes[:, None, None] * (pos[:, None] - pos[None, :]) + SEQ_BIAS[seq][:, None]

    def packed_mask(b, h, q_idx, kv_idx):
        return keep[q_idx, kv_idx]

    def packed_score(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    q, k, v = (packed_layout(t).to(dtype) for t in (q_packed, k_packed, v_packed))
    packed_bm = create_block_mask(packed_mask, 1, None, total, total, device="cpu", BLOCK_SIZE=32)
    gold_out, gold_lse = flex_attention(q, k, v, score_mod=packed_score, block_mask=packed_bm,
                                        return_lse=True)
    assert rel_err(out.values()[None], gold_out) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.allclose(lse.values()[None], gold_lse, atol=1e-4)
    assert_matches_reference(q, k, v, packed_score, packed_bm, out.values()[None],
                             lse.values()[None], f"nested {dtype}")
    if dtype == torch.float32:
        torch_mask = tfa.create_block_mask(packed_mask, 1, None, total, total, device="cpu",
                                           BLOCK_SIZE=32)
        torch_out = tfa.flex_attention(q, k, v, score_mod=packed_score, block_mask=torch_mask)
        assert rel_err(out.values()[None], torch_out) < 1e-5


def test_nested_backward_equals_packed():
    gen = torch.Generator().manual_seed(seed_of("nested backward"))
    H, D = 2, 16
    (q_leaf, q_packed), (k_leaf, k_packed), (v_leaf, v_packed) = (
        ragged(Q_LENGTHS, H, D, gen, requires_grad=True) for _ in range(3))
    slopes = torch.rand(H, generator=gen).requires_grad_()

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    mask = create_nested_block_mask(windowed_causal, 1, None, attention_layout(q_leaf), BLOCK_SIZE=32)
    out = nested_flex_attention(*(attention_layout(t) for t in (q_leaf, k_leaf, v_leaf)),
                                score_mod=alibi, block_mask=mask)
    grad_out = torch.randn(out.values().shape, generator=gen)
    (out.values() * grad_out).sum().backward()
    nested_grads = [t.grad.values() for t in (q_leaf, k_leaf, v_leaf)] + [slopes.grad.clone()]

    slopes.grad = None
    total = sum(Q_LENGTHS)
    keep = packed_keep(Q_LENGTHS, Q_LENGTHS, lambda s, q, kv: (q >= kv) & (q - kv <= WINDOWS[s]))
    seq, pos = local_positions(Q_LENGTHS)
    distance = (pos[:, None] - pos[None, :]).abs()

    def packed_mask(b, h, q_idx, kv_idx):
        return keep[q_idx, kv_idx]

    def packed_score(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * distance[q_idx, kv_idx]

    packed_bm = create_block_mask(packed_mask, 1, None, total, total, device="cpu", BLOCK_SIZE=32)
    inputs = [packed_layout(t) for t in (q_packed, k_packed, v_packed)]
    packed_out = flex_attention(*inputs, score_mod=packed_score, block_mask=packed_bm)
    grad_packed = grad_out[None]
    packed_grads = list(torch.autograd.grad(packed_out, (q_packed, k_packed, v_packed, slopes),
                                            grad_packed))
    x64 = [t.detach().double().requires_grad_() for t in inputs]
    s64 = slopes.detach().double().requires_grad_()

    def score64(score, b, h, q_idx, kv_idx):
        return score - s64[h] * distance[q_idx, kv_idx]

    gold = torch.autograd.grad(flex_attention_reference(*x64, score_mod=score64, block_mask=packed_bm),
                               (*x64, s64), grad_packed.double())
    for name, ours, theirs, g in zip(("dq", "dk", "dv", "dslopes"), nested_grads, packed_grads, gold):
        assert rel_err(ours, theirs) < 1e-5, name
        g = g[0].transpose(0, 1) if g.dim() == 4 else g  # (1, H, total, D) -> (total, H, D)
        assert rel_err(ours, g) < 1e-5, name


def test_nested_cross_attention_gqa_and_default_mask():
    gen = torch.Generator().manual_seed(seed_of("nested cross"))
    Hq, Hkv, D = 4, 2, 16
    q_nt, q_packed = ragged(Q_LENGTHS, Hq, D, gen)
    (k_nt, k_packed), (v_nt, v_packed) = (ragged(KV_LENGTHS, Hkv, D, gen) for _ in range(2))
    # No block_mask: every query attends to all keys of its own sequence, none of the others.
    out, lse = nested_flex_attention(*(attention_layout(t) for t in (q_nt, k_nt, v_nt)),
                                     enable_gqa=True, return_lse=True)
    assert torch.equal(out.offsets(), q_nt.offsets())
    keep = packed_keep(Q_LENGTHS, KV_LENGTHS, lambda s, q, kv: q >= 0)

    def packed_mask(b, h, q_idx, kv_idx):
        return keep[q_idx, kv_idx]

    q, k, v = (packed_layout(t) for t in (q_packed, k_packed, v_packed))
    packed_bm = create_block_mask(packed_mask, 1, None, sum(Q_LENGTHS), sum(KV_LENGTHS), device="cpu",
                                  BLOCK_SIZE=32)
    values = out.values()[None]
    assert_matches_reference(q, k, v, None, packed_bm, values, lse.values()[None],
                             "nested cross attention")
    # Each sequence alone, as plain attention.
    q_starts, kv_starts = q_nt.offsets().tolist(), k_nt.offsets().tolist()
    for i in range(3):
        qs, ks = slice(q_starts[i], q_starts[i + 1]), slice(kv_starts[i], kv_starts[i + 1])
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                                                 enable_gqa=True)
        assert rel_err(values[:, :, qs], alone) < 1e-5, i


def test_nested_errors_name_the_problem():
    gen = torch.Generator().manual_seed(seed_of("nested errors"))
    q_nt, q_packed = ragged(Q_LENGTHS, 2, 8, gen)
    q = attention_layout(q_nt)
    with pytest.raises(InputError, match="must all be nested tensors or none"):
        nested_flex_attention(q, packed_layout(q_packed), q)
    with pytest.raises(InputError, match="ragged dim at 1.*transpose"):
        nested_flex_attention(q_nt, q_nt, q_nt)
    with pytest.raises(InputError, match="B must be 1 or None"):
        create_nested_block_mask(windowed_causal, 3, None, q)
    with pytest.raises(InputError, match="layout=torch.jagged"):
        create_nested_block_mask(windowed_causal, 1, None, q_packed)
    holes = torch.nested.narrow(torch.randn(3, 40, 8), 1, torch.tensor([0, 1, 2]),
                                torch.tensor([30, 20, 10]), layout=torch.jagged)
    with pytest.raises(InputError, match="holes"):
        create_nested_block_mask(windowed_causal, 1, None, holes)
    other_lengths, _ = ragged([40, 61, 20], 2, 8, gen)  # the same total, other sequences
    wrong = create_nested_block_mask(windowed_causal, 1, None, attention_layout(other_lengths))
    with pytest.raises(InputError, match="other sequence lengths"):
        nested_flex_attention(q, q, q, block_mask=wrong)
    stacked = create_block_mask(windowed_causal, 1, None, 121, 121, device="cpu")  # not per sequence
    with pytest.raises(InputError, match="not built by create_nested_block_mask"):
        nested_flex_attention(q, q, q, block_mask=stacked)
    # A nested mask stays one through what keeps its mask_mod (device moves, pytree round trips).
    built = create_nested_block_mask(windowed_causal, 1, None, q)
    leaves, spec = torch.utils._pytree.tree_flatten(built)
    for same in (built.to("cpu"), torch.utils._pytree.tree_unflatten(leaves, spec)):
        torch.testing.assert_close(nested_flex_attention(q, q, q, block_mask=same).values(),
                                   nested_flex_attention(q, q, q, block_mask=built).values(), rtol=0, atol=0)
    short = create_block_mask(windowed_causal, 1, None, 100, 100, device="cpu")
    with pytest.raises(InputError, match=r"lengths \(100, 100\) but the nested inputs stack 121"):
        nested_flex_attention(q, q, q, block_mask=short)
    k_nt, _ = ragged([50, 9], 2, 8, gen)
    with pytest.raises(InputError, match="3 sequences and the keys 2"):
        create_nested_block_mask(windowed_causal, 1, None, q, attention_layout(k_nt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nested_gpu_bf16_forward_and_backward():
    # Lengths that are not block multiples; 8 query heads on 2 KV heads.
    lengths, Hq, Hkv, D, dev = [1000, 3000, 517], 8, 2, 64, "cuda"
    gen = torch.Generator().manual_seed(seed_of("nested gpu"))

    def leaf(H):
        parts = [torch.randn(n, H, D, generator=gen).to(dev, torch.bfloat16) for n in lengths]
        return torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)

    q_leaf, k_leaf, v_leaf = leaf(Hq), leaf(Hkv), leaf(Hkv)
    q, k, v = (attention_layout(t) for t in (q_leaf, k_leaf, v_leaf))
    mask = create_nested_block_mask(windowed_causal_gpu, 1, None, q)
    out = nested_flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    grad_out = torch.randn(out.values().shape, generator=gen).to(dev, torch.bfloat16)
    (out.values() * grad_out).sum().backward()

    total = sum(lengths)
    keep = packed_keep(lengths, lengths, lambda s, qp, kp: (qp >= kp) & (qp - kp <= 700)).to(dev)
    packed_bm = create_block_mask(lambda b, h, q_idx, kv_idx: keep[q_idx, kv_idx], 1, None, total,
                                  total, device=dev)
    dense = [t.values().detach()[None].requires_grad_() for t in (q, k, v)]
    x64 = [t.detach().double().requires_grad_() for t in dense]
    gold = flex_attention_reference(*x64, block_mask=packed_bm, enable_gqa=True)
    base = flex_attention_reference(*dense, block_mask=packed_bm, enable_gqa=True, upcast=False)
    assert rel_err(out.values()[None], gold) <= 2 * rel_err(base, gold) + 1e-3
    gold_grads = torch.autograd.grad(gold, x64, grad_out[None].double())
    base_grads = torch.autograd.grad(base, dense, grad_out[None])
    for name, leaf_t, g, b in zip("qkv", (q_leaf, k_leaf, v_leaf), gold_grads, base_grads):
        ours = leaf_t.grad.values()  # (total, H, D)
        g, b = g[0].transpose(0, 1), b[0].transpose(0, 1)
        assert rel_err(ours, g) <= 2 * rel_err(b, g) + 1e-3, name


def windowed_causal_gpu(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 700)
