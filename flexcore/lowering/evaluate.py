"""Dense evaluation of lowered mods with a small Triton kernel (tests and the workbench)."""
from __future__ import annotations

from pathlib import Path

import torch

from flexcore.errors import InputError
from flexcore.kernels import codegen as kcodegen
from flexcore.lowering.api import LoweredMod, lower_mask_mod, lower_score_mod
from flexcore.lowering.indexcheck import check_indices


def evaluate_module(score: LoweredMod, mask: LoweredMod):
    """The imported kernel module evaluating ``score`` and ``mask`` (cached on source text)."""
    return kcodegen.load_kernel_module("evaluate.py.tmpl", score, mask)


def _default_block(n: int, cap: int) -> int:
    block = 16
    while block < n and block < cap:
        block *= 2
    return block


def evaluate_mods(score_mod=None, mask_mod=None, B: int = 1, H: int = 1, Q_LEN: int = 128,
                  KV_LEN: int = 128, device=None, score: torch.Tensor | None = None, *,
                  block_m: int | None = None, block_n: int | None = None, index_tiles: bool = False,
                  generator: torch.Generator | None = None):
    """Evaluate mods densely through their generated Triton code.

    Args:
        score_mod, mask_mod: the user's mods (either may be None).
        B, H, Q_LEN, KV_LEN: grid size.
        device: where to run (default: the captured tensors' device, else flexcore's default).
        score: float32 (or float64) input scores ``(B, H, Q_LEN, KV_LEN)``; standard normal
            float32 when None. float64 scores lower the score_mod in float64 (as float64 inputs
            to flex_attention do).
        block_m, block_n: tile sizes (powers of two); by default 64 on a GPU and up to 256 under
            the interpreter, whose cost is per tile rather than per element.
        index_tiles: pass ``b``/``h`` to the mods as ``[BLOCK_M, 1]`` tiles (decode-style).

    Returns:
        ``(scores, mask)``: post-score_mod scores (the score's dtype) and the bool mask, both
        ``(B, H, Q_LEN, KV_LEN)``.

    Example:
        >>> scores, mask = evaluate_mods(None, lambda b, h, q, kv: q >= kv, 1, 1, 4, 4)
        >>> mask[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    from flexcore._runtime import default_device, use_interpreter

    score_dtype = torch.float64 if score is not None and score.dtype == torch.float64 \
        else torch.float32
    lowered_score = lower_score_mod(score_mod, score_dtype)
    lowered_mask = lower_mask_mod(mask_mod)
    captured = lowered_score.captured + lowered_mask.captured
    if device is None:
        device = score.device if score is not None else (
            captured[0].device if captured else default_device())
    device = torch.device(device)
    for t in captured:
        if t.device.type != device.type:
            raise InputError(f"a tensor captured by the mods lives on {t.device} but evaluation "
                             f"runs on {device}; move it with .to({str(device)!r})")
    for name, n in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(n, int) or n < 1:
            raise InputError(f"{name} must be a positive int, got {n!r}")
    shape = (B, H, Q_LEN, KV_LEN)
    if score is None:
        score = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
    if tuple(score.shape) != shape or score.dtype not in (torch.float32, torch.float64):
        raise InputError(f"score must be float32 or float64 of shape {shape}, got {score.dtype} "
                         f"{tuple(score.shape)}")
    score = score.to(device).contiguous()
    out = torch.empty(shape, dtype=score_dtype, device=device)
    mask = torch.empty(shape, dtype=torch.int8, device=device)
    cap = 256 if use_interpreter() else 64
    block_m = block_m or _default_block(Q_LEN, cap)
    block_n = block_n or _default_block(KV_LEN, cap)
    # Indices into captured tensors are checked over the whole grid first (the workbench shows
    # what a user wrote; an out-of-range read must be an error, not a picture).
    check_indices(lowered_score, "score", B, H, Q_LEN, KV_LEN, runtime=True)
    check_indices(lowered_mask, "mask", B, H, Q_LEN, KV_LEN, runtime=True)
    module = evaluate_module(lowered_score, lowered_mask)
    grid = (-(-Q_LEN // block_m), -(-KV_LEN // block_n), B * H)
    with torch.no_grad():  # captured tensors may require grad; the kernel only reads them
        module._evaluate_kernel[grid](
            score, out, mask, H, Q_LEN, KV_LEN, *score.stride(),
            *lowered_score.kernel_args(), *lowered_mask.kernel_args(),
            BLOCK_M=block_m, BLOCK_N=block_n, INDEX_TILES=index_tiles)
    return out, mask.bool()


_TEMPLATES = Path(__file__).parent / "templates"


def evaluate_score_backward(score_mod, score: torch.Tensor, grad: torch.Tensor, *,
                            block_m: int | None = None, block_n: int | None = None,
                            transposed: bool = False, deterministic: bool = False):
    """Evaluate a score_mod's lowered vector-Jacobian product densely through its generated code.

    Args:
        score_mod: the user's score_mod; its captured floating-point tensors that require grad
            get gradients.
        score: float32 (or float64) input scores ``(B, H, Q_LEN, KV_LEN)``.
        grad: d loss / d (modified score), same shape and dtype.
        block_m, block_n: tile sizes (powers of two), as in :func:`evaluate_mods`.
        transposed: pass q_idx as a row and kv_idx as a column, as the backward's dK/dV programs do.
        deterministic: accumulate captured gradients in fixed point (the deterministic backward).

    Returns:
        ``(dscore, grads)``: d loss / d score, and a list with the gradient of each captured tensor
        of the forward's lowering (None where it gets none).

    Example:
        >>> dscore, (dslopes,) = evaluate_score_backward(alibi, score, torch.ones_like(score))
    """
    from flexcore._runtime import use_interpreter
    from flexcore.lowering.vjp import lower_score_mod_backward

    shape = tuple(score.shape)
    if score.dim() != 4 or tuple(grad.shape) != shape or grad.dtype != score.dtype:
        raise InputError(f"score and grad must be (B, H, Q_LEN, KV_LEN) of one dtype, got "
                         f"{score.dtype} {shape} and {grad.dtype} {tuple(grad.shape)}")
    score_dtype = torch.float64 if score.dtype == torch.float64 else torch.float32
    forward = lower_score_mod(score_mod, score_dtype)
    lowered = lower_score_mod_backward(score_mod, forward, score_dtype)
    device = score.device
    B, H, Q_LEN, KV_LEN = shape
    check_indices(forward, "score", B, H, Q_LEN, KV_LEN, runtime=True)
    values = {"MOD_FUNCTIONS": lowered.source.rstrip() + "\n",
              "SCORE_CAPS": kcodegen.cap_list(lowered.cap_params),
              "GRAD_CAPS": kcodegen.cap_list(lowered.grad_params)}
    source = kcodegen.HEADER + kcodegen.fill_template(
        (_TEMPLATES / "evaluate_backward.py.tmpl").read_text(), values)
    module = kcodegen.load_module(source, "evaluate_backward")
    buffers, grad_args = {}, []
    for i in lowered.grad_of:
        t = lowered.captured[i]
        dtype = torch.int64 if deterministic else (
            torch.float64 if t.dtype == torch.float64 else torch.float32)
        buffers[i] = torch.zeros(t.shape, dtype=dtype, device=device)
        grad_args += [buffers[i], *buffers[i].stride()]
    score, grad = score.contiguous(), grad.contiguous()
    out = torch.zeros_like(score)
    cap = 256 if use_interpreter() else 64
    block_m = block_m or _default_block(Q_LEN, cap)
    block_n = block_n or _default_block(KV_LEN, cap)
    grid = (-(-Q_LEN // block_m), -(-KV_LEN // block_n), B * H)
    with torch.no_grad():  # the captured tensors may require grad; the kernel only reads them
        module._evaluate_backward_kernel[grid](
            score, grad, out, H, Q_LEN, KV_LEN, *score.stride(), *lowered.kernel_args(),
            *grad_args, BLOCK_M=block_m, BLOCK_N=block_n, TRANSPOSED=transposed,
            FIXED_POINT_GRADS=deterministic)
    grads = []
    for i, t in enumerate(lowered.captured):
        buf = buffers.get(i)
        if buf is not None and deterministic:
            buf = buf.double() * 2.0 ** -32
        grads.append(None if buf is None else buf.to(t.dtype))
    return out, grads
