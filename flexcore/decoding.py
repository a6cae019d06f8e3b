"""KV-cache position offsets for decoding, kept in tensors so that a new position never recompiles.

During decoding the query holds positions ``offset .. offset + L - 1`` of the sequence while the
kernels number query rows from 0. A mod that reads the offset from a captured tensor lowers to the
same kernel for every offset: update the tensor in place (``offset.fill_(pos)``) between steps.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flexcore._types import MaskMod, ScoreMod
from flexcore.errors import InputError

__all__ = ["offset_mask_mod", "offset_score_mod"]


def _check_offset(offset) -> Tensor:
    if not isinstance(offset, Tensor):
        raise InputError(f"offset must be an integer torch.Tensor (0-d, shape (1,) or (B,)) so that "
                         f"changing it does not recompile; got {type(offset).__name__}. Use "
                         f"torch.tensor({offset!r}, device=...) and update it in place")
    if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
        raise InputError(f"offset has dtype {offset.dtype}; expected an integer dtype (int32 or int64)")
    if offset.dim() > 1:
        raise InputError(f"offset has shape {tuple(offset.shape)}; expected 0-d, (1,) or (B,) "
                         f"(one position per batch)")
    return offset


def _query_offset(offset: Tensor, b: Tensor) -> Tensor:
    # A (1,) tensor is read at 0 rather than at b, so it serves every batch.
    if offset.dim() == 0:
        return offset
    if offset.shape[0] == 1:
        return offset[0]
    return offset[b]


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def offset_mask_mod(mask_mod: MaskMod, offset: Tensor) -> MaskMod:
    """``mask_mod`` with query positions shifted by ``offset``: ``mask_mod(b, h, q_idx + offset, kv_idx)``.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` written for absolute positions.
        offset: integer tensor, 0-d or (1,) (one offset) or (B,) (one per batch): the position of
            query row 0. Captured, so updating it in place never recompiles.

    Example:
        >>> pos = torch.tensor(1000, device="cuda")
        >>> bm = create_block_mask(offset_mask_mod(causal, pos), None, None, 1, 4096)
        >>> pos += 1  # next step: same kernel (rebuild or slice the BlockMask as needed)
    """
    if not callable(mask_mod):
        raise InputError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got "
                         f"{type(mask_mod).__name__}")
    offset = _check_offset(offset)

    def shifted_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + _query_offset(offset, b), kv_idx)

    shifted_mask.__name__ = f"offset_{_name(mask_mod)}"
    shifted_mask.__qualname__ = shifted_mask.__name__
    return shifted_mask


def offset_score_mod(score_mod: ScoreMod, offset: Tensor) -> ScoreMod:
    """``score_mod`` with query positions shifted by ``offset``: ``score_mod(score, b, h, q_idx + offset, kv_idx)``.

    Args:
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` written for absolute positions.
        offset: integer tensor, 0-d, (1,) or (B,); see :func:`offset_mask_mod`.

    Example:
        >>> pos = torch.tensor([17, 300], device="cuda")       # per-batch cache lengths
        >>> out = flex_attention(q, k, v, score_mod=offset_score_mod(alibi, pos))
    """
    if not callable(score_mod):
        raise InputError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, got "
                         f"{type(score_mod).__name__}")
    offset = _check_offset(offset)

    def shifted_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx + _query_offset(offset, b), kv_idx)

    shifted_score.__name__ = f"offset_{_name(score_mod)}"
    shifted_score.__qualname__ = shifted_score.__name__
    return shifted_score
