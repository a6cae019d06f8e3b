"""The GPU block classifier (a Triton kernel over the lowered mask_mod) against the eager one."""
from __future__ import annotations

import pytest
import torch

from flexcore import and_masks, or_masks
from flexcore.blockmask import _classify_blocks_chunked
from flexcore.kernels.block_classify import classify_blocks
from flexcore.lowering import lower_mask_mod


def _mods(gen):
    doc = torch.repeat_interleave(torch.arange(40), torch.randint(3, 30, (40,), generator=gen))[:400]
    prefix = torch.randint(1, 100, (2,), generator=gen)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def prefix_lm(b, h, q_idx, kv_idx):
        return kv_idx < prefix[b]

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 8 * (h + 1)

    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0

    return {
        "causal": causal,
        "document_causal": and_masks(document, causal),
        "prefix_lm": or_masks(prefix_lm, causal),
        "per_head_window": per_head_window,
        "empty": nothing,
    }


# (B, H, Q_LEN, KV_LEN, BLOCK_SIZE): ragged lengths, cross attention, unequal block sides, and a
# block side that is not a power of two (48) so the kernel's padded columns are exercised.
SHAPES = [(1, 1, 97, 131, (32, 32)), (2, 3, 300, 256, (64, 32)), (2, 2, 100, 90, (16, 48))]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", ["causal", "document_causal", "prefix_lm", "per_head_window", "empty"])
def test_kernel_block_map_equals_eager(name, shape):
    gen = torch.Generator().manual_seed(len(name) * 31 + shape[2])
    mod = _mods(gen)[name]
    B, H, L, S, block = shape
    ours = classify_blocks(lower_mask_mod(mod), B, H, L, S, block, torch.device("cpu"))
    eager = _classify_blocks_chunked(mod, B, H, L, S, block, torch.device("cpu"))
    assert ours.dtype == torch.int8 and ours.shape == eager.shape
    assert torch.equal(ours, eager)
