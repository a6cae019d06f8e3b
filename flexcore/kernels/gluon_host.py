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

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


@functools.lru_cache(maxsize=None)
def _layout(block: int, cols: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([block, cols], _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int, block: int, block_cols: int | None = None) -> TensorDescriptor:
    """A TMA descriptor over ``rows`` rows of ``t`` (B, H, N, D) of row stride t.stride(2), based
    at t's first element, read in blocks of ``block`` rows and ``block_cols`` columns (default all D;
    FP8's V^T view reads BLOCK_N keys of its S columns)."""
    d = t.shape[-1]
    cols = d if block_cols is None else block_cols
    return TensorDescriptor(t, [rows, d], [t.stride(2), 1], [block, cols], _layout(block, cols, t.dtype))
