"""Each variant as its paper defines it: hand-checked properties on small problems, written
independently of the variant code (loops and closed forms instead of its tensor expressions)."""
from __future__ import annotations

import math

import pytest
import torch

import variants
from variants.bias import alibi_slopes, sandwich_table, t5_relative_buckets
from variants.documents import random_document_lengths
from tests.variants.helpers import dense_mask


def mask_of(name, B=1, H=1, Q_LEN=64, **params):
    mods = variants.get(name).make(B=B, H=H, Q_LEN=Q_LEN, **params)
    shape = mods.shape
    return dense_mask(mods.mask_mod, shape.B, shape.H, shape.Q_LEN, shape.KV_LEN), mods


def loop_mask(Q_LEN, KV_LEN, keep):
    return torch.tensor([[keep(q, kv) for kv in range(KV_LEN)] for q in range(Q_LEN)])


def test_alibi_slopes_follow_the_paper():
    assert alibi_slopes(8, "cpu").tolist() == [2.0 ** -(i + 1) for i in range(8)]
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence.
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert torch.allclose(alibi_slopes(12, "cpu"), torch.tensor(expected))


def _t5_bucket(relative, bidirectional, num_buckets, max_distance):
    """T5's bucket of one relative position (memory - query), written as a scalar function."""
    bucket = 0
    n = relative
    if bidirectional:
        num_buckets //= 2
        if n > 0:
            bucket += num_buckets
        n = abs(n)
    else:
        n = max(-n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance",
                         [(True, 32, 128), (False, 32, 128), (True, 8, 20)])
def test_t5_buckets_match_the_scalar_definition(bidirectional, num_buckets, max_distance):
    q_len, kv_len = 300, 260
    buckets = t5_relative_buckets(q_len, kv_len, num_buckets, max_distance, bidirectional, "cpu")
    expected = [_t5_bucket(r, bidirectional, num_buckets, max_distance)
                for r in range(-(q_len - 1), kv_len)]
    assert buckets.tolist() == expected


def test_t5_bias_reads_the_bucket_of_each_pair():
    mods = variants.get("t5_bias").make(H=2, Q_LEN=40, num_buckets=8, max_distance=16)
    bias, buckets = mods.captured["bucket_bias"].detach(), mods.captured["buckets"]
    score = torch.zeros(())
    for q, kv in [(0, 0), (5, 30), (39, 1), (20, 21)]:
        got = mods.score_mod(score, torch.tensor(0), torch.tensor(1), torch.tensor(q),
                             torch.tensor(kv))
        assert got.item() == bias[1, buckets[kv - q + 39]].item()


