"""flex_attention: torch.nn.attention.flex_attention's API on flexlab's own Triton kernels."""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from flexcore._runtime import prepare_triton, use_interpreter
from flexcore._types import ScoreMod
from flexcore.errors import InputError
from flexcore.options import KernelOptions

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def validate_inputs(query, key, value, block_mask, scale, enable_gqa) -> None:
    """Raise InputError naming the argument when the inputs cannot be attended."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} has shape {_shape(t)}; expected 4 dims (B, H, L, D)")
        if t.dtype not in _DTYPES:
            raise InputError(f"{name} has dtype {t.dtype}; expected float16, bfloat16 or float32")
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
        raise InputError(f"batch sizes differ: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}; "
                         "key and value need the query's batch size, or 1 to share one cache")
    if Hv != Hkv:
        raise InputError(f"key has {Hkv} heads but value has {Hv}: they must match "
                         f"(key {_shape(key)}, value {_shape(value)})")
    if Sv != S:
        raise InputError(f"key has length {S} but value has {Sv} (key {_shape(key)}, value {_shape(value)})")
    if Dk != D:
        raise InputError(f"query head dim {D} differs from key head dim {Dk} "
                         f"(query {_shape(query)}, key {_shape(key)})")
    if min(L, S, D, Dv, B, Hq, Hkv) == 0:
        raise InputError(f"empty input: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}")
    if max(D, Dv) > 256:
        raise InputError(f"head dims up to 256 are supported; got D={D}, Dv={Dv}")
    if Hq != Hkv:
        if not enable_gqa:
            raise InputError(f"query has {Hq} heads and key/value {Hkv}; pass enable_gqa=True for "
                             "grouped-query attention, or give them the same number of heads")
        if Hq % Hkv:
            raise InputError(f"enable_gqa=True needs query heads ({Hq}) divisible by key/value heads ({Hkv})")
    if scale is not None and not isinstance(scale, (int, float)):
        raise InputError(f"scale must be a float or None, got {type(scale).__name__}")
    if block_mask is not None:
        _validate_block_mask(block_mask, B, Hq, L, S, query.device)
    if query.device.type != "cuda" and not use_interpreter():
        raise InputError(f"flexcore's kernels run on CUDA tensors on this machine; query is on "
                         f"{query.device}. Move the inputs with .cuda(), or use flexcore.reference")


def _validate_block_mask(block_mask, B, Hq, L, S, device) -> None:
    from flexcore.blockmask import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise InputError(f"block_mask must be a flexcore.BlockMask (from flexcore.create_block_mask), "
                         f"got {type(block_mask).__name__}")
    mq, mkv = block_mask.seq_lengths
    if (mq, mkv) != (L, S):
        raise InputError(
            f"block_mask was built for Q_LEN={mq}, KV_LEN={mkv} but query has length {L} and key {S}. "
            f"Build it with create_block_mask(mask_mod, B, H, {L}, {S}); for decoding with a sliced "
            f"mask, set its lengths with dataclasses.replace(mask, seq_lengths=({L}, {S}))")
    mb, mh, qb = block_mask.kv_num_blocks.shape
    if mb not in (1, B) or mh not in (1, Hq):
        raise InputError(f"block_mask has batch {mb} and heads {mh}; expected batch 1 or {B} and heads "
                         f"1 or {Hq} (the query's)")
    if block_mask.kv_num_blocks.device != device:
        raise InputError(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on {device}; "
                         f"move it with block_mask.to({str(device)!r})")
    bq, bkv = block_mask.BLOCK_SIZE
    if qb * bq < L or block_mask.kv_indices.shape[-1] * bkv < S:
        raise InputError(f"block_mask covers {qb * bq} queries and {block_mask.kv_indices.shape[-1] * bkv} "
                         f"keys with BLOCK_SIZE {block_mask.BLOCK_SIZE}; the inputs need {L} and {S}")


@functools.lru_cache(maxsize=64)
def _full_block_mask(B: int, H: int, L: int, S: int, device: torch.device):
    from flexcore.blockmask import create_block_mask
    from flexcore.masks import noop_mask

    return create_block_mask(noop_mask, None, None, L, S, device=device)


def _kv_blocks(block_mask, B, Hq):
    from flexcore.kernels.forward import BlockTensors

    def expand(t):
        return None if t is None else t.expand(B, Hq, *t.shape[2:])

    return BlockTensors(expand(block_mask.kv_num_blocks), expand(block_mask.kv_indices),
                        expand(block_mask.full_kv_num_blocks), expand(block_mask.full_kv_indices),
                        tuple(block_mask.BLOCK_SIZE))


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, score_lowered, mask_lowered, blocks, scale, opts):
        from flexcore.kernels.decode import decode, use_decode_kernel
        from flexcore.kernels.forward import forward

        if use_decode_kernel(query.shape[2], opts):
            out, lse = decode(query, key, value, score_lowered, mask_lowered, blocks, scale, opts)
        else:
            B = query.shape[0]  # a shared (batch 1) cache is read through stride-0 views
            out, lse = forward(query, key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1),
                               score_lowered, mask_lowered, blocks, scale, opts)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        raise NotImplementedError("flexcore's backward kernels are not implemented yet; "
                                  "use flexcore.reference.flex_attention_reference for gradients")


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: ScoreMod | None = None,
                   block_mask=None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options=None):
    """Attention with a user score_mod and a block-sparse mask, in one fused Triton kernel.

    Same signature and semantics as ``torch.nn.attention.flex_attention.flex_attention``.

    Args:
        query: (B, Hq, L, D); key: (B, Hkv, S, D); value: (B, Hkv, S, Dv). float16, bfloat16 or float32.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to every computed score.
        block_mask: a :class:`flexcore.BlockMask`; None attends everywhere.
        scale: multiplies q·k; default ``1/sqrt(D)``.
        enable_gqa: allow Hq to be a multiple of Hkv (grouped-query attention).
        return_lse: also return the log-sum-exp of the scores, (B, Hq, L) float32.
        kernel_options: a :class:`flexcore.KernelOptions` or a dict of its fields.

    Returns:
        out (B, Hq, L, Dv) in the inputs' dtype, and lse if ``return_lse``.

    Example:
        >>> def alibi(score, b, h, q_idx, kv_idx):
        ...     return score - slopes[h] * (q_idx - kv_idx).abs()
        >>> out = flex_attention(q, k, v, score_mod=alibi, block_mask=causal_mask)
    """
    from flexcore.lowering import lower_mask_mod, lower_score_mod

    prepare_triton()  # before anything imports triton's jit machinery on an interpreter machine
    validate_inputs(query, key, value, block_mask, scale, enable_gqa)
    opts = KernelOptions.from_any(kernel_options)
    if score_mod is not None and not callable(score_mod):
        raise InputError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, "
                         f"got {type(score_mod).__name__}")
    B, Hq, L, D = query.shape
    S = key.shape[2]
    if block_mask is None:
        block_mask = _full_block_mask(B, Hq, L, S, query.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    score_lowered = lower_score_mod(score_mod)
    mask_lowered = lower_mask_mod(block_mask.mask_mod)
    blocks = _kv_blocks(block_mask, B, Hq)
    out, lse = _FlexAttention.apply(query, key, value, score_lowered, mask_lowered, blocks, scale, opts)
    return (out, lse) if return_lse else out
