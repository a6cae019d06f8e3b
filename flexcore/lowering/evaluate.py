"""Dense evaluation of lowered mods with a small Triton kernel (tests and the workbench)."""
from __future__ import annotations

import torch

from flexcore.errors import InputError
from flexcore.kernels import codegen as kcodegen
from flexcore.lowering.api import LoweredMod, lower_mask_mod, lower_score_mod


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
        score: float32 input scores ``(B, H, Q_LEN, KV_LEN)``; standard normal when None.
        block_m, block_n: tile sizes (powers of two); by default 64 on a GPU and up to 256 under
            the interpreter, whose cost is per tile rather than per element.
        index_tiles: pass ``b``/``h`` to the mods as ``[BLOCK_M, 1]`` tiles (decode-style).

    Returns:
        ``(scores, mask)``: float32 post-score_mod scores and the bool mask, both
        ``(B, H, Q_LEN, KV_LEN)``.

    Example:
        >>> scores, mask = evaluate_mods(None, lambda b, h, q, kv: q >= kv, 1, 1, 4, 4)
        >>> mask[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    from flexcore._runtime import default_device, use_interpreter

    lowered_score = lower_score_mod(score_mod)
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
    if tuple(score.shape) != shape or score.dtype != torch.float32:
        raise InputError(f"score must be float32 of shape {shape}, got {score.dtype} "
                         f"{tuple(score.shape)}")
    score = score.to(device).contiguous()
    out = torch.empty(shape, dtype=torch.float32, device=device)
    mask = torch.empty(shape, dtype=torch.int8, device=device)
    cap = 256 if use_interpreter() else 64
    block_m = block_m or _default_block(Q_LEN, cap)
    block_n = block_n or _default_block(KV_LEN, cap)
    module = evaluate_module(lowered_score, lowered_mask)
    grid = (-(-Q_LEN // block_m), -(-KV_LEN // block_n), B * H)
    module._evaluate_kernel[grid](
        score, out, mask, H, Q_LEN, KV_LEN, *score.stride(),
        *lowered_score.kernel_args(), *lowered_mask.kernel_args(),
        BLOCK_M=block_m, BLOCK_N=block_n, INDEX_TILES=index_tiles)
    return out, mask.bool()
