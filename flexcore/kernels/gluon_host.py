"""The host side of flexcore.kernels.hopper's Gluon kernels: TMA descriptors over (rows, D) views
(imported only on a CUDA machine whose triton has Gluon's Hopper API; the kernels are the templates
forward_hopper.py.tmpl and backward_hopper.py.tmpl)."""
from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
# The kernels' API: where this import fails, this triton has no Hopper Gluon (hopper._gluon_host).
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.lru_cache(maxsize=None)
def _layout(block: int, head_dim: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([block, head_dim], _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int, block: int) -> TensorDescriptor:
    """A TMA descriptor over ``rows`` rows of ``t`` (B, H, N, D) of row stride t.stride(2), based
    at t's first element, read in blocks of ``block`` rows."""
    d = t.shape[-1]
    return TensorDescriptor(t, [rows, d], [t.stride(2), 1], [block, d], _layout(block, d, t.dtype))
