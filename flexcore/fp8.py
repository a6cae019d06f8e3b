"""FP8 (float8 e4m3) forward attention: the descale factors, their checks, and quantization.

FlashAttention-3's convention: q, k and v are stored in ``torch.float8_e4m3fn`` with float32
descale factors, the real values being ``x = x_fp8 · descale``. flex_attention takes them as
``descale_q=``, ``descale_k=``, ``descale_v=`` (keyword-only), one per tensor (shape ``()`` or
``(1,)``) or one per batch and head (shape ``(B, H)``, batch 1 broadcasting; H is the KV heads for
k and v, and the KV heads (FlashAttention-3's layout) or the query heads for q). The scores the
mods see are the descaled, scaled scores ``(q · descale_q) · (k · descale_k) · scale``, exactly
as for 16-bit inputs; the output is bfloat16 and the lse float32. The path is forward-only.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from flexcore.errors import InputError

__all__ = ["FP8_DTYPE", "OUTPUT_DTYPE", "Descales", "check_fp8_inputs", "quantize", "dequantize",
           "descale_per_head", "key_major"]

FP8_DTYPE = torch.float8_e4m3fn
#: The output dtype of FP8 attention (as FlashAttention-3's).
OUTPUT_DTYPE = torch.bfloat16
#: Smallest CUDA compute capability with FP8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell.
MIN_CAPABILITY = (8, 9)
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_OTHER_FP8 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
_NAMES = ("descale_q", "descale_k", "descale_v")


class Descales(NamedTuple):
    """The descale tensors of one call as the forward kernel reads them.

    Attributes:
        q, k, v: the float32 descale tensors (any of the accepted shapes).
        layout: (q batch stride, q head stride, q head divisor, k batch stride, k head stride,
            v batch stride, v head stride), in elements; a stride of 0 broadcasts. The kernel reads
            q's factor of (batch b, query head h) at ``b·s_b + (h // divisor)·s_h``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    layout: tuple[int, ...]


def is_fp8(t) -> bool:
    return isinstance(t, Tensor) and t.dtype == FP8_DTYPE


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ("," if t.dim() == 1 else "") + ")"


