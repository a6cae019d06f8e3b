"""flex_attention_reference against direct dense formulas, torch's eager flex_attention and
finite differences."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from flexcore import reference as refmod
from flexcore.blockmask import BlockMask, create_block_mask, create_mask
from flexcore.errors import InputError, ModSignatureError
from flexcore.masks import and_masks
from flexcore.reference import flex_attention_reference


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)
    return sliding_window


def generate_alibi_bias(slopes):
    """Per-query-head slopes, captured (and possibly requiring grad)."""
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


def rand(*shape, dtype=torch.float64, generator=None, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, generator=generator).requires_grad_(requires_grad)


def dense_attention(q, k, v, scale, bias=None, mask=None):
    """softmax(Q Kᵀ · scale + bias, masked) V written out directly; fully masked rows give 0."""
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    probs = torch.nan_to_num(probs, nan=0.0)
    return probs @ v, lse


def alibi_bias(slopes, L, S):
    q = torch.arange(L).view(1, 1, L, 1)
    kv = torch.arange(S).view(1, 1, 1, S)
    return slopes.view(1, -1, 1, 1) * (kv - q)


@pytest.mark.parametrize("L,S", [(97, 131), (64, 64), (1, 50)], ids=["ragged", "square", "decode"])
def test_matches_dense_formula(L, S):
    g = torch.Generator().manual_seed(L * 1000 + S)
    B, H, D, Dv = 2, 3, 16, 24
    q, k, v = rand(B, H, L, D, generator=g), rand(B, H, S, D, generator=g), rand(B, H, S, Dv, generator=g)
    slopes = rand(H, generator=g)
    mask_mod = generate_sliding_window(40)
    bm = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    out, lse = flex_attention_reference(q, k, v, generate_alibi_bias(slopes), bm, return_lse=True)
    q_pos, kv_pos = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    mask = (q_pos - kv_pos <= 40) & (q_pos >= kv_pos)
    expected, expected_lse = dense_attention(q, k, v, D ** -0.5, alibi_bias(slopes, L, S), mask)
    assert out.dtype == lse.dtype == torch.float64
    assert out.shape == (B, H, L, Dv) and lse.shape == (B, H, L)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)


def test_no_mask_custom_scale_and_shared_kv_batch():
    g = torch.Generator().manual_seed(1)
    q, k, v = rand(3, 2, 33, 8, generator=g), rand(1, 2, 45, 8, generator=g), rand(1, 2, 45, 8, generator=g)
    out, lse = flex_attention_reference(q, k, v, scale=0.3, return_lse=True)
    expected, expected_lse = dense_attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)


def test_gqa_passes_the_query_head_to_mods():
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, L, S, D = 2, 6, 2, 37, 53, 16
    q, k, v = rand(B, Hq, L, D, generator=g), rand(B, Hkv, S, D, generator=g), rand(B, Hkv, S, D, generator=g)
    slopes = rand(Hq, generator=g)  # one slope per *query* head: wrong heads would change the result
    windows = torch.tensor([3, 9, 20, 5, 50, 1])

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= windows[h]

    bm = create_block_mask(per_head_window, None, Hq, L, S, device="cpu", BLOCK_SIZE=16)
    out = flex_attention_reference(q, k, v, generate_alibi_bias(slopes), bm, enable_gqa=True)
    k_rep, v_rep = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    mask = create_mask(per_head_window, None, Hq, L, S, device="cpu")
    expected, _ = dense_attention(q, k_rep, v_rep, D ** -0.5, alibi_bias(slopes, L, S), mask)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(InputError, match="enable_gqa=True"):
        flex_attention_reference(q, k, v)
    with pytest.raises(InputError, match="divisible"):
        flex_attention_reference(q[:, :5], k, v, enable_gqa=True)


def test_fully_masked_rows_give_zero_and_minus_inf():
    g = torch.Generator().manual_seed(3)
    L = S = 40
    q = rand(1, 2, L, 8, generator=g, requires_grad=True)
    k = rand(1, 2, S, 8, generator=g, requires_grad=True)
    v = rand(1, 2, S, 8, generator=g, requires_grad=True)

    def late_start(b, h, q_idx, kv_idx):  # rows 0..9 keep nothing
        return (q_idx >= kv_idx) & (q_idx >= 10)

    def minus_inf_rows(score, b, h, q_idx, kv_idx):  # rows 30.. are -inf everywhere
        return torch.where(q_idx >= 30, float("-inf"), score)

    bm = create_block_mask(late_start, None, None, L, S, device="cpu", BLOCK_SIZE=8)
    out, lse = flex_attention_reference(q, k, v, minus_inf_rows, bm, return_lse=True)
    dead = torch.zeros(L, dtype=torch.bool)
    dead[:10] = dead[30:] = True
    assert torch.equal(out[:, :, dead], torch.zeros_like(out[:, :, dead]))
    assert bool(torch.isneginf(lse[:, :, dead]).all())
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[:, :, ~dead]).all())
    (out.sum() + lse[:, :, ~dead].sum()).backward()
    for t in (q, k, v):
        assert bool(torch.isfinite(t.grad).all())
    assert torch.equal(q.grad[:, :, dead], torch.zeros_like(q.grad[:, :, dead]))
    # Empty blocks alone (noop mask_mod, block-level mask) also give 0 / -inf.
    num = torch.tensor([[[0, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32)
    blocks = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=20)
    out, lse = flex_attention_reference(q, k, v, block_mask=blocks, return_lse=True)
    assert torch.equal(out[:, :, :20], torch.zeros_like(out[:, :, :20]))
    assert bool(torch.isneginf(lse[:, :, :20]).all())
    expected, _ = dense_attention(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], 8 ** -0.5)
    torch.testing.assert_close(out[:, :, 20:], expected, rtol=1e-12, atol=1e-12)


def test_full_blocks_skip_the_mask_mod():
    # Kernel semantics: a block listed as full is attended entirely, whatever mask_mod says.
    g = torch.Generator().manual_seed(4)
    q, k, v = rand(1, 1, 32, 8, generator=g), rand(1, 1, 32, 8, generator=g), rand(1, 1, 32, 8, generator=g)
    everything_full = BlockMask.from_kv_blocks(
        torch.zeros(1, 1, 2, dtype=torch.int32), torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32),
        torch.full((1, 1, 2), 2, dtype=torch.int32), torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32),
        BLOCK_SIZE=16, mask_mod=causal)
    torch.testing.assert_close(flex_attention_reference(q, k, v, block_mask=everything_full),
                               dense_attention(q, k, v, 8 ** -0.5)[0], rtol=1e-12, atol=1e-12)
    everything_partial = BlockMask.from_kv_blocks(
        torch.full((1, 1, 2), 2, dtype=torch.int32), torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32),
        BLOCK_SIZE=16, mask_mod=causal)
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    torch.testing.assert_close(flex_attention_reference(q, k, v, block_mask=everything_partial),
                               dense_attention(q, k, v, 8 ** -0.5, mask=mask)[0], rtol=1e-12, atol=1e-12)


def test_chunking_equals_unchunked(monkeypatch):
    g = torch.Generator().manual_seed(5)
    B, H, L, S, D = 2, 2, 50, 70, 8
    slopes = rand(H, generator=g, requires_grad=True)
    tensors = [rand(B, H, L, D, generator=g, requires_grad=True),
               rand(B, H, S, D, generator=g, requires_grad=True),
               rand(B, H, S, D, generator=g, requires_grad=True)]
    bm = create_block_mask(causal, B, None, L, S, device="cpu", BLOCK_SIZE=16)

    def run():
        out, lse = flex_attention_reference(*tensors, generate_alibi_bias(slopes), bm, return_lse=True)
        grads = torch.autograd.grad((out * out).sum() + lse.sum(), [*tensors, slopes])
        return out.detach(), lse.detach(), grads

    whole = run()
    calls = []
    original = refmod._attend_rows

    def counting(q, *args, **kwargs):
        calls.append(q.shape[2])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(refmod, "_attend_rows", counting)
    monkeypatch.setattr(refmod, "_CHUNK_SCORES", B * H * S * 7)  # 7 rows per chunk
    chunked = run()
    assert max(calls) == 7 and sum(calls) >= L
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-13, atol=1e-13)
    for a, b in zip(chunked[2], whole[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_chunked_first_call_with_a_learnable_table(monkeypatch):
    # A mod's first call decides how it is evaluated (its lowering); inside a checkpointed chunk
    # that decision must not change what autograd saves, or the recomputation fails.
    g = torch.Generator().manual_seed(12)
    B, H, L, S, D = 1, 2, 24, 24, 8
    tensors = [rand(B, H, n, D, generator=g, requires_grad=True) for n in (L, S, S)]
    table = rand(L + S, generator=g, requires_grad=True)
    bm = create_block_mask(causal, None, None, L, S, device="cpu", BLOCK_SIZE=8)

    def run(chunk_scores):
        def relative(score, b, h, q_idx, kv_idx):  # a new function: its first call
            return score + table[q_idx - kv_idx + S]
        monkeypatch.setattr(refmod, "_CHUNK_SCORES", chunk_scores)
        out, lse = flex_attention_reference(*tensors, relative, bm, return_lse=True)
        return torch.autograd.grad((out * out).sum() + lse.sum(), [*tensors, table])

    chunked = run(B * H * S * 5)
    whole = run(1 << 26)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(6)
    B, H, L, S, D = 1, 2, 9, 11, 4
    q = rand(B, H, L, D, generator=g, requires_grad=True)
    k = rand(B, H, S, D, generator=g, requires_grad=True)
    v = rand(B, H, S, 3, generator=g, requires_grad=True)
    bias = rand(H, generator=g, requires_grad=True)
    bm = create_block_mask(generate_sliding_window(5), None, None, L, S, device="cpu", BLOCK_SIZE=4)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * torch.tanh(bias[h]) + bias[h] * (q_idx - kv_idx)

    def fn(q, k, v, bias_):
        def mod(score, b, h, q_idx, kv_idx):
            return score * torch.tanh(bias_[h]) + bias_[h] * (q_idx - kv_idx)
        return flex_attention_reference(q, k, v, mod, bm, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-7)
    # The same gradients through the dense formula written out by hand.
    out, lse = flex_attention_reference(q, k, v, score_mod, bm, return_lse=True)
    weights = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad((out * weights).sum() + lse.sum(), (q, k, v, bias))
    q_pos, kv_pos = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    scale = D ** -0.5
    dense_scores = q @ k.transpose(-2, -1) * scale * torch.tanh(bias).view(1, H, 1, 1)
    dense_bias = bias.view(1, H, 1, 1) * (q_pos - kv_pos)
    mask = (q_pos - kv_pos <= 5) & (q_pos >= kv_pos)
    scores = (dense_scores + dense_bias).masked_fill(~mask, -math.inf)
    expected_lse = torch.logsumexp(scores, dim=-1)
    expected = torch.softmax(scores, dim=-1) @ v
    expected_grads = torch.autograd.grad((expected * weights).sum() + expected_lse.sum(),
                                         (q, k, v, bias))
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_upcast_false_mirrors_torch_eager_math(dtype):
    g = torch.Generator().manual_seed(7)
    B, H, L, S, D = 2, 4, 45, 77, 32
    q = rand(B, H, L, D, generator=g).to(dtype)
    k = rand(B, 2, S, D, generator=g).to(dtype)
    v = rand(B, 2, S, D, generator=g).to(dtype)
    slopes = torch.rand(H, generator=g)
    bm = create_block_mask(causal, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    tbm = torch_flex.create_block_mask(causal, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    out, lse = flex_attention_reference(q, k, v, generate_alibi_bias(slopes), bm, enable_gqa=True,
                                        return_lse=True, upcast=False)
    assert out.dtype == dtype and lse.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_out, t_lse = torch_flex.flex_attention(q, k, v, generate_alibi_bias(slopes), tbm,
                                                 enable_gqa=True, return_lse=True)
    ulp = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(out.float(), t_out.float(), rtol=0, atol=ulp)
    torch.testing.assert_close(lse, t_lse, rtol=0, atol=1e-5)
    golden = flex_attention_reference(q, k, v, generate_alibi_bias(slopes), bm, enable_gqa=True)
    assert golden.dtype == torch.float64
    if dtype != torch.float32:
        # the low-precision path really is less accurate than the golden
        assert (out.double() - golden).abs().max() > 1e-4


def test_decoding_with_a_sliced_block_mask():
    g = torch.Generator().manual_seed(8)
    L = S = 96
    q, k, v = rand(1, 2, L, 8, generator=g), rand(1, 2, S, 8, generator=g), rand(1, 2, S, 8, generator=g)
    bm = create_block_mask(causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    full = flex_attention_reference(q, k, v, block_mask=bm)
    pos = 70
    row = bm[:, :, pos // 32]
    with pytest.raises(InputError, match="sliced"):
        flex_attention_reference(q[:, :, pos:pos + 1], k, v, block_mask=row)

    def at_pos(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx + pos, kv_idx)

    step = flex_attention_reference(q[:, :, pos:pos + 1], k, v,
                                    block_mask=row.with_mask_mod(at_pos, seq_lengths=(1, S)))
    torch.testing.assert_close(step[:, :, 0], full[:, :, pos], rtol=1e-12, atol=1e-12)


def test_input_errors():
    q, k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    with pytest.raises(InputError, match="expected 4 dims"):
        flex_attention_reference(q[0], k, v)
    with pytest.raises(InputError, match="share a dtype"):
        flex_attention_reference(q.double(), k, v)
    with pytest.raises(InputError, match="query head dim 4 differs from key head dim 8"):
        flex_attention_reference(q[..., :4], k, v)
    with pytest.raises(InputError, match="key has length 20 but value has 10"):
        flex_attention_reference(q, k, v[:, :, :10])
    with pytest.raises(InputError, match="batch sizes differ"):
        flex_attention_reference(q, k.expand(2, -1, -1, -1), v)
    small = create_block_mask(causal, None, None, 8, 8, device="cpu", BLOCK_SIZE=8)
    with pytest.raises(InputError, match=r"built for lengths \(Q_LEN, KV_LEN\) = \(8, 8\)"):
        flex_attention_reference(q, k, v, block_mask=small)
    three_batches = create_block_mask(causal, 3, None, 16, 20, device="cpu", BLOCK_SIZE=8)
    with pytest.raises(InputError, match="block_mask has batch 3"):
        flex_attention_reference(q, k, v, block_mask=three_batches)
    with pytest.raises(ModSignatureError, match="score_mod"):
        flex_attention_reference(q, k, v, score_mod=causal)
    with pytest.raises(InputError, match=r"block_mask must be a BlockMask .*torch's.*got str"):
        flex_attention_reference(q, k, v, block_mask="causal")


def test_takes_a_torch_block_mask_as_flex_attention_does():
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 2, 48, 8) for _ in range(3))
    theirs = torch_flex.create_block_mask(causal, None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    ours = create_block_mask(causal, None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    got = flex_attention_reference(q, k, v, block_mask=theirs)
    assert torch.equal(got, flex_attention_reference(q, k, v, block_mask=ours))
    want = torch_flex.flex_attention(q.double(), k.double(), v.double(), block_mask=theirs)
    assert (got.double() - want).abs().max() < 1e-6


def test_mask_does_not_depend_on_block_size():
    g = torch.Generator().manual_seed(9)
    q, k, v = rand(2, 2, 61, 8, generator=g), rand(2, 2, 83, 8, generator=g), rand(2, 2, 83, 8, generator=g)
    doc = torch.randint(0, 3, (83,), generator=g).sort().values

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mod = and_masks(document, causal)
    outs = [flex_attention_reference(q, k, v, block_mask=create_block_mask(
        mod, None, None, 61, 83, device="cpu", BLOCK_SIZE=bs)) for bs in (16, (8, 32), 128)]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-12, atol=1e-12)


def _all_partial(B, H, L, S, block, mask_mod):
    """A BlockMask whose every block is partial: the mask_mod decides every position."""
    qb, kb = -(-L // block), -(-S // block)
    num = torch.full((B, H, qb), kb, dtype=torch.int32)
    idx = torch.arange(kb, dtype=torch.int32).expand(B, H, qb, kb).contiguous()
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(L, S))


def test_mods_are_evaluated_per_element_as_torch_does():
    # Nested subscripts mean one element per position under torch's vmap; on broadcast index
    # tensors they would index whole rows (attention-gym's flamingo mask).
    g = torch.Generator().manual_seed(8)
    B, H, L, S, D = 2, 2, 12, 15, 8
    intervals = torch.tensor([[0, 7], [1, 7], [7, 12]])
    image_of = torch.arange(3).repeat_interleave(5)
    table = rand(L, S, generator=g)
    rows = rand(H, 4, generator=g)

    def flamingo(b, h, q_idx, kv_idx):
        bounds = intervals[image_of[kv_idx]]
        return (q_idx >= bounds[0]) & (q_idx < bounds[1])

    def nested(score, b, h, q_idx, kv_idx):
        return score + table[q_idx][kv_idx] + torch.dot(rows[h], rows[h]) * 0.1

    q, k, v = rand(B, H, L, D, generator=g), rand(B, H, S, D, generator=g), rand(B, H, S, D, generator=g)
    out = flex_attention_reference(q, k, v, nested, _all_partial(B, H, L, S, 8, flamingo))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch_flex.flex_attention(
            q, k, v, score_mod=nested,
            block_mask=torch_flex.create_block_mask(flamingo, B, H, L, S, device="cpu"))
    rows_kept = torch_flex.create_mask(flamingo, B, H, L, S, device="cpu").any(-1)
    torch.testing.assert_close(out[rows_kept], expected[rows_kept], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[~rows_kept], torch.zeros_like(out[~rows_kept]))
