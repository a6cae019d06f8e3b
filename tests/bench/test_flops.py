"""FLOP and byte counting against hand-computed numbers (docs/benchmark-method.md#what-is-counted)."""
from __future__ import annotations

import pytest
import torch

from bench.flops import attention_flops, block_density, decode_bytes


def test_dense_forward_matches_anchors_formula():
    # 4·B·H·S²·D at B=4, H=16, S=4096, D=128: 4 * 4 * 16 * 4096**2 * 128 = 549,755,813,888
    assert attention_flops(4, 16, 4096, 4096, 128, 128, 1.0, "fwd") == 549_755_813_888


def test_backward_is_three_and_a_half_forwards():
    fwd = attention_flops(1, 16, 16384, 16384, 128, 128, 0.5, "fwd")
    assert attention_flops(1, 16, 16384, 16384, 128, 128, 0.5, "fwd_bwd") == 3.5 * fwd
    # 4 * 16 * 16384**2 * 128 * 0.5 = 1,099,511,627,776
    assert fwd == 1_099_511_627_776


def test_value_head_dim_and_cross_lengths():
    # 2 * B * H * Lq * Lk * (D + Dv) = 2 * 2 * 3 * 10 * 20 * (8 + 4) = 28,800
    assert attention_flops(2, 3, 10, 20, 8, 4, 1.0, "fwd") == 28_800
    assert attention_flops(2, 3, 1, 20, 8, 4, 1.0, "decode") == 2_880


def test_decode_bytes_read_k_and_v_once():
    # B=8, Hkv=8, KV=65536, D=Dv=128, bf16: 8 * 8 * 65536 * 256 * 2 = 2,147,483,648 bytes
    assert decode_bytes(8, 8, 65536, 128, 128, 2) == 2_147_483_648
    assert decode_bytes(8, 8, 65536, 128, 128, 2, density=0.25) == 536_870_912


@pytest.mark.parametrize("bad", [dict(pass_="bwd"), dict(density=1.5), dict(density=-0.1)])
def test_bad_arguments_raise(bad):
    args = dict(B=1, H=1, Q_LEN=8, KV_LEN=8, D=4, Dv=4, density=1.0, pass_="fwd") | bad
    with pytest.raises(ValueError):
        attention_flops(**args)


def _block_mask(mask_mod, L, S, block):
    from flexcore import create_block_mask

    return create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=block)


def test_causal_density_from_a_real_block_mask():
    # 512 = 4 blocks of 128: a causal mask computes the 4·5/2 = 10 lower-triangle blocks of 16.
    bm = _block_mask(lambda b, h, q, kv: q >= kv, 512, 512, 128)
    assert block_density(bm) == pytest.approx(10 / 16)
    flops = attention_flops(1, 1, 512, 512, 64, 64, block_density(bm), "fwd")
    assert flops == 4 * 512 * 512 * 64 * 10 / 16


def test_sliding_window_and_ragged_density():
    # Window 128 at block 128 over 1024 (8 blocks): the diagonal 8 plus the 7 blocks below it.
    bm = _block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 128), 1024, 1024, 128)
    assert block_density(bm) == pytest.approx(15 / 64)
    # 300 tokens: 3 blocks per side (the last one ragged); causal keeps 6 of 9.
    bm = _block_mask(lambda b, h, q, kv: q >= kv, 300, 300, 128)
    assert block_density(bm) == pytest.approx(6 / 9)


def test_batch_dependent_density_averages_over_batch():
    # Batch 0 keeps everything, batch 1 only the first key block: (4 + 2) / (2 · 4).
    lengths = torch.tensor([256, 100])

    def padding(b, h, q, kv):
        return kv < lengths[b]

    from flexcore import create_block_mask

    bm = create_block_mask(padding, 2, None, 256, 256, device="cpu", BLOCK_SIZE=128)
    assert block_density(bm) == pytest.approx(6 / 8)