def check_fp8_inputs(query, key, value, descale_q, descale_k, descale_v,
                     device_check: bool = True) -> Descales | None:
    """The call's :class:`Descales` where q, k, v are float8_e4m3fn, None where none is float8
    (and no descale is given); InputError naming the argument for every mistake: some inputs in
    float8 and others not, another float8 format, a missing descale, a descale of the wrong
    type, shape, dtype or device, or (``device_check``) a device without FP8 tensor cores. Reads
    shapes, dtypes and devices only; descales on the CPU are also checked for finite positive values."""
    if (descale_q is None and descale_k is None and descale_v is None
            and not (is_fp8(query) or is_fp8(key) or is_fp8(value))):
        return None  # the common call: nothing to check here
    named = (("query", query), ("key", key), ("value", value))
    descales = dict(zip(_NAMES, (descale_q, descale_k, descale_v)))
    for name, t in named:
        if isinstance(t, Tensor) and t.dtype in _OTHER_FP8:
            raise InputError(f"{name} has dtype {t.dtype}; FP8 attention takes torch.float8_e4m3fn "
                             f"(with descale factors), as FlashAttention-3")
    fp8 = [name for name, t in named if is_fp8(t)]
    if not fp8:
        given = [n for n, d in descales.items() if d is not None]
        if given:
            dtype = query.dtype if isinstance(query, Tensor) else type(query).__name__
            raise InputError(f"{', '.join(given)} given, but query, key and value are {dtype}: "
                             f"descale factors apply to torch.float8_e4m3fn inputs only; leave them "
                             f"out for 16- and 32-bit inputs")
        return None
    if len(fp8) != 3:
        dtypes = ", ".join(f"{n} {t.dtype if isinstance(t, Tensor) else type(t).__name__}"
                           for n, t in named)
        raise InputError(f"mixed FP8 inputs ({dtypes}): FP8 attention takes query, key and value all "
                         f"in torch.float8_e4m3fn, each with its descale factor; quantize the others "
                         f"too (flexcore.fp8.quantize) or give all three in one 16-bit dtype")
    missing = [n for n, d in descales.items() if d is None]
    if missing:
        raise InputError(f"float8_e4m3fn query, key and value need descale_q, descale_k and descale_v; "
                         f"missing: {', '.join(missing)}. Each is a float32 tensor with x = x_fp8 · "
                         f"descale, of shape () for the whole tensor or (B, H) per batch and head "
                         f"(torch.ones(()) for values stored unscaled; flexcore.fp8.quantize returns both)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None  # the shapes' own check names the tensor
    if device_check:
        check_fp8_device(query.device)
    B, Hq = query.shape[:2]
    Hkv = key.shape[1]
    layout = []
    for name, heads in (("descale_q", (Hkv, Hq)), ("descale_k", (Hkv,)), ("descale_v", (Hkv,))):
        layout += _descale_layout(name, descales[name], query, B, heads, Hq)
    return Descales(descale_q, descale_k, descale_v, tuple(layout))


def _descale_layout(name: str, d, query: Tensor, B: int, heads: tuple[int, ...], Hq: int) -> list[int]:
    """The kernel's strides of one descale (and q's head divisor); InputError naming it."""
    per_head = " or ".join(f"({B}, {h})" for h in dict.fromkeys(heads))
    what = ("per batch and KV head (FlashAttention-3's layout) or per batch and query head"
            if name == "descale_q" and len(set(heads)) > 1 else "per batch and KV head")
    valid = f"() or (1,) for one factor per tensor, or {per_head} {what} (batch 1 broadcasts)"
    if not isinstance(d, Tensor):
        raise InputError(f"{name} must be a float32 torch.Tensor of shape {valid}; got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise InputError(f"{name} has dtype {d.dtype}; expected torch.float32 (shape {valid})")
    if d.device != query.device:
        raise InputError(f"{name} is on {d.device} but query is on {query.device}; move it with "
                         f"{name}.to({str(query.device)!r})")
    if d.dim() <= 1 and d.numel() == 1:
        strides = [0, 0]
        divisor = 1
    elif d.dim() == 2 and d.shape[0] in (1, B) and d.shape[1] in heads:
        strides = [0 if d.shape[0] == 1 else d.stride(0), d.stride(1)]
        divisor = Hq // d.shape[1]
    else:
        raise InputError(f"{name} has shape {_shape(d)}; expected {valid}")
    if d.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool((torch.isfinite(d) & (d > 0)).all()):
            raise InputError(f"{name} holds values that are not finite and positive "
                             f"({d.flatten()[:8].tolist()}); a descale is the positive factor with "
                             f"x = x_fp8 · descale (for example amax / 448)")
    return strides + [divisor] if name == "descale_q" else strides


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[tuple[int, int], str]:
    return torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index)


def check_fp8_device(device: torch.device) -> None:
    """InputError unless FP8 attention runs on ``device``: a CUDA GPU with FP8 tensor cores, or
    the CPU where flexcore runs its kernels under Triton's interpreter (which upcasts)."""
    if device.type == "cuda":
        (major, minor), name = _capability(device.index if device.index is not None
                                           else torch.cuda.current_device())
        if (major, minor) < MIN_CAPABILITY:
            raise InputError(
                f"float8_e4m3fn attention needs FP8 tensor cores: CUDA compute capability 8.9 or "
                f"newer (Ada: L4, L40S, RTX 4090; Hopper: H100, H200; Blackwell: B200). {device} is "
                f"{name} (sm_{major}{minor}); use bfloat16 inputs on this GPU")
        return
    if device.type != "cpu":
        raise InputError(f"float8_e4m3fn attention runs on CUDA GPUs of compute capability 8.9 or "
                         f"newer (and on the CPU under Triton's interpreter); the inputs are on {device}")


def descale_per_head(descale: Tensor, B: int, H: int) -> Tensor:
    """``descale`` as a (B, H) tensor: one factor per tensor, or per (batch, head) of H heads or of
    a divisor of H (head h reads factor h // (H / heads), as GQA groups read their KV head)."""
    d = descale.reshape(1, 1) if descale.numel() == 1 and descale.dim() <= 1 else descale
    return d.repeat_interleave(H // d.shape[1], dim=1).expand(B, H)


def dequantize(x: Tensor, descale: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """``x.to(dtype) · descale`` per (batch, head): the real values of a float8 (B, H, L, D) tensor."""
    B, H = x.shape[:2]
    factor = descale_per_head(descale.to(dtype), B, H)
    return x.to(dtype) * factor[:, :, None, None]


def quantize(x: Tensor, *, heads: int | None = None, per_tensor: bool = False,
             power_of_two: bool = False) -> tuple[Tensor, Tensor]:
    """(x_fp8, descale) with x ≈ x_fp8 · descale: each group's largest |x| maps to e4m3's 448.

    Args:
        x: (B, H, L, D) floating tensor.
        heads: per-head groups: descale is (B, heads), heads dividing H, each factor covering
            H / heads consecutive heads (the KV heads' count for a GQA query: FlashAttention-3's
            q_descale layout); default H.
        per_tensor: one factor for the whole tensor, shape ().
        power_of_two: round each factor up to a power of two, so that x_fp8 · descale is exact in
            bfloat16 and float32 (its rounding then is e4m3's alone).

    Example:
        >>> q8, dq = quantize(q, heads=k.shape[1])
        >>> k8, dk = quantize(k)
        >>> v8, dv = quantize(v)
        >>> out = flex_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, enable_gqa=True)
    """
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise InputError(f"quantize takes a floating (B, H, L, D) tensor; got "
                         f"{_shape(x) if isinstance(x, Tensor) else type(x).__name__}")
    B, H = x.shape[:2]
    heads = H if heads is None else heads
    if heads <= 0 or H % heads:
        raise InputError(f"quantize: heads={heads} must divide the tensor's {H} heads")
    xf = x.detach().float()
    if per_tensor:
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
    else:
        # An explicit group size: a batch of 0 cannot infer -1; an empty group's amax is 0 (descale 1).
        groups = xf.reshape(B, heads, (H // heads) * x.shape[2] * x.shape[3]).abs()
        amax = groups.amax(dim=-1) if groups.shape[-1] else groups.new_zeros(B, heads)
    descale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    if power_of_two:
        descale = torch.exp2(torch.ceil(torch.log2(descale)))
    scale = descale if per_tensor else descale_per_head(descale, B, H)[:, :, None, None]
    return (xf / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE), descale.float()


def key_major(value: Tensor) -> Tensor:
    """``value`` (B, H, S, Dv) with the key dimension contiguous (stride 1), as the FP8 forward reads
    V: FP8 tensor-core products take both operands K-major, and P·V's reduction runs over the keys.
    A tensor already laid out so is returned as it is (no copy); otherwise one copy, with rows of
    keys padded to a multiple of 16 so that tensor descriptors can read them."""
    if value.stride(2) == 1:
        return value
    B, H, S, Dv = value.shape
    padded = -(-S // 16) * 16
    if value.is_cuda and value.stride(3) == 1:
        # A kernel moving tiles, coalesced on both sides: torch's strided copy of 1-byte elements
        # is not (docs/decisions.md#fp8-forward).
        from flexcore.kernels.layout import key_major_copy

        return key_major_copy(value, padded)
    buffer = torch.empty((B, H, Dv, padded), dtype=value.dtype, device=value.device)[..., :S]
    buffer.copy_(value.transpose(2, 3))
    return buffer.transpose(2, 3)


@functools.lru_cache(maxsize=64)
def fp8_options(opts):
    """``opts`` (a :class:`flexcore.KernelOptions`) for a float8 call: its dispatch policy with the
    FP8 rules applied (:func:`flexcore.kernels.policy.fp8_policy`); InputError where the options
    force the decoding kernel, which has no FP8 path. Kept per options
    (they are frozen and hashable): building and checking a policy costs more than a call's host
    path."""
    import dataclasses

    from flexcore.kernels.policy import fp8_policy

    if opts.decode:
        raise InputError("kernel_options decode=True (or BACKEND='TRITON_DECODE') forces the decoding "
                         "kernel, which has no FP8 path; float8_e4m3fn calls run the forward kernel at "
                         "every query length: leave decode unset")
    policy = fp8_policy(opts.dispatch)
    if policy == opts.dispatch:
        return opts
    return dataclasses.replace(opts, policy=policy)
