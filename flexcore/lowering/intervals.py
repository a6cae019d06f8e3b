"""Interval analysis of a traced mod: bounds of every value from the bounds of b, h, q_idx, kv_idx.

Each node gets ``[lo, hi]`` containing every value it takes at any position (over all elements of
a per-position tensor). Most mods index with affine expressions of the indices, whose intervals
are exact; anything the analysis does not model gets the full range of its dtype, so a proof
that an index lies in range is sound whatever the mod does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

_INF = math.inf


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float

    def within(self, lo: float, hi: float) -> bool:
        return lo <= self.lo and self.hi <= hi

    def hull(self, other: "Interval") -> "Interval":
        return Interval(min(self.lo, other.lo), max(self.hi, other.hi))


TOP = Interval(-_INF, _INF)
BOOL = Interval(0, 1)


def dtype_range(dtype: torch.dtype) -> Interval:
    if dtype == torch.bool:
        return BOOL
    if dtype.is_floating_point or dtype.is_complex:
        return TOP
    info = torch.iinfo(dtype)
    return Interval(info.min, info.max)


def _mul(a: float, b: float) -> float:
    return 0 if a == 0 or b == 0 else a * b


def _products(a: Interval, b: Interval) -> Interval:
    cands = [_mul(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return Interval(min(cands), max(cands))


def _rounded_quotients(a: Interval, b: Interval, rounding) -> list | None:
    """``rounding(x / y)`` at the corners of a / b (infinities kept), or None where b holds 0."""
    if b.lo <= 0 <= b.hi:
        return None
    quotients = [x / y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return [q if math.isinf(q) else float(rounding(q)) for q in quotients]


def _floor_div(a: Interval, b: Interval) -> Interval:
    cands = _rounded_quotients(a, b, math.floor)
    return TOP if cands is None else Interval(min(cands), max(cands))


def _trunc_div(a: Interval, b: Interval) -> Interval:
    cands = _rounded_quotients(a, b, math.trunc)
    if cands is None:
        return TOP
    return Interval(min(min(cands), 0) if a.lo < 0 < a.hi else min(cands),
                    max(max(cands), 0) if a.lo < 0 < a.hi else max(cands))


def _remainder(a: Interval, b: Interval, integer: bool) -> Interval:
    """Python's (torch's) remainder: the divisor's sign."""
    if b.lo > 0:
        if a.lo >= 0 and a.hi < b.lo:
            return a
        return Interval(0, b.hi - 1 if integer else b.hi)
    if b.hi < 0:
        if a.hi <= 0 and a.lo > b.hi:
            return a
        return Interval(b.lo + 1 if integer else b.lo, 0)
    return TOP


def _fmod(a: Interval, b: Interval, integer: bool) -> Interval:
    """C's fmod: the dividend's sign, magnitude below the divisor's."""
    m = max(abs(b.lo), abs(b.hi))
    if m == _INF or (b.lo <= 0 <= b.hi and not integer):
        return Interval(min(a.lo, 0), max(a.hi, 0))
    m = m - 1 if integer else m
    return Interval(max(min(a.lo, 0), -m), min(max(a.hi, 0), m))


def _to_dtype(iv: Interval, dtype: torch.dtype) -> Interval:
    """A value converted to ``dtype``: truncation toward zero, wrap-around outside the range."""
    if dtype == torch.bool:
        return BOOL
    if dtype.is_floating_point:
        return iv
    lo = iv.lo if math.isinf(iv.lo) else math.trunc(iv.lo)
    hi = iv.hi if math.isinf(iv.hi) else math.trunc(iv.hi)
    full = dtype_range(dtype)
    return Interval(lo, hi) if Interval(lo, hi).within(full.lo, full.hi) else full


def _out_dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0]
    return getattr(val, "dtype", None)


