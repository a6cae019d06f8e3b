"""Block-sparse attention masks: :class:`BlockMask`, :func:`create_block_mask`, :func:`create_mask`.

Semantics follow ``torch.nn.attention.flex_attention``. Masks are built in bounded memory: the
mask_mod is evaluated on tiles of at most ``_CHUNK_ELEMENTS`` positions, each reduced at once to
per-block "any kept" / "all kept" flags, so a 1M-token causal mask never materialises more than the
block tables themselves.

Building a BlockMask has two steps, kept apart so that a kernel can replace the first:

1. ``_classify_blocks_chunked``: mask_mod -> ``block_map`` (B, H, Q_BLOCKS, KV_BLOCKS) int8,
   0 = empty, 1 = partial, 2 = full.
2. :meth:`BlockMask.from_block_map`: ``block_map`` -> ordered index tables.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import operator
import traceback
import weakref
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import GetAttrKey, register_pytree_node
from torch.utils.weak import WeakIdKeyDictionary

from flexcore._runtime import prepare_triton, resolve_device
from flexcore._types import MaskMod, ScoreMod
from flexcore.errors import (ControlFlowError, FlexError, InputError, ModError, ModReturnError,
                             ModSignatureError)
from flexcore.masks import noop_mask

__all__ = ["BlockMask", "BlockCounts", "create_block_mask", "create_mask"]

DEFAULT_BLOCK_SIZE = 128
#: Upper bound on the number of mask positions (or block-table entries) processed at once.
#: Peak memory of mask creation is a small multiple of this, independent of Q_LEN * KV_LEN.
_CHUNK_ELEMENTS = 1 << 26
#: Rows of block tables converted at once hold at most this many entries; the conversion needs
#: int64 scatter indices, kept here well below the size of one int32 table of a 1M-token mask.
_TABLE_CHUNK_ELEMENTS = 1 << 24

EMPTY, PARTIAL, FULL = 0, 1, 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Argument checks shared by the public functions
# ----------------------------------------------------------------------------------------------

def _positive_int(value, name: str, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or isinstance(value, float):
        ok = False
    else:
        try:
            value = operator.index(value)
            ok = value > 0
        except TypeError:
            ok = False
    if not ok:
        extra = " or None (broadcast over it)" if allow_none else ""
        raise InputError(f"{name} must be a positive int{extra}; got {value!r}")
    return value


def _block_size_pair(BLOCK_SIZE, name: str = "BLOCK_SIZE") -> tuple[int, int]:
    """Normalise an int or a (q, kv) pair to a pair of positive ints."""
    valid = (f"{name} must be a positive int or a pair (Q_BLOCK_SIZE, KV_BLOCK_SIZE) of positive "
             f"ints, e.g. 128 or (128, 64)")
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise InputError(f"{valid}; got a sequence of length {len(BLOCK_SIZE)}: {BLOCK_SIZE!r}")
        pair = BLOCK_SIZE
    else:
        pair = (BLOCK_SIZE, BLOCK_SIZE)
    out = []
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise InputError(f"{valid}; got {BLOCK_SIZE!r}")
        v = operator.index(v)
        if v <= 0:
            raise InputError(f"{valid}; got {BLOCK_SIZE!r}")
        out.append(v)
    return out[0], out[1]


def _seq_lengths_pair(seq_lengths) -> tuple[int, int]:
    if not isinstance(seq_lengths, (tuple, list)) or len(seq_lengths) != 2:
        raise InputError(f"seq_lengths must be a pair (Q_LEN, KV_LEN) of positive ints; "
                         f"got {seq_lengths!r}")
    return (_positive_int(seq_lengths[0], "seq_lengths[0] (Q_LEN)"),
            _positive_int(seq_lengths[1], "seq_lengths[1] (KV_LEN)"))


# ----------------------------------------------------------------------------------------------
# Mods: arity, location, evaluation with clear errors
# ----------------------------------------------------------------------------------------------

def mod_location(fn) -> tuple[str, str | None, int | None]:
    """(name, file, first line) of a user's mod, looking through partials and wrappers."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    try:
        target = inspect.unwrap(target)
    except ValueError:
        pass
    name = getattr(fn, "__name__", None) or getattr(target, "__name__", None) or type(fn).__name__
    code = getattr(target, "__code__", None) or getattr(getattr(target, "__call__", None),
                                                        "__code__", None)
    if code is None:
        return name, None, None
    return name, code.co_filename, code.co_firstlineno


def _positional_arity(fn) -> int | None:
    """Number of required positional parameters, or None when the mod accepts ``*args``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    count = 0
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) \
                and p.default is inspect.Parameter.empty:
            count += 1
    return count


_SIGNATURES = {"mask": "mask_mod(b, h, q_idx, kv_idx) -> bool tensor",
               "score": "score_mod(score, b, h, q_idx, kv_idx) -> score"}


def mod_kind(fn, caller: str, allowed: tuple[str, ...] = ("mask",), arg: str = "mask_mod") -> str:
    """Check that ``fn`` is a mask_mod (4 args) or score_mod (5 args); return its kind."""
    if not callable(fn):
        raise InputError(f"{caller}(): {arg} must be a callable {_SIGNATURES[allowed[0]]}; "
                         f"got {type(fn).__name__}")
    arity = _positional_arity(fn)
    kinds = {4: "mask", 5: "score"}
    if arity is None:
        return allowed[0]
    kind = kinds.get(arity)
    if kind in allowed:
        return kind
    name, filename, lineno = mod_location(fn)
    expected = " or ".join(f"a {_SIGNATURES[k]} ({4 if k == 'mask' else 5} positional arguments)"
                           for k in allowed)
    hint = ""
    if kind == "score" and allowed == ("mask",):
        hint = (" It looks like a score_mod: a block mask needs a mask_mod; mask with a score_mod "
                "by returning -inf from it and passing no block_mask.")
    raise ModSignatureError(f"{caller}() expects {expected}; {name} takes {arity}.{hint}",
                            mod_name=name, filename=filename, lineno=lineno)


def _raising_line(exc: BaseException, filename: str | None) -> int | None:
    if filename is None:
        return None
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == filename:
            line = frame.lineno
    return line


def _describe_args(args: tuple[Tensor, ...], names: tuple[str, ...]) -> str:
    return ", ".join(f"{n} {tuple(a.shape)} {str(a.dtype).replace('torch.', '')}"
                     for n, a in zip(names, args))


# torch's messages for a Python scalar taken from a tensor of several elements (or under vmap).
_SCALAR_ERRORS = ("cannot be converted to Scalar", "only one element tensors can be converted",
                  "calling .item()")


def call_mod(fn, args: tuple[Tensor, ...], kind: str) -> Tensor:
    """Call a user's mod, turning its failures into errors that name the mod and its line."""
    names = ("b", "h", "q_idx", "kv_idx")
    if kind == "score":
        names = ("score",) + names
    from flexcore.lowering.eager import call_per_element  # lowering imports this module

    try:
        return call_per_element(fn, args, kind)
    except FlexError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the mod's name and line
        name, filename, first = mod_location(fn)
        lineno = _raising_line(exc, filename) or first
        if "Boolean value of Tensor" in str(exc) or "is ambiguous" in str(exc):
            raise ControlFlowError(
                "branches in Python on a tensor value (`if`, `and`, `or`, `not` on an index). "
                "Mods are evaluated on whole index tensors: use torch.where(cond, a, b), `&`, `|`, `~`.",
                mod_name=name, filename=filename, lineno=lineno) from exc
        if any(text in str(exc) for text in _SCALAR_ERRORS):
            raise ControlFlowError(
                "a tensor's value taken into Python (.item(), int(), float()). Mods are evaluated "
                "on whole index tensors: compute with tensor operations (torch.where for "
                "branches, torch.* functions instead of math.*).",
                mod_name=name, filename=filename, lineno=lineno) from exc
        device = args[-1].device
        raise ModError(
            f"raised {type(exc).__name__}: {exc}\n(it was called with broadcast index tensors "
            f"{_describe_args(args, names)} on {device}; tensors it captures must be on that device "
            f"and indexable by every index in range)",
            mod_name=name, filename=filename, lineno=lineno) from exc


