"""flexcore: FlexAttention's API, lowered to flexlab's own fused Triton kernels.

Example:
    >>> from flexcore import flex_attention, create_block_mask
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> bm = create_block_mask(causal, None, None, 1024, 1024, device=q.device)
    >>> out = flex_attention(q, k, v, block_mask=bm)
"""
from __future__ import annotations

import importlib

from flexcore._types import MaskMod, ScoreMod
# Imported here, not lazily: the submodule shares the function's name, and the package attribute
# must be the function.
from flexcore.explain import explain
from flexcore.masks import and_masks, noop_mask, or_masks

_LAZY = {
    "flex_attention": "flexcore.attention",
    "AuxRequest": "flexcore.attention",
    "AuxOutput": "flexcore.attention",
    "KernelOptions": "flexcore.options",
    "FlexKernelOptions": "flexcore.options",
    "BlockMask": "flexcore.blockmask",
    "create_block_mask": "flexcore.blockmask",
    "create_mask": "flexcore.blockmask",
    "PagedAttention": "flexcore.paged",
    "offset_mask_mod": "flexcore.decoding",
    "offset_score_mod": "flexcore.decoding",
    "create_nested_block_mask": "flexcore.nested",
    "nested_flex_attention": "flexcore.nested",
    "coerce_block_mask": "flexcore.interop",
    "DispatchPolicy": "flexcore.kernels.policy",
}

__all__ = ["flex_attention", "AuxRequest", "AuxOutput", "create_block_mask", "create_mask",
           "BlockMask", "and_masks", "or_masks", "noop_mask", "KernelOptions", "FlexKernelOptions", "ScoreMod",
           "MaskMod", "PagedAttention", "offset_mask_mod", "offset_score_mod",
           "create_nested_block_mask", "nested_flex_attention", "coerce_block_mask", "explain",
           "DispatchPolicy", "distributed"]


def __getattr__(name: str):
    if name == "distributed":  # torch.distributed is imported only by those who use it
        return importlib.import_module("flexcore.distributed")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flexcore' has no attribute {name!r}")
