"""Mask combinators with torch.nn.attention.flex_attention's semantics."""
from __future__ import annotations

import torch
from torch import Tensor

from flexcore._types import MaskMod


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """A mask_mod that keeps every position."""
    return b.new_ones(size=(), dtype=torch.bool)


class MaskModTypeError(TypeError, RuntimeError):
    """A mask combinator got something that is not a mask_mod (torch raises RuntimeError)."""


def _check_mods(fname: str, mods: tuple) -> None:
    for i, m in enumerate(mods):
        if not callable(m):
            raise MaskModTypeError(f"{fname}(): argument {i} is {type(m).__name__}, expected a "
                                   "mask_mod callable (b, h, q_idx, kv_idx) -> bool tensor")


def _names(mask_mods: tuple) -> str:
    return "_".join(getattr(m, "__name__", "mask") for m in mask_mods) or "none"


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a position only where every given mask_mod keeps it.

    With no mask_mod it keeps every position, as torch's ``and_masks()``.

    Example:
        >>> causal_window = and_masks(causal, sliding_window)
    """
    _check_mods("and_masks", mask_mods)

    def and_mask(b, h, q_idx, kv_idx):
        if not mask_mods:
            return b.new_ones(size=(), dtype=torch.bool)
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for mod in mask_mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    and_mask.__name__ = "and_" + _names(mask_mods)
    return and_mask


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a position where any given mask_mod keeps it.

    With no mask_mod it keeps no position, as torch's ``or_masks()``.

    Example:
        >>> prefix_lm = or_masks(prefix, causal)
    """
    _check_mods("or_masks", mask_mods)

    def or_mask(b, h, q_idx, kv_idx):
        if not mask_mods:
            return b.new_zeros(size=(), dtype=torch.bool)
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for mod in mask_mods[1:]:
            result = result | mod(b, h, q_idx, kv_idx)
        return result

    or_mask.__name__ = "or_" + _names(mask_mods)
    return or_mask