def as_bool_mask(result, fn, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Check a mask_mod's result and broadcast it (without copying) to ``shape``."""
    name, filename, lineno = mod_location(fn)
    if isinstance(result, bool):
        result = torch.tensor(result, device=device)
    if not isinstance(result, Tensor):
        raise ModReturnError(f"mask_mod must return a bool tensor (True keeps the position); it "
                             f"returned {type(result).__name__}",
                             mod_name=name, filename=filename, lineno=lineno)
    if result.dtype != torch.bool:
        raise ModReturnError(f"mask_mod must return a bool tensor (True keeps the position); it "
                             f"returned {result.dtype} of shape {tuple(result.shape)}. Return a "
                             f"comparison instead, e.g. `q_idx >= kv_idx`",
                             mod_name=name, filename=filename, lineno=lineno)
    return broadcast_result(result, fn, shape, device)


def broadcast_result(result: Tensor, fn, shape: tuple[int, ...], device: torch.device) -> Tensor:
    name, filename, lineno = mod_location(fn)
    if result.device != device:
        raise ModReturnError(f"returned a tensor on {result.device}, but the mask is built on "
                             f"{device}; move the tensors it captures to {device}",
                             mod_name=name, filename=filename, lineno=lineno)
    try:
        return torch.broadcast_to(result, shape)
    except RuntimeError:
        raise ModReturnError(f"returned shape {tuple(result.shape)}, which does not broadcast to "
                             f"(B, H, Q, KV) = {shape}; compute the result elementwise from the "
                             f"index arguments", mod_name=name, filename=filename,
                             lineno=lineno) from None


def _index_tensors(b: tuple[int, int], h: tuple[int, int], q: tuple[int, int], kv: tuple[int, int],
                   device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcast int32 index tensors b (B,1,1,1), h (1,H,1,1), q (1,1,Lq,1), kv (1,1,1,Lk)."""
    def ar(r):
        return torch.arange(r[0], r[1], device=device, dtype=torch.int32)
    return (ar(b).view(-1, 1, 1, 1), ar(h).view(1, -1, 1, 1), ar(q).view(1, 1, -1, 1),
            ar(kv).view(1, 1, 1, -1))


def _evaluate_mask(fn, kind: str, b, h, q, kv, device) -> Tensor:
    """Evaluate a mask_mod (or the -inf positions of a score_mod) on one tile; bool, broadcast."""
    args = _index_tensors(b, h, q, kv, device)
    shape = (b[1] - b[0], h[1] - h[0], q[1] - q[0], kv[1] - kv[0])
    if kind == "mask":
        return as_bool_mask(call_mod(fn, args, "mask"), fn, shape, device)
    score = torch.zeros(shape, device=device, dtype=torch.float32)
    result = call_mod(fn, (score, *args), "score")
    if not isinstance(result, Tensor) or not result.is_floating_point():
        name, filename, lineno = mod_location(fn)
        got = f"{result.dtype} tensor" if isinstance(result, Tensor) else type(result).__name__
        raise ModReturnError(f"score_mod must return a floating-point score tensor; it returned {got}",
                             mod_name=name, filename=filename, lineno=lineno)
    return ~torch.isneginf(broadcast_result(result, fn, shape, device))


# ----------------------------------------------------------------------------------------------
# Step 1: mask_mod -> block_map, evaluated in bounded tiles
# ----------------------------------------------------------------------------------------------

class _Tile(NamedTuple):
    b: tuple[int, int]
    h: tuple[int, int]
    q: tuple[int, int]
    kv: tuple[int, int]
    q_group: int   # rows reduced into one block (BLOCK_SIZE, or the tile when inside one block)
    kv_group: int


def _plan_tiles(B: int, H: int, Q_LEN: int, KV_LEN: int, block_size: tuple[int, int],
                budget: int) -> Iterator[_Tile]:
    """Tiles of at most ``budget`` positions (after padding) that cover the (B, H, Q, KV) grid.

    Tiles are whole blocks (a strip of q-blocks x all kv, or one q-block x a run of kv-blocks) unless
    a single block exceeds the budget; then tiles lie inside one block and are reduced into it.
    """
    BQ, BK = block_size
    QB, KB = _cdiv(Q_LEN, BQ), _cdiv(KV_LEN, BK)
    # With a single block in a dimension the "block" is only as long as the sequence.
    gq = BQ if QB > 1 else Q_LEN
    gk = BK if KB > 1 else KV_LEN
    per_bh = gq * gk
    if B * H * per_bh <= budget:
        bb, hb = B, H
    elif H * per_bh <= budget:
        bb, hb = budget // (H * per_bh), H
    else:
        bb, hb = 1, max(1, budget // per_bh)
    bh = bb * hb
    for b0, h0 in itertools.product(range(0, B, bb), range(0, H, hb)):
        b, h = (b0, min(b0 + bb, B)), (h0, min(h0 + hb, H))
        if bh * per_bh <= budget:
            if bh * gq * KV_LEN <= budget:
                nq, nk = max(1, budget // (bh * gq * KV_LEN)), KB
            else:
                nq, nk = 1, max(1, budget // (bh * gq * gk))
            for qb0, kb0 in itertools.product(range(0, QB, nq), range(0, KB, nk)):
                yield _Tile(b, h, (qb0 * BQ, min((qb0 + nq) * BQ, Q_LEN)),
                            (kb0 * BK, min((kb0 + nk) * BK, KV_LEN)), gq, gk)
        else:
            tq = max(1, min(gq, budget // (bh * gk)))
            tk = gk if bh * tq * gk <= budget else max(1, budget // bh)
            for qb, kb in itertools.product(range(QB), range(KB)):
                q_end, k_end = min((qb + 1) * BQ, Q_LEN), min((kb + 1) * BK, KV_LEN)
                for q0, k0 in itertools.product(range(qb * BQ, q_end, tq), range(kb * BK, k_end, tk)):
                    q1, k1 = min(q0 + tq, q_end), min(k0 + tk, k_end)
                    yield _Tile(b, h, (q0, q1), (k0, k1), q1 - q0, k1 - k0)


def _classify_blocks_chunked(mask_mod: MaskMod, B: int, H: int, Q_LEN: int, KV_LEN: int,
                             block_size: tuple[int, int], device: torch.device,
                             max_elements: int | None = None) -> Tensor:
    """Classify every block of ``mask_mod`` as empty (0), partial (1) or full (2).

    Positions past Q_LEN / KV_LEN are ignored: a ragged edge block whose in-range positions are all
    kept is full. Peak memory is a few times ``max_elements`` (default ``_CHUNK_ELEMENTS``).

    Returns:
        block_map: (B, H, cdiv(Q_LEN, BQ), cdiv(KV_LEN, BK)) int8.
    """
    budget = max_elements or _CHUNK_ELEMENTS
    BQ, BK = block_size
    QB, KB = _cdiv(Q_LEN, BQ), _cdiv(KV_LEN, BK)
    any_kept = torch.zeros(B, H, QB, KB, dtype=torch.bool, device=device)
    all_kept = torch.ones(B, H, QB, KB, dtype=torch.bool, device=device)
    with torch.no_grad():
        for tile in _plan_tiles(B, H, Q_LEN, KV_LEN, block_size, budget):
            mask = _evaluate_mask(mask_mod, "mask", tile.b, tile.h, tile.q, tile.kv, device)
            rows, cols = tile.q[1] - tile.q[0], tile.kv[1] - tile.kv[0]
            nq, nk = _cdiv(rows, tile.q_group), _cdiv(cols, tile.kv_group)
            pad = (0, nk * tile.kv_group - cols, 0, nq * tile.q_group - rows)
            # Padding (only the ragged last blocks) is neutral: "not kept" for any, "kept" for all.
            any_in, all_in = ((torch.nn.functional.pad(mask, pad, value=False),
                               torch.nn.functional.pad(mask, pad, value=True))
                              if any(pad) else (mask, mask))
            blocks = (mask.shape[0], mask.shape[1], nq, tile.q_group, nk, tile.kv_group)
            qb0, kb0 = tile.q[0] // BQ, tile.kv[0] // BK
            index = (slice(*tile.b), slice(*tile.h), slice(qb0, qb0 + nq), slice(kb0, kb0 + nk))
            any_kept[index] |= any_in.reshape(blocks).any(dim=(3, 5))
            all_kept[index] &= all_in.reshape(blocks).all(dim=(3, 5))
    block_map = any_kept.to(torch.int8)
    block_map += all_kept
    return block_map


# ----------------------------------------------------------------------------------------------
# Step 2: dense block flags <-> ordered index tables (bounded-memory, vectorised per chunk)
# ----------------------------------------------------------------------------------------------

def row_chunks(rows: int, per_row: int, budget: int) -> Iterator[slice]:
    step = max(1, budget // max(1, per_row))
    for r0 in range(0, rows, step):
        yield slice(r0, min(r0 + step, rows))


def _ordered_from_map(block_map: Tensor, value: int) -> tuple[Tensor, Tensor]:
    """Rows of ``block_map == value`` as (num, indices): listed columns first, in increasing order.

    The rest of each row holds the unlisted columns in increasing order, so every row is a
    permutation of range(C) (padding is always a valid block index).

    Args:
        block_map: (B, H, R, C) integer tensor, possibly a transposed view.
    Returns:
        num (B, H, R) int32, indices (B, H, R, C) int32.
    """
    B, H, R, C = block_map.shape
    device = block_map.device
    num = torch.empty(B, H, R, dtype=torch.int32, device=device)
    indices = torch.empty(B, H, R, C, dtype=torch.int32, device=device)
    if C == 0:  # no columns (a slice with no query blocks, transposed): nothing listed
        return num.zero_(), indices
    cols = torch.arange(C, dtype=torch.int32, device=device)
    for rows in row_chunks(R, B * H * C, _TABLE_CHUNK_ELEMENTS):
        flags = block_map[:, :, rows] == value
        listed_upto = flags.to(torch.int32).cumsum(-1, dtype=torch.int32)  # inclusive count
        n = listed_upto[..., -1:]
        # Listed column j goes to slot (#listed <= j) - 1, unlisted j after all listed ones.
        slot = torch.where(flags, listed_upto - 1, n + cols - listed_upto)
        indices[:, :, rows].scatter_(-1, slot.long(), cols.expand_as(slot).contiguous())
        num[:, :, rows] = n.squeeze(-1)
    return num, indices


def _map_from_ordered(num: Tensor, indices: Tensor, value: int, out: Tensor) -> None:
    """Write ``value`` into ``out`` (B, H, R, C) at the blocks listed by (num, indices)."""
    B, H, R, C = out.shape
    slots = torch.arange(indices.shape[-1], device=indices.device)
    for rows in row_chunks(R, B * H * (C + 1), _TABLE_CHUNK_ELEMENTS):
        listed = slots < num[:, :, rows, None]
        target = torch.where(listed, indices[:, :, rows], C).long()  # column C is a discard slot
        dense = torch.zeros(B, H, target.shape[2], C + 1, dtype=torch.bool, device=out.device)
        dense.scatter_(-1, target, True)
        out[:, :, rows].masked_fill_(dense[..., :C], value)


_INTEGER_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _check_table(name: str, num: Tensor | None, indices: Tensor | None, expect: tuple | None,
                 device: torch.device | None, any_integer: bool = False) -> None:
    """Shape/dtype/device checks of one (num, indices) pair; no data reads (no device sync).

    Args:
        any_integer: accept every integer dtype (from_kv_blocks converts); else int32 only.
    """
    if num is None and indices is None:
        return
    num_name = name.replace("indices", "num_blocks")
    if (num is None) != (indices is None):
        raise InputError(f"{num_name} and {name} must be given together or both be None")
    for n, t, nd in ((num_name, num, 3), (name, indices, 4)):
        if not isinstance(t, Tensor):
            raise InputError(f"{n} must be a torch.Tensor; got {type(t).__name__}")
        if any_integer and t.dtype not in _INTEGER_DTYPES:
            raise InputError(f"{n} must be an integer tensor (int32 or int64); got {t.dtype}")
        if not any_integer and t.dtype != torch.int32:
            raise InputError(f"{n} must be int32; got {t.dtype} (convert with .to(torch.int32), or "
                             f"build the mask with BlockMask.from_kv_blocks, which converts)")
        if t.dim() != nd:
            raise InputError(f"{n} must have {nd} dims; got shape {tuple(t.shape)}")
        if device is not None and t.device != device:
            raise InputError(f"{n} is on {t.device} but kv_indices is on {device}")
    if num.device != indices.device:
        raise InputError(f"{num_name} is on {num.device} but {name} is on {indices.device}")
    if tuple(num.shape) != tuple(indices.shape[:3]):
        raise InputError(f"{num_name} shape {tuple(num.shape)} must equal {name}.shape[:3] = "
                         f"{tuple(indices.shape[:3])}")
    if expect is not None and tuple(indices.shape) != expect:
        raise InputError(f"{name} must have shape {expect}; got {tuple(indices.shape)}")


def _concrete(tensors) -> bool:
    """Whether the tables hold data that may be read now: not while torch.compile traces (fake
    tensors), not for meta tensors and not inside a CUDA graph capture (no read-back there)."""
    from torch._subclasses.fake_tensor import is_fake

    from flexcore._runtime import capturing

    if torch.compiler.is_compiling() or capturing():
        return False
    return not any(t.device.type == "meta" or is_fake(t) for t in tensors)


# What _listing_flags reports, in order; each a 0-d bool tensor computed on the tables' device.
_COUNT, _RANGE, _ORDER = range(3)


def _listing_flags(num: Tensor, indices: Tensor) -> Tensor:
    """(3,) bool on the tables' device: a count outside [0, C], a listed index outside [0, C),
    listed indices not strictly increasing. Computed without any read-back."""
    B, H, R, C = indices.shape
    flags = torch.zeros(3, dtype=torch.bool, device=indices.device)
    flags[_COUNT] = ((num < 0) | (num > C)).any()
    slots = torch.arange(C, device=indices.device)
    for rows in row_chunks(R, B * H * C, _TABLE_CHUNK_ELEMENTS):
        idx = indices[:, :, rows]
        listed = slots < num[:, :, rows, None]
        flags[_RANGE] |= (listed & ((idx < 0) | (idx >= C))).any()
        flags[_ORDER] |= (listed[..., 1:] & (idx[..., 1:] <= idx[..., :-1])).any()
    return flags


def _raise_listing_error(name: str, num: Tensor, indices: Tensor, problem: int) -> None:
    """The InputError for ``problem`` (found by _listing_flags), naming the first bad entry."""
    B, H, R, C = indices.shape
    num_name = name.replace("indices", "num_blocks")
    what = "key" if name.endswith("kv_indices") else "query"
    if problem == _COUNT:
        where = tuple(int(i) for i in ((num < 0) | (num > C)).nonzero()[0])
        raise InputError(f"{num_name}{list(where)} = {int(num[where])}: each count must lie in "
                         f"[0, {C}] ({C} {what} blocks = {name}.shape[-1])")
    slots = torch.arange(C, device=indices.device)
    listed = slots < num[..., None]
    if problem == _RANGE:
        b, h, r, j = (int(i) for i in (listed & ((indices < 0) | (indices >= C))).nonzero()[0])
        value = int(indices[b, h, r, j])
        side = "past the last" if value >= C else "before the first"
        raise InputError(f"{name}[{b}, {h}, {r}, {j}] = {value} points {side} {what} block: the "
                         f"first {num_name}[{b}, {h}, {r}] = {int(num[b, h, r])} entries of each "
                         f"row must lie in [0, {C}) ({C} {what} blocks = {name}.shape[-1])")
    b, h, r, j = (int(i) for i in (listed[..., 1:] & (indices[..., 1:] <= indices[..., :-1]))
                  .nonzero()[0])
    shown = indices[b, h, r, :int(num[b, h, r])].tolist()
    repeated = shown[j] == shown[j + 1]
    detail = (f"block {shown[j]} is listed twice; each block may be listed once" if repeated else
              "they must be strictly increasing (BlockMask.from_kv_blocks sorts them)")
    raise InputError(f"{name}[{b}, {h}, {r}] lists {shown}: {detail}")


def _validate_listings(pairs: dict[str, tuple[Tensor, Tensor]],
                       overlap: tuple[str, str] | None = None, ordered: bool = True) -> list[str]:
    """Data checks of several (num, indices) pairs with one read-back: counts and listed indices
    in range, listed indices strictly increasing, and (``overlap``: two table names) no block
    listed in both. Skipped where the tables hold no readable data (see _concrete).

    Returns:
        with ``ordered=False``, the names of the tables whose rows are not strictly increasing
        (accepted: the caller sorts them); otherwise [] (such rows raise).
    """
    if not pairs or not _concrete([t for pair in pairs.values() for t in pair]):
        return []
    flags = [_listing_flags(num, idx) for num, idx in pairs.values()]
    if overlap is not None:
        flags.append(_overlap_flag(*pairs[overlap[0]], *pairs[overlap[1]]).reshape(1))
    found = torch.cat(flags).tolist()  # the one read-back
    unordered = []
    for i, (name, (num, idx)) in enumerate(pairs.items()):
        for problem in (_COUNT, _RANGE):
            if found[3 * i + problem]:
                _raise_listing_error(name, num, idx, problem)
        if found[3 * i + _ORDER]:
            if ordered:
                _raise_listing_error(name, num, idx, _ORDER)
            unordered.append(name)
    if overlap is not None and found[-1]:
        both = _dense_listed(*pairs[overlap[0]]) & _dense_listed(*pairs[overlap[1]])
        b, h, i, j = (int(x) for x in both.nonzero()[0])
        raise InputError(f"block [{b}, {h}, {i}, {j}] is listed both as partial ({overlap[0]}) "
                         f"and as full ({overlap[1]}); each block may be listed once")
    return unordered


def _dense_listed(num: Tensor, indices: Tensor, rows: slice = slice(None)) -> Tensor:
    """(B, H, rows, C) bool: the blocks listed by (num, indices) in ``rows``. Counts are clamped
    and out-of-range entries dropped, so that it is safe on tables not yet validated."""
    C = indices.shape[-1]
    idx = indices[:, :, rows]
    listed = torch.arange(C, device=idx.device) < num[:, :, rows, None].clamp(0, C)
    target = torch.where(listed & (idx >= 0) & (idx < C), idx, C).long()
    dense = torch.zeros(*idx.shape[:3], C + 1, dtype=torch.bool, device=idx.device)
    return dense.scatter_(-1, target, True)[..., :C]


def _overlap_flag(num: Tensor, indices: Tensor, full_num: Tensor, full_indices: Tensor) -> Tensor:
    """0-d bool on the tables' device: some block is listed by both pairs."""
    B, H, R, C = indices.shape
    flag = torch.zeros((), dtype=torch.bool, device=indices.device)
    for rows in row_chunks(R, B * H * (C + 1), _TABLE_CHUNK_ELEMENTS):
        flag |= (_dense_listed(num, indices, rows) & _dense_listed(full_num, full_indices, rows)).any()
    return flag


def _sorted_listing(num: Tensor, indices: Tensor) -> Tensor:
    """``indices`` with the listed entries of each row sorted in increasing order (the padding
    after them is kept)."""
    B, H, R, C = indices.shape
    out = indices.clone()
    slots = torch.arange(C, device=indices.device)
    for rows in row_chunks(R, B * H * C, _TABLE_CHUNK_ELEMENTS):
        idx = indices[:, :, rows]
        listed = slots < num[:, :, rows, None]
        ordered = torch.where(listed, idx, C).sort(dim=-1).values  # unlisted entries sort last
        out[:, :, rows] = torch.where(listed, ordered, idx)
    return out


# ----------------------------------------------------------------------------------------------
# BlockMask
# ----------------------------------------------------------------------------------------------

class BlockCounts(NamedTuple):
    """Numbers of full, partial and empty blocks, summed over the stored (B, H)."""
    full: int
    partial: int
    empty: int


def sliced_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    raise InputError(
        "this BlockMask was sliced (bm[...]), so the original mask_mod no longer matches its "
        "batch/head/query-block numbering. Give it a mask_mod that does, e.g. for decoding:\n"
        "    mask = block_mask[:, :, row]\n"
        "    mask.mask_mod = lambda b, h, q, kv: block_mask.mask_mod(b, h, q + offset, kv)\n"
        "    mask.seq_lengths = (1, KV_LEN)\n"
        "(or mask.with_mask_mod(mod, seq_lengths=(1, KV_LEN)), which returns a copy).")


_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
_KV_TABLES, _Q_TABLES = _TABLES[:4], _TABLES[4:]
#: Index-table names, each with its count table: name.replace("indices", "num_blocks").
_INDEX_TABLES = ("kv_indices", "full_kv_indices", "q_indices", "full_q_indices")
#: Attributes that may be assigned after construction, as on torch's BlockMask.
_ASSIGNABLE = frozenset(_TABLES + ("seq_lengths", "BLOCK_SIZE", "mask_mod"))
#: Each BlockMask state (construction, then every assignment) takes the next number, so a token
#: read from BlockMask.version identifies one state of one mask.
_TOKENS = itertools.count(1)
#: Checks that a table's producer attaches to a key-block index table (PagedAttention: the page
#: table it was converted under). They follow the table object into every BlockMask holding it
#: (copies, dataclasses.replace, with_mask_mod) and leave with it.
_TABLE_GUARDS = WeakIdKeyDictionary()
#: The tables' version counters as the latest mask built from them recorded them, per
#: kv_num_blocks table and the ids of all eight tables (weak references tell a live table from a
#: later tensor that reuses its id). torch.compile's ops see tables, not the user's mask: they
#: key their rebuilt mask by this record and refuse tables edited in place since.
_BUILT_VERSIONS = WeakIdKeyDictionary()
_BUILT_PER_TABLE = 8


def _table_ids(tables) -> tuple:
    return tuple(map(id, tables))


def recorded_versions(tables: tuple) -> tuple | None:
    """The version of each of ``tables`` (in BlockMask field order; None where not watched) as
    recorded by the latest mask built from exactly these table objects, or None."""
    built = _BUILT_VERSIONS.get(tables[0])
    entry = None if built is None else built.get(_table_ids(tables))
    if entry is None:
        return None
    refs, versions = entry
    if any(r is not None and r() is not t for r, t in zip(refs, tables)):
        return None
    return versions


def check_recorded(tables: tuple, versions: tuple) -> None:
    """InputError where one of ``tables`` moved from its recorded version (edited in place)."""
    for name, table, version in zip(_TABLES, tables, versions):
        if version is not None and table._version != version:
            raise InputError(_edited_message(name, version, table._version))


def check_guards(kv_indices: Tensor) -> None:
    """Run the guards that the producer of ``kv_indices`` attached (BlockMask._add_guards: a
    PagedAttention conversion is refused once erase/reserve moved its pages), for callers that
    hold the tables rather than the mask (flexcore.ops under torch.compile)."""
    for guard in _TABLE_GUARDS.get(kv_indices, ()):
        guard()


def _edited_message(name: str, version: int, now: int) -> str:
    return (f"{name} was modified in place after the BlockMask was built; rebuild it with "
            f"BlockMask.from_kv_blocks(...) (or create_block_mask). Its version counter "
            f"moved from {version} to {now}: the tables a mask was built with "
            f"must stay unchanged, since the kernels' schedules and the transposed "
            f"tables were derived from them")


def _record_built(d: dict, mode: str) -> None:
    """Record a mask's watched versions (see _BUILT_VERSIONS). ``mode``: "latest" (a mask whose
    contents the user vouched for: built by the constructor, or a table assigned), "first"
    (flexcore built it from tables it checked, or a copy: only where nothing is recorded), "no"
    (torch.compile's ops rebuilding a mask around the tables they were given)."""
    if mode == "no" or not d["_watched"]:
        return
    tables = tuple(d[name] for name in _TABLES)
    if mode == "first" and recorded_versions(tables) is not None:
        return
    built = _BUILT_VERSIONS.get(tables[0])
    if built is None:
        built = _BUILT_VERSIONS[tables[0]] = {}
    ids = _table_ids(tables)
    built.pop(ids, None)
    if len(built) >= _BUILT_PER_TABLE:
        built.pop(next(iter(built)))
    watched = {name: version for name, _, version in d["_watched"]}
    built[ids] = (tuple(None if t is None else weakref.ref(t) for t in tables),
                  tuple(watched.get(name) for name in _TABLES))


def _checked_mask_mod(mask_mod) -> MaskMod:
    if mask_mod is None:
        return noop_mask
    if not callable(mask_mod):
        raise InputError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool tensor or "
                         f"None; got {type(mask_mod).__name__}")
    return mask_mod


def _check_tables(tables: dict) -> None:
    """Structure of all eight tables (shapes, dtypes, devices, which are given); no data reads."""
    if tables["kv_num_blocks"] is None or tables["kv_indices"] is None:
        raise InputError("kv_num_blocks and kv_indices are required")
    _check_table("kv_indices", tables["kv_num_blocks"], tables["kv_indices"], None, None)
    device = tables["kv_indices"].device
    B, H, QB, KB = tables["kv_indices"].shape
    for name, expect in (("full_kv_indices", (B, H, QB, KB)), ("q_indices", (B, H, KB, QB)),
                         ("full_q_indices", (B, H, KB, QB))):
        _check_table(name, tables[name.replace("indices", "num_blocks")], tables[name], expect,
                     device)
    if tables["full_q_indices"] is not None and tables["q_indices"] is None:
        raise InputError("full_q_* are given without q_*: give both or neither")
    if (tables["q_indices"] is not None
            and (tables["full_q_indices"] is None) != (tables["full_kv_indices"] is None)):
        raise InputError("full_q_* must be given exactly when full_kv_* are")


def _validate_tables(tables: dict, names: tuple[str, ...] = _INDEX_TABLES) -> None:
    """Data checks of the index tables ``names`` (those given), with one read-back."""
    pairs = {n: (tables[n.replace("indices", "num_blocks")], tables[n]) for n in names
             if tables[n] is not None}
    overlap = (("kv_indices", "full_kv_indices")
               if {"kv_indices", "full_kv_indices"} <= set(pairs) else None)
    _validate_listings(pairs, overlap)


def _watch(tables: dict, previous: tuple = (), fresh: tuple[str, ...] = ()) -> tuple:
    """(name, table, version) of each table with a version counter (not inference tensors),
    keeping the recorded version of a table that ``previous`` already watched, except for the
    tables named in ``fresh`` (just assigned, and checked)."""
    if torch.compiler.is_compiling():
        return ()
    known = {id(t): v for n, t, v in previous if n not in fresh}
    watched = []
    for name in _TABLES:
        t = tables[name]
        if isinstance(t, Tensor) and not t.is_inference():
            watched.append((name, t, known.get(id(t), t._version)))
    return tuple(watched)


@dataclass(repr=False, eq=False)
class BlockMask:
    r"""A block-sparse attention mask: which (query block, key block) tiles are computed.

    **Basics**

    Attention is split into tiles of ``BLOCK_SIZE = (Q_BLOCK_SIZE, KV_BLOCK_SIZE)`` positions. A tile
    is *empty* when the mask keeps none of its positions (it is skipped), *full* when it keeps all of
    them (computed without calling ``mask_mod``) and *partial* otherwise (computed, then masked with
    ``mask_mod``). For each query block row the mask stores how many blocks it lists and which:

    ``kv_num_blocks[b, h, i]``: number of partial key blocks of query block ``i``;
    ``kv_indices[b, h, i, :kv_num_blocks[b, h, i]]``: their indices, increasing. The rest of the row
    is padding. The dense block mask is rebuilt with:

    .. code-block:: python

        dense = torch.zeros(B, H, Q_BLOCKS, KV_BLOCKS, dtype=torch.int32)
        for b, h, i in itertools.product(range(B), range(H), range(Q_BLOCKS)):
            for j in range(kv_num_blocks[b, h, i]):
                dense[b, h, i, kv_indices[b, h, i, j]] = 1
        # the same with full_kv_num_blocks / full_kv_indices gives the full blocks;
        # bm.to_dense() is the union, bm.block_map() tells them apart (0/1/2).

    **Details**

    - ``(kv_num_blocks, kv_indices)``: partial blocks, for the forward pass (reduce along keys).
    - ``(full_kv_num_blocks, full_kv_indices)``: full blocks; may be None, then every listed block is
      treated as partial (correct, only slower).
    - ``(q_num_blocks, q_indices)``, ``(full_q_num_blocks, full_q_indices)``: the transpose, shapes
      (B, H, KV_BLOCKS) and (B, H, KV_BLOCKS, Q_BLOCKS), for the backward pass (reduce along
      queries). Computed by :meth:`from_kv_blocks`; None if it was told not to.
    - All tables are int32. B and H may be 1, meaning "the same for every batch / head".
    - ``seq_lengths = (Q_LEN, KV_LEN)``; the last block of each dimension may be ragged.

    The constructor checks the tables' shapes, dtypes and contents (counts and listed indices in
    range, listed indices strictly increasing, no block both partial and full; one read-back of
    the tables' device). :meth:`from_kv_blocks` also takes int64 tables and unordered rows.

    **Changing a mask.** ``mask_mod``, ``seq_lengths``, ``BLOCK_SIZE`` and the tables may be
    assigned, as on torch's BlockMask (decoding: ``row = bm[:, :, i]; row.mask_mod = shifted;
    row.seq_lengths = (1, KV_LEN)``). Each assignment is checked, and assigning a key-block table
    drops the transposed ``q_*`` tables derived from the old one. :attr:`version` changes at every
    assignment. Editing a table *in place* is refused instead: :meth:`check_unmodified` compares
    the tables' version counters with those recorded when the mask was built (also under
    torch.compile where flexcore's ops run; the inline ops Inductor launches on CUDA run no Python
    per call: flexcore/README.md, "BlockMask layout").

    BlockMask is a pytree node (``torch.utils._pytree``): its tables are the leaves.

    Example:
        >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu",
        ...                        BLOCK_SIZE=64)
        >>> bm.block_map()[0, 0]      # diagonal blocks partial, below it full
        tensor([[1, 0, 0, 0],
                [2, 1, 0, 0],
                [2, 2, 1, 0],
                [2, 2, 2, 1]], dtype=torch.int8)
        >>> bm.kv_num_blocks[0, 0], bm.full_kv_num_blocks[0, 0]
        (tensor([1, 1, 1, 1], dtype=torch.int32), tensor([0, 1, 2, 3], dtype=torch.int32))
    """

    seq_lengths: tuple[int, int]
    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor | None = None
    full_kv_indices: Tensor | None = None
    q_num_blocks: Tensor | None = None
    q_indices: Tensor | None = None
    full_q_num_blocks: Tensor | None = None
    full_q_indices: Tensor | None = None
    BLOCK_SIZE: tuple[int, int] = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    mask_mod: MaskMod = noop_mask

    def __post_init__(self):
        d = self.__dict__
        trusted = d.pop("_trusted", False)
        record = d.pop("_record", "first" if trusted else "latest")
        d["seq_lengths"] = _seq_lengths_pair(self.seq_lengths)
        d["BLOCK_SIZE"] = _block_size_pair(self.BLOCK_SIZE)
        d["mask_mod"] = _checked_mask_mod(self.mask_mod)
        _check_tables(d)
        if not trusted:
            _validate_tables(d)
        self._seal(record=record)

    @classmethod
    def _trusted(cls, record: str = "first", **fields) -> BlockMask:
        """A BlockMask of tables that flexcore built or already checked: their structure is
        checked, their contents are not read. ``record``: see _record_built."""
        mask = cls.__new__(cls)
        mask.__dict__["_trusted"] = True
        mask.__dict__["_record"] = record
        mask.__init__(**fields)
        return mask

    def _seal(self, fresh: tuple[str, ...] = (), record: str = "first") -> None:
        """Record the tables' versions (see _watch) and guards and take a new token; assignments
        are checked from now on."""
        d = self.__dict__
        d["_watched"] = _watch(d, d.get("_watched", ()), fresh)
        kv_indices = d["kv_indices"]
        d["_guards"] = (_TABLE_GUARDS.get(kv_indices, ())
                        if isinstance(kv_indices, Tensor) and not torch.compiler.is_compiling()
                        else ())
        d["_token"] = next(_TOKENS)
        d["_ready"] = True
        _record_built(d, "latest" if fresh else record)

    def __setattr__(self, name, value):
        d = self.__dict__
        if name not in _ASSIGNABLE or not d.get("_ready", False):
            object.__setattr__(self, name, value)
            return
        if name == "mask_mod":
            d[name] = _checked_mask_mod(value)
        elif name == "seq_lengths":
            new = _seq_lengths_pair(value)
            old, d[name] = d[name], new
            if d["full_kv_indices"] is not None and _grown_ragged_dims(old, new, d["BLOCK_SIZE"]):
                block_map = self.block_map()
                demoted = _demote_grown_edges(block_map, old, new, d["BLOCK_SIZE"])
                if demoted is not block_map:  # growing over a ragged edge: new tables
                    rebuilt = type(self).from_trusted_block_map(
                        demoted, d["BLOCK_SIZE"], new, d["mask_mod"], d["q_indices"] is not None)
                    d.update({n: rebuilt.__dict__[n] for n in _TABLES})
                    self._seal(fresh=_TABLES)
                    return
        elif name == "BLOCK_SIZE":
            d[name] = _block_size_pair(value)
        else:
            tables = {n: d[n] for n in _TABLES}
            tables[name] = value
            if name in _KV_TABLES:
                # The transposed tables were derived from the old key-block tables; the backward
                # computes them again from the new ones.
                tables.update(dict.fromkeys(_Q_TABLES))
            try:
                _check_tables(tables)
            except InputError as exc:
                raise InputError(
                    f"cannot assign BlockMask.{name}: {exc}. To replace several tables at once, "
                    f"build a new mask: BlockMask.from_kv_blocks(...) or dataclasses.replace(mask, "
                    f"kv_num_blocks=..., kv_indices=...)") from None
            pair = name.replace("num_blocks", "indices")
            overlap = ("kv_indices", "full_kv_indices") if name in _KV_TABLES else ()
            _validate_tables(tables, tuple(dict.fromkeys((pair, *overlap))))
            d.update(tables)
            self._seal(fresh=(name,))
            return
        self._seal()

    def __getstate__(self):
        return {f.name: self.__dict__[f.name] for f in dataclasses.fields(self)}

    def __setstate__(self, state):
        # A copy keeps the versions its original recorded for the same tables (an edit in place
        # since is still refused); unpickled masks hold new tensors, watched from now on.
        self.__dict__.update(state)
        self._seal()

    @property
    def version(self) -> int:
        """A number that changes at every assignment to the mask (mask_mod, seq_lengths,
        BLOCK_SIZE, a table) and differs between masks: a cache tied to this mask's state keeps
        it beside its entries and recomputes them when it differs."""
        return self.__dict__["_token"]

    def check_unmodified(self) -> None:
        """Raise InputError if a table was edited in place since the mask was built, or if its
        producer no longer vouches for it (a PagedAttention conversion after erase/reserve).

        Cheap (a few integer comparisons on the host): call it before every launch. A mask's
        tables cannot change in place: kernels and caches (launch orders, transposed tables,
        statistics) are derived from them once.
        """
        if torch.compiler.is_compiling():
            return
        d = self.__dict__
        for name, table, version in d["_watched"]:
            if table._version != version:
                raise InputError(_edited_message(name, version, table._version))
        for guard in d["_guards"]:
            guard()

    def _add_guards(self, guards: tuple) -> None:
        """Attach ``guards`` (callables that raise InputError when the tables are no longer
        valid) to this mask's kv_indices, so that every mask holding that table checks them."""
        new = tuple(g for g in guards if g not in self.__dict__["_guards"])
        if not new:
            return
        combined = _TABLE_GUARDS.get(self.kv_indices, ()) + new
        _TABLE_GUARDS[self.kv_indices] = combined
        self.__dict__["_guards"] = combined

    def _within(self, q_len: int, kv_len: int) -> BlockMask:
        """This mask, or where its tables cover more blocks than ``q_len`` queries and ``kv_len``
        keys need (lengths assigned smaller, or a mask made for a longer cache), :meth:`_adjust`'s
        crop to them: the kernels read no position past the lengths. Kept per (lengths, state);
        edits to this mask's tables are refused through it."""
        d = self.__dict__
        bq, bkv = d["BLOCK_SIZE"]
        rows, cols = d["kv_indices"].shape[-2:]
        if rows <= _cdiv(q_len, bq) and cols <= _cdiv(kv_len, bkv):
            return self
        key = (q_len, kv_len, d["_token"])
        kept = d.get("_within_lengths")
        if kept is not None and kept[0] == key:
            return kept[1]
        within = self._adjust(q_len, kv_len)
        within.__dict__["_watched"] = d["_watched"]
        d["_within_lengths"] = (key, within)
        return within

    def _derive(self, **changes) -> BlockMask:
        """A copy with ``changes`` (tables it shares stay unchecked: they were checked here)."""
        self.check_unmodified()
        fields = {f.name: self.__dict__[f.name] for f in dataclasses.fields(self)}
        fields.update(changes)
        derived = type(self)._trusted(**fields)
        derived._add_guards(self.__dict__["_guards"])
        return derived

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: Tensor, kv_indices: Tensor,
                       full_kv_num_blocks: Tensor | None = None,
                       full_kv_indices: Tensor | None = None,
                       BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
                       mask_mod: MaskMod | None = None,
                       seq_lengths: tuple[int, int] | None = None,
                       compute_q_blocks: bool = True) -> BlockMask:
        """Build a BlockMask from key-block tables; computes the transposed q_* tables.

        As torch's ``BlockMask.from_kv_blocks``, the tables may have any integer dtype (they are
        converted to int32) and list each row's blocks in any order (they are sorted); each
        block may be listed once, and only in one of the two tables.

        Args:
            kv_num_blocks: (B, H, Q_BLOCKS) integer, partial blocks per query block row.
            kv_indices: (B, H, Q_BLOCKS, KV_BLOCKS) integer, their key-block indices first.
                Leading B/H dims may be omitted (then they are 1).
            full_kv_num_blocks, full_kv_indices: the same for full blocks, or None.
            BLOCK_SIZE: int or (Q_BLOCK_SIZE, KV_BLOCK_SIZE).
            mask_mod: applied in partial blocks; None keeps every position.
            seq_lengths: (Q_LEN, KV_LEN); default Q_BLOCKS * Q_BLOCK_SIZE, KV_BLOCKS * KV_BLOCK_SIZE.
            compute_q_blocks: compute q_* (needed by the backward pass).

        Example:
            >>> num = torch.tensor([[[1, 2]]])                 # (1, 1, 2) int64
            >>> idx = torch.tensor([[[[0, 1], [1, 0]]]])       # row 1 lists [1, 0]
            >>> BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=64).to_dense()[0, 0]
            tensor([[1, 0],
                    [1, 1]], dtype=torch.int32)
        """
        def lift(name, t, nd):
            if t is None:
                return None
            if not isinstance(t, Tensor):
                raise InputError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
            if not nd - 2 <= t.dim() <= nd:
                dims = "(B, H, Q_BLOCKS)" if nd == 3 else "(B, H, Q_BLOCKS, KV_BLOCKS)"
                raise InputError(f"{name} must have shape {dims} (leading B/H optional); got "
                                 f"{tuple(t.shape)}")
            return t.reshape((1,) * (nd - t.dim()) + tuple(t.shape))

        if kv_num_blocks is None or kv_indices is None:
            raise InputError("kv_num_blocks and kv_indices are required")
        kv_num_blocks, full_kv_num_blocks = (lift("kv_num_blocks", kv_num_blocks, 3),
                                             lift("full_kv_num_blocks", full_kv_num_blocks, 3))
        kv_indices, full_kv_indices = (lift("kv_indices", kv_indices, 4),
                                       lift("full_kv_indices", full_kv_indices, 4))
        _check_table("kv_indices", kv_num_blocks, kv_indices, None, None, any_integer=True)
        _check_table("full_kv_indices", full_kv_num_blocks, full_kv_indices,
                     tuple(kv_indices.shape), kv_indices.device, any_integer=True)
        pairs = {"kv_indices": (kv_num_blocks, kv_indices)}
        if full_kv_indices is not None:
            pairs["full_kv_indices"] = (full_kv_num_blocks, full_kv_indices)
        # Checked before the conversion to int32, which would wrap large values into range.
        unordered = _validate_listings(pairs, ("kv_indices", "full_kv_indices")
                                       if len(pairs) == 2 else None, ordered=False)
        if not _concrete([t for pair in pairs.values() for t in pair]):
            unordered = list(pairs)  # unreadable now (tracing, graph capture): sort regardless
        pairs = {n: (num.to(torch.int32), idx.to(torch.int32)) for n, (num, idx) in pairs.items()}
        if unordered:
            pairs.update({n: (pairs[n][0], _sorted_listing(*pairs[n])) for n in unordered})
            _validate_listings({n: pairs[n] for n in unordered})  # only repeated blocks remain
        full = pairs.get("full_kv_indices", (None, None))
        return cls._from_kv_blocks_unchecked(*pairs["kv_indices"], *full, BLOCK_SIZE, mask_mod,
                                             seq_lengths, compute_q_blocks)

    @classmethod
    def _from_kv_blocks_unchecked(cls, kv_num_blocks, kv_indices, full_kv_num_blocks,
                                  full_kv_indices, BLOCK_SIZE, mask_mod, seq_lengths,
                                  compute_q_blocks) -> BlockMask:
        block_size = _block_size_pair(BLOCK_SIZE)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * block_size[0], kv_indices.shape[-1] * block_size[1])
        q_tables: dict[str, Tensor | None] = {}
        if compute_q_blocks:
            block_map = block_map_of(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
            q_tables = _transposed_tables(block_map, full_kv_indices is not None)
        return cls._trusted(seq_lengths=seq_lengths, kv_num_blocks=kv_num_blocks,
                            kv_indices=kv_indices, full_kv_num_blocks=full_kv_num_blocks,
                            full_kv_indices=full_kv_indices, BLOCK_SIZE=block_size,
                            mask_mod=mask_mod, **q_tables)

    @classmethod
    def from_block_map(cls, block_map: Tensor, BLOCK_SIZE: int | tuple[int, int],
                       seq_lengths: tuple[int, int], mask_mod: MaskMod | None = None,
                       compute_q_blocks: bool = True) -> BlockMask:
        """Build a BlockMask from a per-block classification.

        Args:
            block_map: (B, H, Q_BLOCKS, KV_BLOCKS) integer tensor: 0 empty, 1 partial, 2 full.
            BLOCK_SIZE: int or (Q_BLOCK_SIZE, KV_BLOCK_SIZE).
            seq_lengths: (Q_LEN, KV_LEN).
            mask_mod: applied in partial blocks; None keeps every position.
            compute_q_blocks: compute the transposed q_* tables.
        """
        if not isinstance(block_map, Tensor) or block_map.dim() != 4 \
                or block_map.is_floating_point() or block_map.is_complex():
            got = (f"{block_map.dtype} of shape {tuple(block_map.shape)}"
                   if isinstance(block_map, Tensor) else type(block_map).__name__)
            raise InputError(f"block_map must be an integer tensor (B, H, Q_BLOCKS, KV_BLOCKS) with "
                             f"0 = empty, 1 = partial, 2 = full; got {got}")
        if block_map.numel() and bool(((block_map < 0) | (block_map > 2)).any()):
            raise InputError("block_map values must be 0 (empty), 1 (partial) or 2 (full)")
        return cls.from_trusted_block_map(block_map, BLOCK_SIZE, seq_lengths, mask_mod, compute_q_blocks)

    @classmethod
    def from_trusted_block_map(cls, block_map, BLOCK_SIZE, seq_lengths, mask_mod, compute_q_blocks=True,
                               with_full: bool = True) -> BlockMask:
        """:meth:`from_block_map` without checking ``block_map`` (flexcore's own classifications,
        whose values are known to be 0, 1 or 2: no read-back). ``with_full=False`` lists every
        computed block as partial (no full_* tables)."""
        if not with_full:
            block_map = block_map.clamp(max=PARTIAL)
        kv_num_blocks, kv_indices = _ordered_from_map(block_map, PARTIAL)
        full = dict(zip(("full_kv_num_blocks", "full_kv_indices"), _ordered_from_map(block_map, FULL)
                        if with_full else (None, None)))
        q_tables = _transposed_tables(block_map, with_full) if compute_q_blocks else {}
        return cls._trusted(seq_lengths=seq_lengths, kv_num_blocks=kv_num_blocks,
                            kv_indices=kv_indices, BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod,
                            **full, **q_tables)

    _from_block_map = from_trusted_block_map  # flexcore.attention's name for it

    def with_mask_mod(self, mask_mod: MaskMod | None,
                      seq_lengths: tuple[int, int] | None = None) -> BlockMask:
        """A copy with another mask_mod (and optionally seq_lengths); the tables are shared.

        Assigning ``mask.mask_mod = ...`` changes the mask itself instead.

        Example (decoding one query block row of a causal mask):
            >>> row = block_mask[:, :, pos // 128].with_mask_mod(
            ...     lambda b, h, q, kv: block_mask.mask_mod(b, h, q + pos, kv), seq_lengths=(1, kv_len))
        """
        changes = {"mask_mod": mask_mod}
        if seq_lengths is not None:
            changes["seq_lengths"] = seq_lengths
        return self._derive(**changes)

    # -- torch interop ---------------------------------------------------------------------------

    def to_torch(self):
        """This mask as a ``torch.nn.attention.flex_attention.BlockMask`` sharing its tables."""
        from flexcore.interop import to_torch_block_mask

        return to_torch_block_mask(self)

    @classmethod
    def from_torch(cls, block_mask) -> BlockMask:
        """A flexcore BlockMask from a ``torch.nn.attention.flex_attention.BlockMask`` (its tables
        checked, converted to int32 and sorted as :meth:`from_kv_blocks` does)."""
        from flexcore.interop import from_torch_block_mask

        return from_torch_block_mask(block_mask, cls)

    def as_tuple(self, flatten: bool = True) -> tuple:
        """The mask's attributes in the order of torch 2.13's ``BlockMask.as_tuple``.

        ``(*seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, dq_write_order,
        dq_write_order_full, dq_kv_order, dq_kv_order_spt, *BLOCK_SIZE, mask_mod)``; the four
        dq_* entries (torch's deterministic-backward metadata) are None. With ``flatten=False``
        seq_lengths and BLOCK_SIZE stay pairs.
        """
        lengths = tuple(self.seq_lengths) if flatten else (self.seq_lengths,)
        block = tuple(self.BLOCK_SIZE) if flatten else (self.BLOCK_SIZE,)
        return (*lengths, *(getattr(self, n) for n in _TABLES), None, None, None, None, *block,
                self.mask_mod)

    def numel(self) -> int:
        """Positions the mask covers, not counting sparsity: B * H * Q_LEN * KV_LEN."""
        return math.prod(self.shape)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """The mask cropped to its upper-left ``(new_q_len, new_kv_len)`` corner, as torch's
        ``BlockMask._adjust`` (right for mask_mods whose meaning does not depend on the lengths,
        such as causal)."""
        new_q_len, new_kv_len = _seq_lengths_pair((new_q_len, new_kv_len))
        self.check_unmodified()
        bq, bkv = self.BLOCK_SIZE
        rows, cols = _cdiv(new_q_len, bq), _cdiv(new_kv_len, bkv)
        QB, KB = self.kv_indices.shape[-2:]
        if rows > QB or cols > KB:
            raise InputError(f"_adjust({new_q_len}, {new_kv_len}) needs {rows} x {cols} blocks of "
                             f"{self.BLOCK_SIZE}, but the mask has {QB} x {KB}: it can only be "
                             f"cropped; build a new mask for longer sequences")
        block_map = _demote_grown_edges(self.block_map(), self.seq_lengths, (new_q_len, new_kv_len),
                                        self.BLOCK_SIZE)[:, :, :rows, :cols]
        adjusted = type(self).from_trusted_block_map(block_map, self.BLOCK_SIZE, (new_q_len, new_kv_len),
                                              self.mask_mod, self.q_indices is not None,
                                              with_full=self.full_kv_indices is not None)
        adjusted._add_guards(self.__dict__["_guards"])
        return adjusted

    # -- views --------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Q_LEN, KV_LEN); B or H is 1 when the mask broadcasts over it."""
        B, H = self.kv_indices.shape[:2]
        return (B, H, *self.seq_lengths)

    def block_map(self) -> Tensor:
        """(B, H, Q_BLOCKS, KV_BLOCKS) int8: 0 = empty, 1 = partial, 2 = full."""
        return block_map_of(self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
                             self.full_kv_indices)

    def to_dense(self) -> Tensor:
        """(B, H, Q_BLOCKS, KV_BLOCKS) int32: 1 where a block is computed (partial or full)."""
        return (self.block_map() != EMPTY).to(torch.int32)

    def counts(self) -> BlockCounts:
        """Numbers of full, partial and empty blocks over all stored (B, H)."""
        total = self.kv_indices.numel()
        partial = int(self.kv_num_blocks.sum())
        full = int(self.full_kv_num_blocks.sum()) if self.full_kv_num_blocks is not None else 0
        return BlockCounts(full=full, partial=partial, empty=total - full - partial)

    def sparsity(self) -> float:
        """Percentage of the positions not computed, as torch's ``BlockMask.sparsity()``:
        ``100 * (1 - computed blocks * Q_BLOCK_SIZE * KV_BLOCK_SIZE / numel())``.

        A computed block counts whole, so on lengths that are not block multiples the ragged
        edge blocks count positions past the sequence (a mask computing every block of a
        200 x 300 problem in 128 x 128 blocks gives -63.84%). :meth:`counts` gives blocks.
        """
        computed = self.kv_num_blocks.sum()
        if self.full_kv_num_blocks is not None:
            computed = computed + self.full_kv_num_blocks.sum()
        computed_size = int(computed) * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1]
        return 100 * (1 - computed_size / self.numel())

    def to(self, device: torch.device | str) -> BlockMask:
        """A copy with every table on ``device``."""
        moved = {name: getattr(self, name).to(device) for name in _TABLES
                 if getattr(self, name) is not None}
        return self._derive(**moved)

    def __getitem__(self, index) -> BlockMask:
        """Select batches, heads and query-block rows; every dim is kept (ints select size 1).

        ``bm[b]``, ``bm[:, h]``, ``bm[:, :, rows]`` with ints, slices or 1-d index tensors (each
        applied to its own dim). seq_lengths and BLOCK_SIZE are kept and q_* are recomputed. The
        mask_mod no longer matches the new numbering, so the result's mask_mod raises until one is
        assigned (``sliced.mask_mod = ...``) or set with :meth:`with_mask_mod`.

        Example:
            >>> bm = create_block_mask(causal, 4, 2, 512, 512, BLOCK_SIZE=128)
            >>> bm[0].kv_indices.shape, bm[:, :, 2:4].kv_indices.shape
            (torch.Size([1, 2, 4, 4]), torch.Size([4, 2, 2, 4]))
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask takes at most 3 indices (batch, head, query block); "
                             f"got {len(index)}")
        self.check_unmodified()
        tables = {name: getattr(self, name) for name in _TABLES[:4]}
        names = ("batch", "head", "query-block")
        for dim, (item, dim_name) in enumerate(zip(index, names)):
            sel = _normalise_index(item, self.kv_indices.shape[dim], dim_name)
            key = (slice(None),) * dim + (sel,)
            tables = {n: (t[key] if t is not None else None) for n, t in tables.items()}
        sliced = type(self)._from_kv_blocks_unchecked(
            tables["kv_num_blocks"], tables["kv_indices"], tables["full_kv_num_blocks"],
            tables["full_kv_indices"], self.BLOCK_SIZE, sliced_mask_mod, self.seq_lengths,
            compute_q_blocks=self.q_indices is not None)
        sliced._add_guards(self.__dict__["_guards"])
        return sliced

    # -- text --------------------------------------------------------------------------------

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A text picture of the block map of the first ``limit`` (b, h) pairs.

        Each cell (two characters wide) summarises a rectangle of blocks: ``█`` all full, ``▓`` all
        computed with some partial, ``░`` partly computed, blank all empty. ``grid_size=-1`` draws
        one cell per block.
        """
        block_map = self.block_map().cpu()
        B, H, QB, KB = block_map.shape
        if grid_size == -1:
            max_rows, max_cols = QB, KB
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        if max_rows <= 0 or max_cols <= 0:
            raise InputError(f"grid_size must be a positive int, -1, or a pair of positive ints; "
                             f"got {grid_size!r}")
        rs, cs = _cdiv(QB, max_rows), _cdiv(KB, max_cols)
        nr, nc = _cdiv(QB, rs), _cdiv(KB, cs)
        pad = (0, nc * cs - KB, 0, nr * rs - QB)
        lo = torch.nn.functional.pad(block_map, pad, value=FULL + 1)
        hi = torch.nn.functional.pad(block_map, pad, value=-1)
        lo = lo.view(B, H, nr, rs, nc, cs).amin(dim=(3, 5))
        hi = hi.view(B, H, nr, rs, nc, cs).amax(dim=(3, 5))
        cell = f"{rs}x{cs} blocks" if rs * cs > 1 else "1 block"
        lines = [f"█ full  ▓ partial  ░ partly empty  (one cell = {cell} of {self.BLOCK_SIZE[0]}x"
                 f"{self.BLOCK_SIZE[1]})"]
        for count, (b, h) in enumerate(itertools.product(range(B), range(H))):
            if count == limit:
                lines += ["...", f"({B * H - limit} more; use to_string(limit=N) or index bm[b, h])"]
                break
            lines.append(f"b={b}, h={h}")
            for r in range(nr):
                row = []
                for c in range(nc):
                    low, high = int(lo[b, h, r, c]), int(hi[b, h, r, c])
                    row.append("█" if low == FULL else " " if high == EMPTY else
                               "▓" if low >= PARTIAL else "░")
                lines.append("".join(ch * 2 for ch in row))
        return "\n".join(lines)

    def __str__(self) -> str:
        return (f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%,\n"
                f"{self.to_string()}\n)")

    def __repr__(self) -> str:
        def shape_of(t):
            return tuple(t.shape) if t is not None else None
        fields = "".join(f"    {name}={shape_of(getattr(self, name))},\n" for name in _TABLES)
        mod = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        return (f"BlockMask(\n{fields}    BLOCK_SIZE={self.BLOCK_SIZE},\n    shape={self.shape},\n"
                f"    sparsity={self.sparsity():.2f}%,\n    mask_mod={mod}\n)")


