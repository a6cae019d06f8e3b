"""Conversions between flexcore's BlockMask and ``torch.nn.attention.flex_attention.BlockMask``.

Both hold the same tables (torch's layout is flexcore's), so a conversion shares them: only
int64 tables or unordered rows from torch's ``from_kv_blocks`` are converted and sorted. The
mask_mods that mark a sliced mask, and ``noop_mask``, are mapped to each other's.
"""
from __future__ import annotations

import sys
import weakref

import torch

from flexcore.errors import InputError

__all__ = ["coerce_block_mask", "is_torch_block_mask"]

_TORCH_MODULE = "torch.nn.attention.flex_attention"
_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")

# torch BlockMask -> (stamp, flexcore BlockMask), held weakly: an entry leaves with its mask.
_converted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_torch_block_mask(obj) -> bool:
    """Whether ``obj`` is a ``torch.nn.attention.flex_attention.BlockMask`` (without importing that
    module: a program holding one has imported it)."""
    module = sys.modules.get(_TORCH_MODULE)
    return module is not None and isinstance(obj, module.BlockMask)


def coerce_block_mask(obj):
    """A flexcore BlockMask for a torch BlockMask; anything else (a flexcore BlockMask, None) is
    returned unchanged.

    The conversion is kept with the torch mask, held weakly, and made again when the torch mask
    changes: an attribute assigned (``mask_mod``, ``seq_lengths``, ``BLOCK_SIZE``, a table) or a
    table edited in place (its version counter).

    Example:
        >>> tmask = torch.nn.attention.flex_attention.create_block_mask(causal, None, None, 1024, 1024)
        >>> out = flexcore.flex_attention(q, k, v, block_mask=coerce_block_mask(tmask))
    """
    if not is_torch_block_mask(obj):
        return obj
    from flexcore.blockmask import BlockMask

    if torch.compiler.is_compiling():  # no host-side cache while tracing
        return from_torch_block_mask(obj, BlockMask)
    stamp = _stamp(obj)
    hit = _converted.get(obj)
    if hit is not None and _same(hit[0], stamp):
        return hit[1]
    converted = from_torch_block_mask(obj, BlockMask)
    _converted[obj] = (stamp, converted)
    return converted


def _version(t) -> int | None:
    return None if t is None or t.is_inference() else t._version


def _stamp(mask) -> tuple:
    """What a conversion depends on: the attributes' objects and the tables' version counters."""
    tables = tuple(getattr(mask, name) for name in _TABLES)
    return (tables, tuple(_version(t) for t in tables), mask.mask_mod, tuple(mask.seq_lengths),
            tuple(mask.BLOCK_SIZE))


def _same(a: tuple, b: tuple) -> bool:
    """Stamps agree: the same objects (by identity) and the same versions and lengths."""
    return (all(x is y for x, y in zip(a[0], b[0])) and a[1] == b[1] and a[2] is b[2]
            and a[3:] == b[3:])


def _torch_module():
    import torch.nn.attention.flex_attention as tfa

    return tfa


def from_torch_block_mask(block_mask, cls):
    """``cls`` (flexcore's BlockMask) from a torch BlockMask; see BlockMask.from_torch."""
    from flexcore.blockmask import sliced_mask_mod
    from flexcore.masks import noop_mask

    if not is_torch_block_mask(block_mask):
        raise InputError(f"expected a torch.nn.attention.flex_attention.BlockMask; got "
                         f"{type(block_mask).__name__}")
    tfa = _torch_module()
    mask_mod = block_mask.mask_mod
    if mask_mod is getattr(tfa, "_sliced_mask_mod_error", None):
        mask_mod = sliced_mask_mod
    elif mask_mod is tfa.noop_mask:
        mask_mod = noop_mask
    seq_lengths = tuple(int(n) for n in block_mask.seq_lengths)
    kv_num_blocks, kv_indices = _drop_past_edge(block_mask.kv_num_blocks, block_mask.kv_indices)
    full_kv_num_blocks, full_kv_indices = _drop_past_edge(block_mask.full_kv_num_blocks,
                                                          block_mask.full_kv_indices)
    return cls.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                              BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE), mask_mod=mask_mod,
                              seq_lengths=seq_lengths,
                              compute_q_blocks=block_mask.q_indices is not None)


def _drop_past_edge(num, indices):
    """torch's ``BlockMask._adjust`` crops the index tables to the new block columns but recounts
    them by comparing index *values* with the counts, so a cropped row can list blocks past its
    last column (torch's dense view and kernels skip them). Drop such entries, as torch does."""
    if num is None or indices is None or not indices.numel() or torch.compiler.is_compiling():
        return num, indices  # (traced: unreadable, the tables pass through unchanged as before)
    cols = indices.shape[-1]
    listed = torch.arange(cols, device=indices.device) < num[..., None]
    past = listed & (indices >= cols)
    if not bool(past.any()):
        return num, indices
    keep = listed & ~past
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    return keep.sum(-1).to(num.dtype), indices.gather(-1, order)


def to_torch_block_mask(mask):
    """A torch BlockMask sharing ``mask``'s tables; see BlockMask.to_torch."""
    from flexcore.blockmask import sliced_mask_mod
    from flexcore.masks import noop_mask

    mask.check_unmodified()
    tfa = _torch_module()
    mask_mod = mask.mask_mod
    if mask_mod is sliced_mask_mod and hasattr(tfa, "_sliced_mask_mod_error"):
        mask_mod = tfa._sliced_mask_mod_error
    elif mask_mod is noop_mask:
        mask_mod = tfa.noop_mask
    return tfa.BlockMask(seq_lengths=tuple(mask.seq_lengths),
                         **{name: getattr(mask, name) for name in _TABLES},
                         BLOCK_SIZE=tuple(mask.BLOCK_SIZE), mask_mod=mask_mod)
