"""Input checks shared by flex_attention and its eager reference: one message for one mistake."""
from __future__ import annotations

import torch
from torch import Tensor

from flexcore.errors import InputError

# float64 runs too (slowly on GPUs): it is what torch.autograd.gradcheck needs. float8_e4m3fn
# comes with descale factors (flexcore.fp8 checks them first).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn)


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_qkv(query, key, value, enable_gqa: bool, dtypes: tuple | None = KERNEL_DTYPES,
              rows_may_be_empty: bool = False) -> None:
    """Raise InputError naming the argument unless q, k, v can be attended together.

    Args:
        dtypes: accepted dtypes; None accepts any floating dtype (the reference takes float64).
        rows_may_be_empty: accept a batch or query length of 0 (calls without rows return empty
            results, as torch's do); keys, heads and head dims must still be non-empty.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise InputError(f"{name} is a nested tensor; jagged-layout (B, H, j, D) nested "
                             f"tensors are attended by flexcore.nested.nested_flex_attention")
        # FakeTensors (torch.compile) report their real device, so only true meta tensors stop here.
        if t.device.type == "meta":
            raise InputError(f"{name} is a meta tensor {_shape(t)} (device='meta'): it holds no "
                             f"data to attend. Pass tensors on a CUDA device (or the CPU, where "
                             f"the kernels run under Triton's interpreter)")
        if t.dim() != 4:
            raise InputError(f"{name} has shape {_shape(t)}; expected 4 dims (B, H, L, D)")
        if dtypes is None and not t.is_floating_point():
            raise InputError(f"{name} has dtype {t.dtype}; expected a floating-point dtype")
        if dtypes is not None and t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise InputError(f"{name} has dtype {t.dtype}; expected one of {names}")
    if not (query.dtype == key.dtype == value.dtype):
        raise InputError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    if not (query.device == key.device == value.device):
        raise InputError(f"query, key and value must be on one device; got {query.device}, "
                         f"{key.device}, {value.device}")
    B, Hq, L, D = query.shape
    Bk, Hkv, S, Dk = key.shape
    Bv, Hv, Sv, Dv = value.shape
    if Bk not in (1, B) or Bv != Bk:
        raise InputError(f"batch sizes differ: query {_shape(query)}, key {_shape(key)}, value "
                         f"{_shape(value)}; key and value need the query's batch size, or 1 to "
                         "share one cache")
    if Hv != Hkv:
        raise InputError(f"key has {Hkv} heads but value has {Hv}: they must match "
                         f"(key {_shape(key)}, value {_shape(value)})")
    if Sv != S:
        raise InputError(f"key has length {S} but value has {Sv} (key {_shape(key)}, value {_shape(value)})")
    if Dk != D:
        raise InputError(f"query head dim {D} differs from key head dim {Dk} "
                         f"(query {_shape(query)}, key {_shape(key)})")
    if min(S, D, Dv, Hq, Hkv) == 0 or (min(B, L) == 0 and not rows_may_be_empty):
        raise InputError(f"empty input: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}; "
                         f"a batch or query length of 0 gives an empty result, but every call needs "
                         f"keys, heads and a head dim")
    if Hq != Hkv:
        if not enable_gqa:
            raise InputError(f"query has {Hq} heads and key/value {Hkv}; pass enable_gqa=True for "
                             "grouped-query attention, or give them the same number of heads")
        if Hq % Hkv:
            raise InputError(f"enable_gqa=True needs query heads ({Hq}) divisible by key/value heads ({Hkv})")


def check_block_mask(block_mask, B: int, Hq: int, L: int, S: int, device: torch.device) -> None:
    """Raise InputError unless ``block_mask`` was built for these lengths, batch, heads and device."""
    from flexcore.blockmask import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise InputError(f"block_mask must be a BlockMask (flexcore.create_block_mask's or torch's, "
                         f"which flex_attention converts), or None; got {type(block_mask).__name__}")
    mq, mkv = block_mask.seq_lengths
    if (mq, mkv) != (L, S):
        # Under torch.compile with dynamic shapes the lengths are SymInts, which Dynamo cannot put
        # into an f-string (BUILD_STRING type error hides this message); a tuple it can format.
        built, call = (mq, mkv), (L, S)
        raise InputError(
            f"block_mask was built for lengths (Q_LEN, KV_LEN) = {built}, but the query and key have "
            f"lengths {call}. Build it for those with create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN); "
            f"for decoding with a sliced mask, set mask.seq_lengths to them")
    mb, mh, qb = block_mask.kv_num_blocks.shape
    # Explicit comparisons: `in` over symbolic sizes misjudges them under Dynamo (dynamic=True).
    if (mb != 1 and mb != B) or (mh != 1 and mh != Hq):
        raise InputError(f"block_mask has batch {mb} and heads {mh}; expected batch 1 or {B} and heads "
                         f"1 or {Hq} (the query's)")
    if block_mask.kv_num_blocks.device != device:
        raise InputError(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on {device}; "
                         f"move it with block_mask.to({str(device)!r})")
    bq, bkv = block_mask.BLOCK_SIZE
    if qb * bq < L or block_mask.kv_indices.shape[-1] * bkv < S:
        raise InputError(f"block_mask covers {qb * bq} queries and {block_mask.kv_indices.shape[-1] * bkv} "
                         f"keys with BLOCK_SIZE {block_mask.BLOCK_SIZE}; the inputs need {L} and {S}")