class IntervalAnalysis:
    """Intervals of every node of ``gm``.

    Args:
        gm: a graph traced by :func:`flexcore.lowering.trace.trace_mod`.
        inputs: interval of each placeholder by name (``score``, ``b``, ``h``, ``q_idx``,
            ``kv_idx``).
        tensor_range: ``tensor -> Interval`` of a captured tensor's values (its dtype's range
            when only the structure may be used, its min and max at run time).
    """

    def __init__(self, gm: GraphModule, inputs: dict, tensor_range):
        self.gm = gm
        self.tensor_range = tensor_range
        self.iv: dict[Node, Interval] = {}
        names = [n for n in gm.graph.nodes if n.op == "placeholder"]
        order = ("score", "b", "h", "q_idx", "kv_idx") if len(names) == 5 else (
            "b", "h", "q_idx", "kv_idx")
        for node, name in zip(names, order):
            self.iv[node] = inputs.get(name, TOP)
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                self.iv[node] = self._get_attr(node)
            elif node.op == "call_function":
                try:
                    iv = self._call(node)
                except (TypeError, ValueError, OverflowError, ZeroDivisionError):
                    iv = None
                dtype = _out_dtype(node)
                full = dtype_range(dtype) if dtype is not None else TOP
                if iv is None or not iv.within(full.lo, full.hi):
                    # Unknown, or past the dtype's range: the value may wrap anywhere in it.
                    iv = full
                self.iv[node] = iv

    def of(self, arg) -> Interval:
        if isinstance(arg, Node):
            return self.iv.get(arg, TOP)
        if isinstance(arg, bool):
            return Interval(int(arg), int(arg))
        if isinstance(arg, (int, float)):
            return Interval(arg, arg)
        return TOP

    def _get_attr(self, node: Node) -> Interval:
        t = getattr(self.gm, node.target)
        users = list(node.users)
        literal = users and all(u.op == "call_function" and "lift_fresh" in str(u.target)
                                for u in users)
        if literal or t.numel() == 0:
            if t.numel() == 0:
                return Interval(0, 0)
            # torch.tensor([...]) written in the mod: its values are part of the code.
            return Interval(t.min().item(), t.max().item())
        return self.tensor_range(t)

    def _call(self, node: Node) -> Interval | None:
        packet = getattr(node.target, "overloadpacket", None)
        name = packet.__name__ if packet is not None else getattr(node.target, "__name__", "")
        args = node.args
        dtype = _out_dtype(node)
        integer = dtype is not None and not dtype.is_floating_point
        of = self.of
        if name in ("add", "sub", "rsub"):
            a, b = of(args[0]), of(args[1])
            alpha = node.kwargs.get("alpha", args[2] if len(args) > 2 else 1)
            b = _products(b, Interval(alpha, alpha))
            if name == "rsub":
                a, b = b, a
            if name == "add":
                return Interval(a.lo + b.lo, a.hi + b.hi)
            return Interval(a.lo - b.hi, a.hi - b.lo)
        if name == "mul":
            return _products(of(args[0]), of(args[1]))
        if name == "neg":
            a = of(args[0])
            return Interval(-a.hi, -a.lo)
        if name == "abs":
            a = of(args[0])
            if a.lo >= 0:
                return a
            if a.hi <= 0:
                return Interval(-a.hi, -a.lo)
            return Interval(0, max(-a.lo, a.hi))
        if name in ("floor_divide",):
            return _floor_div(of(args[0]), of(args[1]))
        if name == "div":
            mode = node.kwargs.get("rounding_mode")
            a, b = of(args[0]), of(args[1])
            if mode == "floor":
                return _floor_div(a, b)
            if mode == "trunc":
                return _trunc_div(a, b)
            if b.lo <= 0 <= b.hi:
                return TOP
            cands = [x / y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            return Interval(min(cands), max(cands))
        if name == "remainder":
            return _remainder(of(args[0]), of(args[1]), integer)
        if name == "fmod":
            return _fmod(of(args[0]), of(args[1]), integer)
        if name in ("minimum", "fmin"):
            a, b = of(args[0]), of(args[1])
            return Interval(min(a.lo, b.lo), min(a.hi, b.hi))
        if name in ("maximum", "fmax"):
            a, b = of(args[0]), of(args[1])
            return Interval(max(a.lo, b.lo), max(a.hi, b.hi))
        if name in ("clamp", "clamp_min", "clamp_max"):
            a = of(args[0])
            lo = hi = None
            if name == "clamp":
                rest = list(args[1:]) + [None, None]
                lo = node.kwargs.get("min", rest[0])
                hi = node.kwargs.get("max", rest[1])
            elif name == "clamp_min":
                lo = args[1]
            else:
                hi = args[1]
            if lo is not None:
                lo_iv = of(lo)
                a = Interval(max(a.lo, lo_iv.lo), max(a.hi, lo_iv.hi))
            if hi is not None:
                hi_iv = of(hi)
                a = Interval(min(a.lo, hi_iv.lo), min(a.hi, hi_iv.hi))
            return a
        if name == "where":
            return of(args[1]).hull(of(args[2]))
        if name == "masked_fill":
            return of(args[0]).hull(of(args[2]))
        if name in ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
                    "logical_not", "isnan", "isinf", "signbit"):
            return BOOL
        if name == "bitwise_and":
            a, b = of(args[0]), of(args[1])
            if dtype == torch.bool:
                return BOOL
            his = [x.hi for x in (a, b) if x.lo >= 0]
            return Interval(0, min(his)) if his else None
        if name in ("bitwise_or", "bitwise_xor"):
            a, b = of(args[0]), of(args[1])
            if dtype == torch.bool:
                return BOOL
            if a.lo >= 0 and b.lo >= 0 and max(a.hi, b.hi) < _INF:
                top = 1 << int(max(a.hi, b.hi)).bit_length()
                return Interval(0, top - 1)
            return None
        if name in ("bitwise_left_shift", "__lshift__", "bitwise_right_shift", "__rshift__"):
            a, s = of(args[0]), of(args[1])
            if s.lo < 0 or s.hi > 62 or s.lo != s.hi:
                return None
            f = 2 ** int(s.lo)
            if "left" in name or "lshift" in name:
                return _products(a, Interval(f, f))
            return _floor_div(a, Interval(f, f))
        if name == "_to_copy":
            return _to_dtype(of(args[0]), dtype)
        if name in ("floor", "ceil", "round", "trunc"):
            a = of(args[0])
            fn = {"floor": math.floor, "ceil": math.ceil, "round": round, "trunc": math.trunc}[name]
            return Interval(*(x if math.isinf(x) else fn(x) for x in (a.lo, a.hi)))
        if name == "sign":
            return Interval(-1, 1)
        if name in ("index", "index_select"):
            return of(args[0])
        if name in ("clone", "alias", "detach", "lift_fresh_copy", "unsqueeze", "squeeze",
                    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t",
                    "select", "slice", "flip", "repeat", "amax", "amin", "cat", "stack"):
            first = args[0]
            if isinstance(first, (list, tuple)):
                ivs = [of(x) for x in first]
                out = ivs[0]
                for x in ivs[1:]:
                    out = out.hull(x)
                return out
            return of(first)
        if name in ("full", "new_full", "full_like"):
            v = args[1] if name != "new_full" else args[2]
            return Interval(v, v)
        if name == "scalar_tensor":
            return Interval(args[0], args[0])
        if name in ("zeros", "zeros_like", "new_zeros"):
            return Interval(0, 0)
        if name in ("ones", "ones_like", "new_ones"):
            return Interval(1, 1)
        if name == "arange":
            values = torch.arange(*args).tolist()
            return Interval(min(values), max(values)) if values else Interval(0, 0)
        if name == "pow":
            a, b = of(args[0]), of(args[1])
            if b.lo == b.hi and b.lo in (0, 1, 2, 3) and a.lo > -_INF and a.hi < _INF:
                n = int(b.lo)
                cands = [x ** n for x in (a.lo, a.hi)]
                lo = 0 if n % 2 == 0 and a.lo < 0 < a.hi else min(cands)
                return Interval(lo, max(cands))
            return None
        return None
