"""What the code generator holds per graph node: a scalar per position (``Val``), a small tensor per
position (``Lanes``), or a captured tensor not yet indexed down to one element (``View``).

torch evaluates a mod once per position (vmap), so every intermediate has a fixed per-position
shape; a 0-d value is one Triton tile, a ``(k,)`` value is ``k`` tiles held side by side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.fx import Node

#: Triton's name of each torch dtype a mod's values may have.
TL_TYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16",
    torch.int32: "tl.int32", torch.int64: "tl.int64", torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}
#: The kernel-side name of each index argument of a mod.
INDEX_ARGS = {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "kv"}

#: Most elements a per-position value may hold: each is a register tile in the kernel.
MAX_LANES = 256


@dataclass
class Val:
    """A scalar-per-position value: a Triton expression and what torch would call its dtype."""

    expr: str
    dtype: torch.dtype
    deps: frozenset = frozenset()  # which of b, h, q, kv, score the value depends on
    const: object = None  # Python value when known at trace time
    pyscalar: bool = False  # a Python number (weak in torch's type promotion)
    nonneg: bool = False  # provably >= 0 (an index that needs no wrap-around)


@dataclass
class Lanes:
    """A small tensor per position: ``vals`` holds its elements in row-major order."""

    shape: tuple
    vals: list

    @property
    def dtype(self) -> torch.dtype:
        return self.vals[0].dtype

    @property
    def numel(self) -> int:
        return len(self.vals)

    def at(self, coord) -> Val:
        flat = 0
        for c, s in zip(coord, self.shape):
            flat = flat * s + c
        return self.vals[flat]

    def at_broadcast(self, coord, out_shape) -> Val:
        """The element that broadcasting maps to ``coord`` of ``out_shape``."""
        coord = tuple(coord)[len(out_shape) - len(self.shape):]
        return self.at(tuple(0 if s == 1 else c for c, s in zip(coord, self.shape)))

    def deps(self) -> frozenset:
        out = frozenset()
        for v in self.vals:
            out |= v.deps
        return out


@dataclass(frozen=True)
class VDim:
    """A visible dimension of a View: captured dimension ``dim`` read at ``start + i * step``, or
    (``dim`` None) a broadcast dimension that unsqueeze or expand added."""

    dim: int | None
    size: int
    start: int = 0
    step: int = 1


@dataclass
class View:
    """A captured tensor with some dimensions indexed (``index``), the rest still visible."""

    cap: int
    dtype: torch.dtype
    shape: tuple
    index: tuple  # per captured dimension: a Val, or None while the dimension is still visible
    node: Node = field(default=None, repr=False)
    vdims: tuple | None = None  # visible dims in order; None: the unindexed captured dims

    def visible(self) -> tuple:
        if self.vdims is not None:
            return self.vdims
        return tuple(VDim(d, self.shape[d]) for d, i in enumerate(self.index) if i is None)


def numel(shape) -> int:
    return math.prod(shape)


def opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def float_literal(value: float) -> str:
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(float(value))


def literal(value, dtype: torch.dtype) -> str:
    """Triton source of a constant of ``dtype`` (plain literals for float32/int32 only)."""
    if dtype == torch.bool:
        return f"tl.full([], {bool(value)}, tl.int1)"
    if dtype.is_floating_point:
        if value == 0 and math.copysign(1.0, value) < 0:
            # A -0.0 constant: Triton's constants lose the sign (under the interpreter, at least),
            # a product of tensors keeps it.
            kind = "tl.float32" if dtype == torch.bfloat16 else TL_TYPES[dtype]
            cast = ".to(tl.bfloat16)" if dtype == torch.bfloat16 else ""
            return f"(tl.full([], 0.0, {kind}) * -1.0){cast}"
        if dtype == torch.bfloat16:
            # Rounded here and converted exactly: the interpreter has no bfloat16 constants.
            exact = float(torch.tensor(float(value), dtype=dtype))
            return f"tl.full([], {float_literal(exact)}, tl.float32).to(tl.bfloat16)"
        text = float_literal(float(value))
        return text if dtype == torch.float32 else f"tl.full([], {text}, {TL_TYPES[dtype]})"
    info = torch.iinfo(dtype)
    # A Python int beyond the type wraps around, as torch converts it (int32 * 3_000_000_000).
    value = (int(value) - info.min) % (1 << info.bits) + info.min
    if dtype == torch.int32:
        return str(value) if value >= 0 else f"({value})"
    return f"tl.full([], {value}, {TL_TYPES[dtype]})"


def convert_const(value, dtype: torch.dtype):
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)  # float -> int truncates toward zero, as torch does


def cast_expr(expr: str, dtype: torch.dtype) -> str:
    """Cast with torch's semantics: nonzero -> True, round-to-nearest-even to bfloat16."""
    if dtype == torch.bool:
        return f"({expr} != 0)"
    if dtype == torch.bfloat16:
        return f"fl_to_bfloat16({expr})"
    return f"{expr}.to({TL_TYPES[dtype]})"


@dataclass
class ReshapedView:
    """``view.reshape(shape)`` of a captured tensor's view whose element order changes (a
    flattened table): indices are collected for the leading dimensions (``fixed``); once all are
    given, the row-major position among ``shape`` picks the element of ``base``."""

    base: View
    shape: tuple
    fixed: tuple = ()
