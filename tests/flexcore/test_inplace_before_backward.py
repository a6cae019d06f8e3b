"""Tensors the backward re-reads (the mods' captured tensors, the mask's tables) edited in place
between forward and backward are refused, as torch's flex_attention (which saves its buffers)."""
import pytest
import torch

from flexcore import create_block_mask, flex_attention
from flexcore.errors import InputError


def _qkv(L=32, D=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, L, D, generator=g).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("requires_grad", [True, False])
def test_score_mod_capture_edited(requires_grad):
    q, k, v = _qkv()
    bias = torch.randn(2, 32).requires_grad_(requires_grad)
    out = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h, ki])
    with torch.no_grad():
        bias.mul_(3.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_mask_mod_capture_edited():
    q, k, v = _qkv(64)
    doc = torch.tensor([0] * 20 + [1] * 24 + [2] * 20)
    bm = create_block_mask(lambda b, h, qi, ki: doc[qi] == doc[ki], None, None, 64, 64,
                           device="cpu", BLOCK_SIZE=16)
    out = flex_attention(q, k, v, block_mask=bm)
    doc[:] = 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_block_mask_table_edited():
    q, k, v = _qkv(64)
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 64, 64, device="cpu",
                           BLOCK_SIZE=16)
    out = flex_attention(q, k, v, block_mask=bm)
    bm.kv_num_blocks.zero_()
    with pytest.raises(InputError, match="modified in place"):
        out.sum().backward()
