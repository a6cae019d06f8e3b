"""Attention over ragged batches held as jagged nested tensors (NJTs), as in the FlexDecoding blog.

A batch of sequences of different lengths, ``(B, H, j, D)`` with ragged ``j``, is attended as one
stacked sequence of ``sum(j)`` positions with attention across sequences masked out. Mods are
written as for one sequence: they see ``b`` = the sequence's index in the batch and ``q_idx``,
``kv_idx`` counted from that sequence's start. The kernels then run one dense
``(1, H, sum(j), D)`` problem, and no padding is computed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flexcore import blockmask as _blockmask
from flexcore._types import MaskMod, ScoreMod
from flexcore.errors import InputError

__all__ = ["create_nested_block_mask", "nested_flex_attention", "nested_mask_mod",
           "nested_score_mod"]


def _jagged(nt, name: str, seq_dim: int | None = None) -> tuple[Tensor, int]:
    """(offsets, total length) of a jagged nested tensor; ``seq_dim``: the dim that must be ragged."""
    if not isinstance(nt, Tensor) or not nt.is_nested:
        got = f"a tensor of shape {tuple(nt.shape)}" if isinstance(nt, Tensor) else type(nt).__name__
        raise InputError(f"{name} must be a nested tensor with layout=torch.jagged; got {got}")
    if nt.layout != torch.jagged:
        raise InputError(f"{name} is a nested tensor with layout {nt.layout}; convert it with "
                         f"torch.nested.nested_tensor(..., layout=torch.jagged)")
    if nt._lengths is not None:
        raise InputError(f"{name} is a non-contiguous nested tensor with holes (it has lengths "
                         f"besides offsets); make it contiguous with {name}.contiguous()")
    if seq_dim is not None and nt._ragged_idx != seq_dim:
        raise InputError(f"{name} has its ragged dim at {nt._ragged_idx} (shape {tuple(nt.shape)}); "
                         f"attention takes (B, H, j, D) with the sequence dim 2 ragged: transpose "
                         f"a (B, j, H, D) tensor with {name}.transpose(1, 2)")
    return nt._offsets, nt._values.shape[nt._ragged_idx - 1]


def _sequence_ids(offsets: Tensor, total: int) -> Tensor:
    """(total,) index of the sequence that holds each stacked position."""
    positions = torch.arange(total, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True) - 1


def _same_structure(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))


class _Structure:
    """Sequence ids and offsets of the queries and the keys (shared where they coincide)."""

    def __init__(self, q_offsets: Tensor, q_total: int, kv_offsets: Tensor, kv_total: int):
        if q_offsets.shape != kv_offsets.shape:
            raise InputError(f"the queries hold {q_offsets.shape[0] - 1} sequences and the keys "
                             f"{kv_offsets.shape[0] - 1}: sequence i of one attends to sequence i "
                             f"of the other, so they need the same number")
        self.q_offsets, self.kv_offsets = q_offsets, kv_offsets
        self.q_seq = _sequence_ids(q_offsets, q_total)
        self.kv_seq = (self.q_seq if kv_offsets is q_offsets and kv_total == q_total
                       else _sequence_ids(kv_offsets, kv_total))

    def local(self, q_idx, kv_idx):
        """(sequence of q_idx, q_idx and kv_idx within their sequences, same sequence)."""
        q_seq, kv_seq = self.q_seq[q_idx], self.kv_seq[kv_idx]
        return (q_seq, q_idx - self.q_offsets[q_seq], kv_idx - self.kv_offsets[kv_seq],
                q_seq == kv_seq)


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def nested_mask_mod(mask_mod: MaskMod, q_offsets: Tensor, kv_offsets: Tensor | None = None,
                    q_total: int | None = None, kv_total: int | None = None) -> MaskMod:
    """``mask_mod`` written for one sequence, over the stacked positions of a ragged batch.

    The result calls ``mask_mod(seq, h, q_local, kv_local)`` (``seq``: the sequence index) and
    keeps nothing across sequences.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` in sequence-local positions.
        q_offsets: (N + 1,) int, the queries' sequence boundaries (an NJT's ``offsets()``).
        kv_offsets: the keys' boundaries; default q_offsets (self-attention).
        q_total, kv_total: stacked lengths; default the last offsets (read from the device).
    """
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    q_total = int(q_offsets[-1]) if q_total is None else q_total
    kv_total = int(kv_offsets[-1]) if kv_total is None else kv_total
    structure = _Structure(q_offsets, q_total, kv_offsets, kv_total)

    def nested_mask(b, h, q_idx, kv_idx):
        seq, q_local, kv_local, same = structure.local(q_idx, kv_idx)
        return mask_mod(seq, h, q_local, kv_local) & same

    nested_mask.__name__ = nested_mask.__qualname__ = f"nested_{_name(mask_mod)}"
    # Read by nested_flex_attention: a BlockMask keeps its mask_mod through .to(), _adjust(),
    # pytree round trips and torch's BlockMask, where attributes of its own are not kept.
    nested_mask._nested_offsets = (q_offsets, kv_offsets)
    return nested_mask


def nested_score_mod(score_mod: ScoreMod, q_offsets: Tensor, kv_offsets: Tensor | None = None,
                     q_total: int | None = None, kv_total: int | None = None) -> ScoreMod:
    """``score_mod`` written for one sequence, over the stacked positions of a ragged batch:
    ``score_mod(score, seq, h, q_local, kv_local)`` within a sequence, -inf across sequences.
    Arguments as :func:`nested_mask_mod`."""
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    q_total = int(q_offsets[-1]) if q_total is None else q_total
    kv_total = int(kv_offsets[-1]) if kv_total is None else kv_total
    structure = _Structure(q_offsets, q_total, kv_offsets, kv_total)

    def nested_score(score, b, h, q_idx, kv_idx):
        seq, q_local, kv_local, same = structure.local(q_idx, kv_idx)
        return torch.where(same, score_mod(score, seq, h, q_local, kv_local), float("-inf"))

    nested_score.__name__ = nested_score.__qualname__ = f"nested_{_name(score_mod)}"
    return nested_score


def create_nested_block_mask(mask_mod: MaskMod, B: int | None, H: int | None, q_nt: Tensor,
                             kv_nt: Tensor | None = None, BLOCK_SIZE: int | tuple[int, int] = 128,
                             _compile: bool = False):
    """The BlockMask of ``mask_mod`` over the stacked sequence of a ragged batch.

    ``mask_mod`` is written for one sequence (``b`` is the sequence index, ``q_idx``/``kv_idx``
    count from its start); attention across sequences is masked out. The mask has lengths
    ``(sum of q_nt's lengths, sum of kv_nt's)`` and is built on q_nt's device.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``.
        B: 1 or None: the ragged batch is one stacked sequence.
        H: query heads, or None to broadcast.
        q_nt: jagged nested tensor whose ragged dim gives the query sequences.
        kv_nt: the same for keys/values (cross attention); default q_nt.
        BLOCK_SIZE: int or (Q_BLOCK_SIZE, KV_BLOCK_SIZE).
        _compile: accepted for torch's signature and ignored.

    Example:
        >>> q = torch.nested.nested_tensor([torch.randn(300, 8, 64), torch.randn(77, 8, 64)],
        ...                                layout=torch.jagged, device="cuda").transpose(1, 2)
        >>> bm = create_nested_block_mask(causal, 1, None, q)
        >>> out = flex_attention(q, k, v, block_mask=bm)   # an NJT like q
    """
    from flexcore.blockmask import create_block_mask

    if B not in (None, 1):
        raise InputError(f"create_nested_block_mask: B = {B!r}; the ragged batch is attended as "
                         f"one stacked sequence, so B must be 1 or None (the mask_mod sees the "
                         f"sequence index as b)")
    q_offsets, q_total = _jagged(q_nt, "q_nt")
    if kv_nt is None:
        kv_nt, kv_offsets, kv_total = q_nt, q_offsets, q_total
    else:
        kv_offsets, kv_total = _jagged(kv_nt, "kv_nt")
    if q_nt.device != kv_nt.device:
        raise InputError(f"create_nested_block_mask: q_nt is on {q_nt.device} and kv_nt on "
                         f"{kv_nt.device}; they must share a device")
    mod = nested_mask_mod(mask_mod, q_offsets, kv_offsets, q_total, kv_total)
    mask = create_block_mask(mod, 1, H, q_total, kv_total, device=q_nt.device,
                             BLOCK_SIZE=BLOCK_SIZE)
    # Read by nested_flex_attention to refuse inputs of another ragged structure.
    mask._nested_offsets = (q_offsets, kv_offsets)
    return mask


create_nested_block_mask = _blockmask.eager_only(create_nested_block_mask)


def _document_mask(q_offsets, q_total, kv_offsets, kv_total, device):
    """The mask that keeps every position within a sequence and none across (no block_mask given)."""
    from flexcore.blockmask import create_block_mask
    from flexcore.masks import noop_mask

    mod = nested_mask_mod(noop_mask, q_offsets, kv_offsets, q_total, kv_total)
    mask = create_block_mask(mod, 1, None, q_total, kv_total, device=device)
    mask._nested_offsets = (q_offsets, kv_offsets)
    return mask


def _to_nested(dense: Tensor, like: Tensor) -> Tensor:
    """(1, H, total, ...) -> an NJT (B, H, j, ...) with the offsets of ``like``."""
    values = dense[0].movedim(1, 0)  # (total, H, ...)
    nt = torch.nested.nested_tensor_from_jagged(values, like._offsets,
                                                min_seqlen=like._maybe_min_seqlen,
                                                max_seqlen=like._maybe_max_seqlen)
    return nt.transpose(1, 2)


def nested_flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: ScoreMod | None = None,
                          block_mask=None, scale: float | None = None, enable_gqa: bool = False,
                          return_lse: bool = False, kernel_options=None, **kwargs):
    """flex_attention on jagged nested tensors (B, H, j, D): the ragged batch as one stacked
    sequence, each sequence attending to its own keys only.

    The score_mod is written for one sequence (``b`` = sequence index, positions counted from the
    sequence's start) and gets -inf across sequences. ``block_mask`` must cover the stacked
    lengths (build it with :func:`create_nested_block_mask`); None keeps every position within
    each sequence (that mask is built at each call: pass one to reuse it). Differentiable with
    respect to query, key, value and captured tensors.

    Returns:
        out, an NJT (B, H, j, Dv) with query's offsets; and lse (B, H, j) as an NJT when
        ``return_lse``. Other keyword arguments go to :func:`flexcore.flex_attention`.
    """
    from flexcore.attention import flex_attention

    nested = [t.is_nested if isinstance(t, Tensor) else False for t in (query, key, value)]
    if not all(nested):
        raise InputError(f"query, key and value must all be nested tensors or none; got "
                         f"nested={dict(zip(('query', 'key', 'value'), nested))}")
    q_offsets, q_total = _jagged(query, "query", seq_dim=2)
    kv_offsets, kv_total = _jagged(key, "key", seq_dim=2)
    v_offsets, v_total = _jagged(value, "value", seq_dim=2)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise InputError(f"{name} has shape {tuple(t.shape)}; expected 4 dims (B, H, j, D)")
    if v_total != kv_total or not _same_structure(kv_offsets, v_offsets):
        raise InputError("key and value must have the same ragged structure (the same offsets)")
    if _same_structure(q_offsets, kv_offsets):
        kv_offsets = q_offsets  # self-attention: one sequence-id table serves both sides
    if block_mask is None:
        block_mask = _document_mask(q_offsets, q_total, kv_offsets, kv_total, query.device)
    else:
        from flexcore.interop import coerce_block_mask

        block_mask = coerce_block_mask(block_mask)
        lengths = tuple(getattr(block_mask, "seq_lengths", ()))
        if lengths != (q_total, kv_total):
            raise InputError(
                f"block_mask has lengths {lengths} but the nested inputs stack {q_total} queries "
                f"and {kv_total} keys; build it with create_nested_block_mask(mask_mod, 1, H, "
                f"query, key)")
        built_for = (getattr(block_mask, "_nested_offsets", None)
                     or getattr(getattr(block_mask, "mask_mod", None), "_nested_offsets", None))
        if built_for is None:  # a mask of the stacked lengths would let sequences attend each other
            raise InputError(
                "block_mask was not built by create_nested_block_mask (nor over nested_mask_mod): "
                "over nested inputs it must keep each sequence to its own keys. Build it with "
                "create_nested_block_mask(mask_mod, 1, H, query, key), which writes the mask_mod "
                "for one sequence and masks out the others, or pass block_mask=None")
        if not (_same_structure(built_for[0], q_offsets) and _same_structure(built_for[1], kv_offsets)):
            raise InputError("block_mask was built by create_nested_block_mask for nested tensors "
                             "of other sequence lengths (other offsets); build it for these inputs")
    if score_mod is not None:
        score_mod = nested_score_mod(score_mod, q_offsets, kv_offsets, q_total, kv_total)
    dense = [t.values().unsqueeze(0) for t in (query, key, value)]  # (1, H, total, D)
    result = flex_attention(*dense, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            enable_gqa=enable_gqa, return_lse=return_lse,
                            kernel_options=kernel_options, **kwargs)
    if not isinstance(result, tuple):
        return _to_nested(result, query)
    out, extra = result
    if isinstance(extra, Tensor):
        return _to_nested(out, query), _to_nested(extra, query)
    # An auxiliary-output record (named fields of (1, H, total) tensors or None).
    return _to_nested(out, query), type(extra)(*(None if t is None else _to_nested(t, query)
                                                 for t in extra))