def test_sandwich_table_is_the_sinusoid_inner_product():
    dim = 8
    table = sandwich_table(5, 5, dim, "cpu")
    for relative in range(-4, 5):
        expected = sum(math.cos(relative / 10000 ** (2 * i / dim)) for i in range(1, dim // 2 + 1))
        assert table[relative + 4].item() == pytest.approx(expected, rel=1e-6)


def test_kerple_is_zero_on_the_diagonal_and_decreasing():
    mods = variants.get("kerple").make(H=2, Q_LEN=16)
    r1, r2 = mods.captured["r1"].detach(), mods.captured["r2"].detach()
    h = torch.tensor(1)
    values = [mods.score_mod(torch.zeros(()), torch.tensor(0), h, torch.tensor(10),
                             torch.tensor(kv)).item() for kv in (10, 9, 5, 0)]
    expected = [-r1[1].item() * math.log(1 + r2[1].item() * d) for d in (0, 1, 5, 10)]
    assert values == pytest.approx(expected, rel=1e-6)


def test_softcap_bounds_scores():
    mods = variants.get("softcap").make(softcap=2.0)
    scores = torch.tensor([-100.0, -1.0, 0.0, 1.0, 100.0])
    out = mods.score_mod(scores, torch.tensor(0), torch.tensor(0), torch.tensor(0),
                         torch.tensor(0))
    assert torch.allclose(out, 2.0 * torch.tanh(scores / 2.0))
    assert out.abs().max() <= 2.0  # tanh saturates to exactly 1 in float32


def test_sliding_window_counts_window_keys():
    mask, _ = mask_of("sliding_window", Q_LEN=50, window_size=8)
    assert mask[0, 0].sum(-1).tolist() == [min(q + 1, 8) for q in range(50)]
    assert torch.equal(mask[0, 0], loop_mask(50, 50, lambda q, kv: 0 <= q - kv < 8))


def test_longformer_and_streaming_llm_match_their_definitions():
    mask, _ = mask_of("longformer", Q_LEN=40, window_size=6, num_global=2)
    assert torch.equal(mask[0, 0], loop_mask(40, 40, lambda q, kv: q < 2 or kv < 2
                                             or abs(q - kv) <= 3))
    mask, _ = mask_of("streaming_llm", Q_LEN=40, num_sinks=3, window_size=5)
    assert torch.equal(mask[0, 0], loop_mask(40, 40, lambda q, kv: kv <= q and
                                             (kv < 3 or q - kv < 5)))


def test_dilated_window_skips_positions():
    mask, _ = mask_of("dilated_window", Q_LEN=30, window_size=4, dilation=3)
    assert torch.equal(mask[0, 0], loop_mask(30, 30, lambda q, kv: abs(q - kv) <= 6
                                             and (q - kv) % 3 == 0))


def test_document_mask_is_block_diagonal_over_seeded_lengths():
    lengths = random_document_lengths(64, 5, seed=3)
    assert len(lengths) == 5 and sum(lengths) == 64 and min(lengths) >= 1
    assert lengths == random_document_lengths(64, 5, seed=3) != random_document_lengths(64, 5, 4)
    mask, _ = mask_of("document", Q_LEN=64, num_documents=5, seed=3, causal=False)
    doc = [i for i, n in enumerate(lengths) for _ in range(n)]
    assert torch.equal(mask[0, 0], loop_mask(64, 64, lambda q, kv: doc[q] == doc[kv]))


def test_prefix_lm_has_per_batch_prefixes():
    mask, mods = mask_of("prefix_lm", B=2, Q_LEN=40, prefix_fraction=0.5)
    assert mods.captured["prefix_length"].tolist() == [10, 20]
    for b, prefix in enumerate((10, 20)):
        assert torch.equal(mask[b, 0], loop_mask(40, 40, lambda q, kv: kv < prefix or kv <= q))


def test_shared_prefix_suffixes_do_not_see_each_other():
    mask, mods = mask_of("shared_prefix", Q_LEN=40, prefix_fraction=0.25, num_suffixes=3)
    segment = mods.captured["segment"].tolist()
    assert segment[:10] == [0] * 10 and sorted(set(segment[10:])) == [1, 2, 3]
    assert torch.equal(mask[0, 0], loop_mask(40, 40, lambda q, kv: kv <= q and (
        segment[kv] == 0 or segment[kv] == segment[q])))


def test_chunked_and_block_causal():
    mask, _ = mask_of("chunked", Q_LEN=40, chunk_size=7)
    assert torch.equal(mask[0, 0], loop_mask(40, 40, lambda q, kv: q // 7 == kv // 7 and kv <= q))
    mask, _ = mask_of("block_causal", Q_LEN=40, block_size=7)
    assert torch.equal(mask[0, 0], loop_mask(40, 40, lambda q, kv: kv // 7 <= q // 7))


def test_block_diffusion_two_stream_layout():
    n, size = 12, 4  # 24 tokens: x_t = [0, 12), x_0 = [12, 24), blocks of 4
    mask, _ = mask_of("block_causal", Q_LEN=2 * n, block_size=size, two_stream=True)

    def keep(q, kv):
        q_clean, kv_clean = q >= n, kv >= n
        q_block, kv_block = (q - n * q_clean) // size, (kv - n * kv_clean) // size
        if q_clean:  # x_0: block-causal over x_0, never x_t
            return kv_clean and kv_block <= q_block
        # x_t: its own noised block, and the clean blocks strictly before it
        return (not kv_clean and kv_block == q_block) or (kv_clean and kv_block < q_block)

    assert torch.equal(mask[0, 0], loop_mask(2 * n, 2 * n, keep))


def test_natten_every_pixel_sees_kernel_squared_keys():
    height, width, kernel = 7, 9, 3
    mask, _ = mask_of("natten", Q_LEN=height * width, image_height=height, image_width=width,
                      kernel_size=kernel)
    assert (mask[0, 0].sum(-1) == kernel * kernel).all()

    def keep(q, kv):
        qy, qx, ky, kx = q // width, q % width, kv // width, kv % width
        cy = min(max(qy, 1), height - 2)
        cx = min(max(qx, 1), width - 2)
        return abs(ky - cy) <= 1 and abs(kx - cx) <= 1

    assert torch.equal(mask[0, 0], loop_mask(height * width, height * width, keep))


def test_bigbird_random_blocks():
    mask, mods = mask_of("bigbird", H=3, Q_LEN=160, block_size=8, num_global_blocks=1,
                         window_blocks=3, num_random_blocks=2, seed=5)
    random_blocks = mods.captured["random_blocks"]
    assert random_blocks.shape == (3, 20, 20)
    q_block = torch.arange(20)[:, None]
    kv_block = torch.arange(20)[None, :]
    taken = ((q_block - kv_block).abs() <= 1) | (kv_block < 1)
    assert not (random_blocks & taken).any(), "random blocks overlap window or global blocks"
    assert (random_blocks.sum(-1) == 2).all()
    assert not torch.equal(random_blocks[0], random_blocks[1]), "heads should differ"
    block_mask = (taken | (q_block < 1) | random_blocks)
    expected = block_mask.repeat_interleave(8, -2).repeat_interleave(8, -1)
    assert torch.equal(mask[0], expected)


def test_flamingo_text_sees_one_image():
    mask, mods = mask_of("flamingo", Q_LEN=30, tokens_per_image=4, num_images=3)
    assert mods.shape.KV_LEN == 12
    image = mods.captured["image_of_text"].tolist()
    assert image == [0] * 10 + [1] * 10 + [2] * 10
    assert (mask[0, 0].sum(-1) == 4).all()
    mask, _ = mask_of("flamingo", Q_LEN=30, tokens_per_image=4, num_images=3,
                      only_last_image=False)
    assert mask[0, 0].sum(-1).tolist() == [4] * 10 + [8] * 10 + [12] * 10


def test_speculative_tree_branches_are_isolated():
    depth, branching, context = 2, 2, 5
    mask, mods = mask_of("speculative_tree", Q_LEN=context + 6, depth=depth, branching=branching)
    parent = {0: None, 1: None, 2: 0, 3: 0, 4: 1, 5: 1}  # breadth-first complete binary tree

    def ancestors(node):
        out = {node}
        while parent[node] is not None:
            node = parent[node]
            out.add(node)
        return out

    def keep(q, kv):
        if kv < context:
            return kv <= q
        return q >= context and (kv - context) in ancestors(q - context)

    assert torch.equal(mask[0, 0], loop_mask(context + 6, context + 6, keep))
    # Decoding layout: only the draft tokens are queries, against context + draft keys.
    decode = variants.get("speculative_tree").make(Q_LEN=6, KV_LEN=context + 6, depth=depth,
                                                  branching=branching)
    decode_mask = dense_mask(decode.mask_mod, 1, 1, 6, context + 6)
    assert torch.equal(decode_mask[0, 0], mask[0, 0, context:])


def test_duo_attention_heads():
    mask, mods = mask_of("duo_attention", H=4, Q_LEN=48, streaming_fraction=0.5, num_sinks=2,
                         window_size=6)
    streaming = mods.captured["is_streaming"].tolist()
    assert sum(streaming) == 2
    causal = loop_mask(48, 48, lambda q, kv: kv <= q)
    stream = loop_mask(48, 48, lambda q, kv: kv <= q and (kv < 2 or q - kv < 6))
    for h in range(4):
        assert torch.equal(mask[0, h], stream if streaming[h] else causal)


def test_key_padding_masks_tail_keys():
    mask, mods = mask_of("key_padding", B=2, Q_LEN=40, pad_fraction=0.5)
    assert mods.captured["kv_length"].tolist() == [30, 20]
    assert mask[0, 0].sum(-1).tolist() == [30] * 40 and mask[1, 0].sum(-1).tolist() == [20] * 40