def _normalise_index(item, size: int, dim_name: str):
    if isinstance(item, Tensor):
        if item.dim() == 0:
            item = item.reshape(1)
        if item.dim() != 1 or item.is_floating_point():
            raise IndexError(f"BlockMask {dim_name} index tensor must be 1-d integer or bool; got "
                             f"{item.dtype} of shape {tuple(item.shape)}")
        return item
    if isinstance(item, slice):
        return item
    if isinstance(item, bool) or not hasattr(item, "__index__"):
        raise IndexError(f"BlockMask {dim_name} index must be an int, a slice or a 1-d tensor; "
                         f"got {item!r}")
    i = operator.index(item)
    if not -size <= i < size:
        raise IndexError(f"BlockMask {dim_name} index {i} is out of range for size {size}"
                         + (" (a size-1 dim broadcasts: index it with 0)" if size == 1 else ""))
    i %= size
    return slice(i, i + 1)


def block_map_of(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                  check_overlap: bool = False) -> Tensor:
    block_map = torch.zeros(kv_indices.shape, dtype=torch.int8, device=kv_indices.device)
    _map_from_ordered(kv_num_blocks, kv_indices, PARTIAL, block_map)
    if full_kv_indices is not None:
        if check_overlap:
            full = torch.zeros_like(block_map)
            _map_from_ordered(full_kv_num_blocks, full_kv_indices, FULL, full)
            both = (full == FULL) & (block_map == PARTIAL)
            if bool(both.any()):
                b, h, i, j = (int(x) for x in both.nonzero()[0])
                raise InputError(f"block [{b}, {h}, {i}, {j}] is listed both as partial (kv_indices) "
                                 f"and as full (full_kv_indices); each block may be listed once")
            block_map = torch.maximum(block_map, full)
        else:
            _map_from_ordered(full_kv_num_blocks, full_kv_indices, FULL, block_map)
    return block_map


