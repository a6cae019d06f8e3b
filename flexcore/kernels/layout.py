"""Host side of the layout copies that the kernels read (templates/layout.py.tmpl)."""
from __future__ import annotations

import torch
from torch import Tensor

from flexcore.kernels.launch import run

__all__ = ["key_major_copy"]

_BLOCK_S = 64


def _module():
    from flexcore.kernels import codegen

    return codegen.cached_module(("layout.py.tmpl",),
                                 lambda: codegen.HEADER + codegen.read_template("layout.py.tmpl"), "layout")


def key_major_copy(value: Tensor, padded: int, operand_order: bool = False) -> Tensor:
    """``value`` (B, H, S, D) with unit key or head-dim stride, copied into a (B, H, D, ``padded``)
    buffer of keys, and returned as its (B, H, S, D) view of key stride 1 (flexcore.fp8.key_major).
    ``operand_order``: the keys of each 32-key group in the Gluon FP8 forward's operand order
    (templates/layout.py.tmpl); S must then be a multiple of 32."""
    B, H, S, D = value.shape
    buffer = torch.empty((B, H, D, padded), dtype=value.dtype, device=value.device)
    if value.numel():
        block_d = max(16, 1 << (D - 1).bit_length())
        run(_module().key_major_kernel, (-(-S // _BLOCK_S), B * H),
            (value, buffer, H, S, D, value.stride(0), value.stride(1), value.stride(2), value.stride(3),
             buffer.stride(0), buffer.stride(1), buffer.stride(2)),
            dict(BLOCK_S=_BLOCK_S, BLOCK_D=block_d, OPERAND_ORDER=operand_order))
    return buffer[..., :S].transpose(2, 3)
