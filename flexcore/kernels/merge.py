"""Attention over disjoint key sets merged by lse, as one fused pass forward and one backward.

``merge(parts, out_dtype)`` gives ``(out, lse)`` of attention over the union of the parts' keys
from each part's ``(out_i, lse_i)``: ``out = Σ_i exp(lse_i - lse) out_i``, ``lse = logsumexp_i
lse_i``. The elementwise torch formula reads and writes float32 copies of every output several
times forward and backward; the kernels read each part once and write the result once.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from flexcore.errors import InputError
from flexcore.kernels.launch import run

__all__ = ["merge"]


def _module():
    from flexcore.kernels import codegen

    return codegen.cached_module(("merge.py.tmpl",),
                                 lambda: codegen.HEADER + codegen.read_template("merge.py.tmpl"), "merge")


def _tiles(d: int) -> dict:
    """A block of rows by the whole (padded) head dim: about 4K elements per program."""
    block_d = max(16, 1 << (d - 1).bit_length())
    return dict(BLOCK_R=max(1, 4096 // block_d), BLOCK_D=block_d)


class _MergeTwo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, oa: Tensor, la: Tensor, ob: Tensor, lb: Tensor, out_dtype: torch.dtype):
        oa, ob, la, lb = oa.contiguous(), ob.contiguous(), la.contiguous(), lb.contiguous()
        module = _module()
        out = torch.empty(oa.shape, dtype=out_dtype, device=oa.device)
        lse = torch.empty(la.shape, dtype=la.dtype, device=la.device)
        rows, d = la.numel(), oa.shape[-1]
        tiles = _tiles(d)
        if rows:
            run(module.merge_forward_kernel, (-(-rows // tiles["BLOCK_R"]),),
                (oa, ob, la, lb, out, lse, rows, d), tiles)
        ctx.save_for_backward(oa, ob, la, lb, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming back silently wrong
    def backward(ctx, dout, dlse):
        oa, ob, la, lb, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None
        if dout is None:
            dout = torch.zeros(oa.shape, dtype=oa.dtype, device=oa.device)
        dout = dout.contiguous()
        doa, dob = torch.empty_like(oa), torch.empty_like(ob)
        dla, dlb = torch.empty_like(la), torch.empty_like(lb)
        rows, d = la.numel(), oa.shape[-1]
        tiles = _tiles(d)
        if rows:
            run(_module().merge_backward_kernel, (-(-rows // tiles["BLOCK_R"]),),
                (oa, ob, la, lb, lse, dout, dout if dlse is None else dlse.contiguous(), doa, dob,
                 dla, dlb, rows, d), dict(HAS_DLSE=dlse is not None, **tiles))
        return doa, dla, dob, dlb, None


def merge(parts: list[tuple[Tensor, Tensor]], out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out, lse) of the union of ``parts``' keys: out in ``out_dtype``, lse in the parts' lse
    dtype. Parts are (out_i (B, H, L, D), lse_i (B, H, L)) over disjoint key sets; rows that no
    part attends to give out 0 and lse -inf, with zero gradients. More than two parts merge
    pairwise, holding the running result in float32 (float64 for float64) and rounding once."""
    _check_parts(parts)
    if len(parts) == 1:
        return parts[0]
    out, lse = parts[0]
    for i, (o, l) in enumerate(parts[1:], start=2):
        # The running result keeps the lse's dtype, the kernels' accumulation dtype.
        out, lse = _MergeTwo.apply(out, lse, o, l, out_dtype if i == len(parts) else l.dtype)
    return out, lse


def _check_parts(parts) -> None:
    """Raise InputError naming the part unless every part is (out (B, H, L, D), lse (B, H, L)) of
    one shape, lse in float32 or float64, all on one device: the kernels read them as flat rows."""
    if not parts:
        raise InputError("parts is empty; expected one or more (out, lse) pairs")
    shape, device = tuple(parts[0][0].shape), parts[0][0].device
    for i, part in enumerate(parts):
        if not (isinstance(part, (tuple, list)) and len(part) == 2
                and all(isinstance(t, Tensor) for t in part)):
            raise InputError(f"parts[{i}] is not an (out, lse) pair of tensors")
        out, lse = part
        if tuple(out.shape) != shape or tuple(lse.shape) != shape[:-1]:
            raise InputError(f"parts[{i}] has out {tuple(out.shape)} and lse {tuple(lse.shape)}; expected "
                             f"out {shape} and lse {shape[:-1]}, as parts[0]'s out")
        if lse.dtype not in (torch.float32, torch.float64):
            raise InputError(f"parts[{i}]'s lse has dtype {lse.dtype}; expected float32 or float64")
        if out.device != device or lse.device != device:
            raise InputError(f"parts[{i}] is on {out.device} / {lse.device}; expected {device}, as parts[0]")