def _grown_ragged_dims(old: tuple[int, int], new: tuple[int, int], block_size: tuple[int, int]) -> list[int]:
    """The dims (0: queries, 1: keys) whose length grows past an old edge that cut a block short."""
    return [d for d in (0, 1) if new[d] > old[d] and old[d] % block_size[d]]


def _demote_grown_edges(block_map: Tensor, old: tuple[int, int], new: tuple[int, int],
                        block_size: tuple[int, int]) -> Tensor:
    """A ragged edge block is classified over its in-range positions only, so it may be full; when
    the lengths grow past the old edge within that block, the positions added were never
    classified: list such blocks as partial (the mask_mod decides them, as in torch)."""
    demote = [d for d in _grown_ragged_dims(old, new, block_size)
              if old[d] // block_size[d] < block_map.shape[2 + d]]
    if not demote or not bool((block_map == FULL).any()):
        return block_map
    block_map = block_map.clone()
    for d in demote:
        edge = block_map.select(2 + d, old[d] // block_size[d])
        edge.clamp_(max=PARTIAL)
    return block_map


def _transposed_tables(block_map: Tensor, with_full: bool) -> dict[str, Tensor | None]:
    transposed = block_map.transpose(-2, -1)
    q_num_blocks, q_indices = _ordered_from_map(transposed, PARTIAL)
    full_q = _ordered_from_map(transposed, FULL) if with_full else (None, None)
    return {"q_num_blocks": q_num_blocks, "q_indices": q_indices,
            "full_q_num_blocks": full_q[0], "full_q_indices": full_q[1]}


# ----------------------------------------------------------------------------------------------
# Public constructors
# ----------------------------------------------------------------------------------------------

def create_block_mask(mask_mod: MaskMod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      device: torch.device | str | None = None,
                      BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE, _compile: bool = False,
                      separate_full_blocks: bool = True) -> BlockMask:
    """Build the BlockMask of ``mask_mod``, classifying each block as empty, partial or full.

    Memory stays bounded (tiles of at most ``_CHUNK_ELEMENTS`` positions), so long sequences work:
    the largest tensors are the block tables, (B, H, Q_LEN/BQ, KV_LEN/BK) int32.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor``, True keeps a position. It is called with
            broadcast int32 index tensors b (B,1,1,1), h (1,H,1,1), q_idx (1,1,Lq,1),
            kv_idx (1,1,1,Lk) and may return anything that broadcasts to (B, H, Lq, Lk).
        B, H: batch size and number of query heads; None makes the mask broadcast over that dim
            (stored size 1, mask_mod called with index 0).
        Q_LEN, KV_LEN: sequence lengths; need not be multiples of the block size.
        device: where the mask is built; default CUDA if available, else CPU.
        BLOCK_SIZE: int or (Q_BLOCK_SIZE, KV_BLOCK_SIZE).
        _compile: accepted for torch's signature and ignored: the mask is built in bounded
            memory without torch.compile (on a GPU by a Triton kernel of the lowered mask_mod).
        separate_full_blocks: as in torch: False lists every computed block as partial (no
            full_* tables), so the mask_mod runs on every computed block.

    Example:
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> bm = create_block_mask(causal, None, None, 4096, 4096, device="cuda")
        >>> out = flex_attention(q, k, v, block_mask=bm)
    """
    prepare_triton()  # the GPU path traces and compiles the mask_mod
    mod_kind(mask_mod, "create_block_mask")
    B = _positive_int(B, "B", allow_none=True) or 1
    H = _positive_int(H, "H", allow_none=True) or 1
    Q_LEN, KV_LEN = _positive_int(Q_LEN, "Q_LEN"), _positive_int(KV_LEN, "KV_LEN")
    block_size = _block_size_pair(BLOCK_SIZE)
    device = resolve_device(device)
    if device.type == "meta":
        raise InputError("device='meta': a BlockMask's tables hold the mask's block counts and "
                         "indices, which a meta tensor has not; build it on 'cpu' or 'cuda'")
    _check_mod_indices(mask_mod, "mask", B, H, Q_LEN, KV_LEN)
    block_map = None
    if device.type == "cuda":
        block_map = _classify_blocks_on_gpu(mask_mod, B, H, Q_LEN, KV_LEN, block_size, device)
    if block_map is None:
        block_map = _classify_blocks_chunked(mask_mod, B, H, Q_LEN, KV_LEN, block_size, device)
    mask = BlockMask.from_trusted_block_map(block_map, block_size, (Q_LEN, KV_LEN), mask_mod,
                                     with_full=bool(separate_full_blocks))
    guard_factory = getattr(mask_mod, "_flexcore_guard_factory", None)
    if guard_factory is not None:  # a mod over a paged cache: the mask holds for its page table
        mask._add_guards((guard_factory(),))
    return mask


def eager_only(fn):
    """``fn`` run eagerly between graphs under torch.compile: mask building classifies blocks with
    host-side work (Python tiles, a Triton launch, cached tables) that Dynamo cannot trace. With
    fullgraph=True, Dynamo's error carries the reason: build the mask outside."""
    name = f"flexcore.{fn.__name__}"
    return torch.compiler.disable(
        fn, reason=f"{name} runs eagerly: build the mask outside the compiled function (once per "
                   f"batch of a training loop), or compile without fullgraph=True (one graph break "
                   f"here)")


create_block_mask = eager_only(create_block_mask)


def _check_mod_indices(mod, kind: str, B: int, H: int, Q_LEN: int, KV_LEN: int) -> None:
    """Refuse a mod that indexes a captured tensor out of range on this grid, before any kernel or
    eager evaluation reads out of bounds (on a GPU that would be a device-side fault)."""
    from flexcore.lowering import check_indices

    check_indices(mod, kind, B, H, Q_LEN, KV_LEN, runtime=True)


def _classify_blocks_on_gpu(mask_mod, B, H, Q_LEN, KV_LEN, block_size, device) -> Tensor | None:
    """The lowered mask_mod in a Triton kernel (memory: the block map alone); None if the mod
    cannot be lowered, in which case the eager path evaluates it and reports any error."""
    from flexcore.errors import ModError
    from flexcore.kernels.block_classify import classify_blocks
    from flexcore.lowering import lower_mask_mod

    try:
        lowered = lower_mask_mod(mask_mod)
    except ModError:
        return None
    return classify_blocks(lowered, B, H, Q_LEN, KV_LEN, block_size, device)


def create_mask(mod_fn: MaskMod | ScoreMod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                device: torch.device | str | None = None) -> Tensor:
    """The dense boolean mask of a mask_mod, or of a score_mod (False where it returns -inf).

    Args:
        mod_fn: a mask_mod (4 arguments) or a score_mod (5 arguments, called with zero scores).
        B, H: batch size and heads; None gives a size-1 dim.
        Q_LEN, KV_LEN: sequence lengths.
        device: default CUDA if available, else CPU.

    Returns:
        (B, H, Q_LEN, KV_LEN) bool tensor, True where the position is kept.

    Example:
        >>> create_mask(lambda b, h, q, kv: q >= kv, None, None, 3, 3, device="cpu")[0, 0]
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """
    kind = mod_kind(mod_fn, "create_mask", allowed=("mask", "score"), arg="mod_fn")
    B = _positive_int(B, "B", allow_none=True) or 1
    H = _positive_int(H, "H", allow_none=True) or 1
    Q_LEN, KV_LEN = _positive_int(Q_LEN, "Q_LEN"), _positive_int(KV_LEN, "KV_LEN")
    device = resolve_device(device)
    _check_mod_indices(mod_fn, kind, B, H, Q_LEN, KV_LEN)
    out = torch.empty(B, H, Q_LEN, KV_LEN, dtype=torch.bool, device=device)
    with torch.no_grad():
        for rows in row_chunks(Q_LEN, B * H * KV_LEN, _CHUNK_ELEMENTS):
            out[:, :, rows] = _evaluate_mask(mod_fn, kind, (0, B), (0, H), (rows.start, rows.stop),
                                             (0, KV_LEN), device)
    return out


create_mask = eager_only(create_mask)


# ----------------------------------------------------------------------------------------------
# Finer block maps for the kernels
# ----------------------------------------------------------------------------------------------

def refine_block_map(block_mask: BlockMask, block_size: tuple[int, int],
                     max_elements: int | None = None, batch_heads: tuple[int, int] | None = None) -> Tensor | None:
    """The block map of ``block_mask`` at the finer ``block_size`` (each dim dividing the mask's):
    sub-blocks of full blocks are full, of empty blocks empty, and in partial blocks the mask_mod is
    evaluated (there only) and each sub-block classified as empty, partial or full.

    A kernel whose tile is smaller than the mask's blocks visits, through these tables, only the
    sub-blocks that keep something, and runs the mask_mod only on the partial ones. The result holds
    for the mask_mod and its captured tensors as they are now, over the BlockMask's stored batch
    and head sizes (index 0 where it broadcasts, as :func:`create_block_mask` evaluates it), or
    over ``batch_heads`` = (B, H), to which a stored size of 1 broadcasts: a mask_mod that reads
    ``b`` or ``h`` may keep different positions per batch or head inside the partial blocks of a
    mask that broadcasts.

    Returns:
        (B, H, cdiv(Q_LEN, bq), cdiv(KV_LEN, bk)) int8 (0 empty, 1 partial, 2 full), or None when
        the partial blocks hold more than ``max_elements`` positions (default ``_CHUNK_ELEMENTS``;
        evaluating them would cost more than a kernel saves) or the mask_mod cannot be evaluated
        (a sliced mask's placeholder mod): the caller keeps the mask's own tables.
    """
    bq, bk = block_mask.BLOCK_SIZE
    fq, fk = _block_size_pair(block_size)
    if bq % fq or bk % fk:
        raise ValueError(f"block_size {(fq, fk)} must divide the mask's BLOCK_SIZE {(bq, bk)}")
    rq, rk = bq // fq, bk // fk
    Q_LEN, KV_LEN = block_mask.seq_lengths
    coarse = block_mask.block_map()
    if batch_heads is not None:
        coarse = coarse.expand(*batch_heads, *coarse.shape[2:])
    device = coarse.device
    nq, nk = min(_cdiv(Q_LEN, fq), coarse.shape[2] * rq), min(_cdiv(KV_LEN, fk), coarse.shape[3] * rk)
    fine = coarse.repeat_interleave(rq, 2).repeat_interleave(rk, 3)[:, :, :nq, :nk].contiguous()
    partial = (coarse == PARTIAL).nonzero()  # (P, 4): b, h, query block, key block
    if partial.shape[0] * bq * bk > (max_elements or _CHUNK_ELEMENTS):
        return None
    rows = torch.arange(bq, device=device, dtype=torch.int32)
    cols = torch.arange(bk, device=device, dtype=torch.int32)
    sub_q = torch.arange(rq, device=device).view(1, rq, 1)
    sub_k = torch.arange(rk, device=device).view(1, 1, rk)
    step = max(1, _CHUNK_ELEMENTS // (bq * bk))
    mask_mod = block_mask.mask_mod
    with torch.no_grad():
        for start in range(0, partial.shape[0], step):
            b, h, qb, kb = partial[start:start + step].to(torch.int32).unbind(1)
            n = b.shape[0]
            q_idx = qb[:, None] * bq + rows
            kv_idx = kb[:, None] * bk + cols
            valid = (q_idx < Q_LEN)[:, :, None] & (kv_idx < KV_LEN)[:, None, :]
            # Indices past the sequence (a ragged last block) are clamped for the call, then ignored.
            args = (b.view(n, 1, 1, 1), h.view(n, 1, 1, 1),
                    q_idx.clamp(max=Q_LEN - 1).view(n, 1, bq, 1),
                    kv_idx.clamp(max=KV_LEN - 1).view(n, 1, 1, bk))
            try:
                kept = as_bool_mask(call_mod(mask_mod, args, "mask"), mask_mod, (n, 1, bq, bk), device)
            except FlexError:
                return None
            kept = kept[:, 0] & valid
            shape = (n, rq, fq, rk, fk)
            n_kept = kept.reshape(shape).sum((2, 4))
            n_valid = valid.reshape(shape).sum((2, 4))
            state = torch.where(n_kept == 0, EMPTY, torch.where(n_kept == n_valid, FULL, PARTIAL))
            fi = (qb.view(n, 1, 1) * rq + sub_q).expand(n, rq, rk)
            fj = (kb.view(n, 1, 1) * rk + sub_k).expand(n, rq, rk)
            inside = (fi < nq) & (fj < nk)
            where = (b.view(n, 1, 1).expand(n, rq, rk)[inside].long(),
                     h.view(n, 1, 1).expand(n, rq, rk)[inside].long(), fi[inside], fj[inside])
            fine.index_put_(where, state[inside].to(torch.int8))
    return fine


# ----------------------------------------------------------------------------------------------
# Pytree node
# ----------------------------------------------------------------------------------------------

def _flatten(mask: BlockMask):
    """Leaves: the tables that are given; context: lengths, block size, mask_mod and their names."""
    present = tuple(name for name in _TABLES if getattr(mask, name) is not None)
    return ([getattr(mask, name) for name in present],
            (mask.seq_lengths, mask.BLOCK_SIZE, mask.mask_mod, present))


def _flatten_with_keys(mask: BlockMask):
    leaves, context = _flatten(mask)
    return [(GetAttrKey(name), leaf) for name, leaf in zip(context[3], leaves)], context


def _unflatten(leaves, context) -> BlockMask:
    # Leaves may be stand-ins (fake tensors while tracing, values mapped by tree_map): they are
    # set as they come, unchecked, as torch's BlockMask does.
    seq_lengths, block_size, mask_mod, present = context
    mask = BlockMask.__new__(BlockMask)
    mask.__dict__.update(dict.fromkeys(_TABLES), seq_lengths=seq_lengths, BLOCK_SIZE=block_size,
                         mask_mod=mask_mod)
    mask.__dict__.update(zip(present, leaves))
    mask._seal()
    return mask


# Registered with the class, as torch registers its own containers, so that tree_flatten and
# torch.compile see the tables as leaves from the first use on.
register_pytree_node(BlockMask, _flatten, _unflatten,
                     serialized_type_name="flexcore.blockmask.BlockMask",
                     flatten_with_keys_fn=_flatten_with_keys)
