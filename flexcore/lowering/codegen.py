"""Translate a traced mod's aten graph into the source of one ``@triton.jit`` function.

Every node's result gets the dtype torch computes for it (``node.meta["val"]``): operands are cast
explicitly because Triton's promotion rules differ from torch's, and half-precision maths runs in
float32 and is rounded back, as torch's kernels do. Captured tensors become pointer + stride
parameters; their loads are masked with ``q_ok`` / ``kv_ok`` according to which indices the offset
depends on, so padded rows and columns never read out of bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from flexcore.errors import ModError, ModReturnError, UnsupportedOpError

_TL = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16",
    torch.int32: "tl.int32", torch.int64: "tl.int64", torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}
_INDEX_ARGS = {"b": "b", "h": "h", "q_idx": "q", "kv_idx": "kv"}


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
class View:
    """A captured tensor with some leading dimensions indexed, the rest still whole."""

    cap: int
    dtype: torch.dtype
    shape: tuple
    index: tuple  # per dimension: a Val, or None while the dimension is still whole
    node: Node = field(default=None, repr=False)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _float_literal(value: float) -> str:
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
        text = _float_literal(float(value))
        return text if dtype == torch.float32 else f"tl.full([], {text}, {_TL[dtype]})"
    value = int(value)
    if dtype == torch.int32 and -2**31 <= value < 2**31:
        return str(value) if value >= 0 else f"({value})"
    return f"tl.full([], {value}, {_TL[dtype]})"


def _convert_const(value, dtype: torch.dtype):
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
    return f"{expr}.to({_TL[dtype]})"


class ModCodegen:
    """Walks one traced graph and emits the body of the generated function."""

    _UNARY_FLOAT = {
        "exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})", "log2": "tl.log2({})",
        "log10": "(tl.log({}) * 0.4342944819032518)", "sqrt": "tl.sqrt({})",
        "rsqrt": "tl.rsqrt({})", "sigmoid": "tl.sigmoid({})", "tanh": "fl_tanh({})",
        "sin": "tl.sin({})", "cos": "tl.cos({})", "erf": "tl.erf({})", "expm1": "fl_expm1({})",
        "log1p": "fl_log1p({})", "reciprocal": "(1.0 / {})",
    }
    # With fast_math (float16/bfloat16 inputs, float32 scores) these replace _UNARY_FLOAT's entries.
    _UNARY_FAST = {"tanh": "fl_tanh_approx({})"}
    _COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}

    def __init__(self, gm: GraphModule, kind: str, name: str, score_dtype: torch.dtype = torch.float32,
                 fast_math: bool = False):
        self.gm = gm
        self.fast_math = fast_math
        self.score_dtype = score_dtype
        self.kind = kind
        self.name = name
        self.prefix = "sm" if kind == "score" else "mm"
        self.lines: list[str] = []
        self.env: dict[Node, object] = {}
        self.captured: list[torch.Tensor] = []
        self._cap_ids: dict[int, int] = {}
        self._counter = 0
        self._node: Node | None = None

    # ---------------------------------------------------------------- helpers
    def _fresh(self) -> str:
        self._counter += 1
        return f"v{self._counter}"

    def _emit(self, expr: str) -> str:
        name = self._fresh()
        self.lines.append(f"    {name} = {expr}")
        return name

    def _loc(self, node: Node | None):
        meta = node.meta.get("flex_loc") if node is not None else None
        return meta if meta else (None, None, None)

    def _error(self, cls, message: str, op: str | None = None, node: Node | None = None):
        filename, lineno, shown = self._loc(node or self._node)
        return cls(message, mod_name=self.name, filename=filename, lineno=lineno, op=op or shown)

    def _out_dtype(self, node: Node) -> torch.dtype:
        val = node.meta.get("val")
        if val is None:
            raise self._error(ModError, f"no type information for {node.target}")
        if val.dim() != 0:
            raise self._error(
                ModError, f"{self._loc(node)[2] or node.target} produces a tensor of shape "
                f"{tuple(val.shape)} per position; mods must compute one value per position "
                "(index every dimension of captured tensors before computing with them).")
        if val.dtype not in _TL:
            raise self._error(ModError, f"dtype {val.dtype} is not supported in mods")
        return val.dtype

    def cast(self, v: Val, dtype: torch.dtype) -> str:
        if v.dtype == dtype and not v.pyscalar:
            return v.expr
        if v.const is not None:
            return literal(_convert_const(v.const, dtype), dtype)
        if v.dtype == dtype:
            return v.expr
        return cast_expr(v.expr, dtype)

    def _capture(self, tensor: torch.Tensor) -> int:
        key = id(tensor)
        if key not in self._cap_ids:
            if tensor.dtype not in _TL:
                raise self._error(ModError, f"captured tensor of dtype {tensor.dtype} is not "
                                  f"supported; use one of {sorted(str(d) for d in _TL)}")
            if tensor.dim() > 4:
                raise self._error(ModError, f"captured tensor of shape {tuple(tensor.shape)} has "
                                  "more than 4 dimensions; reshape it to at most 4")
            if tensor.is_complex() or tensor.is_sparse:
                raise self._error(ModError, "complex and sparse captured tensors are not supported")
            self._cap_ids[key] = len(self.captured)
            self.captured.append(tensor)
        return self._cap_ids[key]

    def value(self, arg) -> Val:
        """The Val of an argument: a node's value (loading a fully indexed view) or a constant."""
        if isinstance(arg, Node):
            v = self.env[arg]
            if isinstance(v, View):
                v = self._load(v)
                self.env[arg] = v
            return v
        if isinstance(arg, bool):
            return Val(literal(arg, torch.bool), torch.bool, const=arg, pyscalar=True, nonneg=True)
        if isinstance(arg, int):
            return Val(str(arg), torch.int64, const=arg, pyscalar=True, nonneg=arg >= 0)
        if isinstance(arg, float):
            return Val(_float_literal(arg), torch.float32, const=arg, pyscalar=True,
                       nonneg=arg >= 0)
        raise self._error(ModError, f"unsupported argument {arg!r} to {self._loc(self._node)[2]}")

    def _dummy(self, v: Val):
        """A stand-in for torch.result_type: Python scalars stay weak, tensors are 0-d."""
        if v.pyscalar:
            return v.const
        return torch.zeros((), dtype=v.dtype)

    def _promote(self, a: Val, b: Val) -> torch.dtype:
        return torch.result_type(self._dummy(a), self._dummy(b))

    def offset_terms(self, p: str, shape: tuple, index, node=None) -> tuple[list[str], frozenset]:
        """Offset terms (``"i * {p}_s{d}"``) of the element ``index`` of a captured tensor of
        ``shape`` whose strides are ``{p}_s{d}``, and the index arguments they depend on.

        ``None`` entries are size-1 dimensions read at 0; negative indices wrap as in torch.
        """
        terms, deps = [], frozenset()
        for d, idx in enumerate(index):
            if idx is None:
                continue
            deps |= idx.deps
            if idx.const is not None:
                c = int(idx.const)
                if not -shape[d] <= c < shape[d]:
                    raise self._error(
                        ModError, f"index {c} is out of range for dimension {d} (size "
                        f"{shape[d]}) of a captured tensor of shape {shape}", node=node)
                if c < 0:
                    c += shape[d]
                if c:
                    terms.append(f"{c} * {p}_s{d}")
                continue
            expr = idx.expr
            if not idx.nonneg:
                # Negative indices wrap around, as torch's indexing does.
                expr = self._emit(f"tl.where({expr} < 0, {expr} + {shape[d]}, {expr})")
            terms.append(f"{expr} * {p}_s{d}")
        return terms, deps

    def _load(self, view: View) -> Val:
        for d, (size, idx) in enumerate(zip(view.shape, view.index)):
            if idx is None and size != 1:
                shape = tuple(s for s, i in zip(view.shape, view.index) if i is None)
                raise self._error(
                    ModError, f"a captured tensor of shape {view.shape} is used with shape "
                    f"{shape} left after indexing; index every dimension (e.g. t[h, q_idx]) so "
                    "that each position reads one element", node=view.node)
        p = f"{self.prefix}_c{view.cap}"
        terms, deps = self.offset_terms(p, view.shape, view.index, view.node)
        ptr = f"{p}_ptr" + "".join(f" + {t}" for t in terms)
        masks = []
        if "q" in deps or "score" in deps:
            masks.append("q_ok")
        if "kv" in deps or "score" in deps:
            masks.append("kv_ok")
        if masks:
            expr = self._emit(f"tl.load({ptr}, mask={' & '.join(masks)}, other=0)")
        else:
            expr = self._emit(f"tl.load({ptr})")
        return Val(expr, view.dtype, deps)

    # ---------------------------------------------------------------- driver
    def run(self) -> tuple[str, bool]:
        """Emit the body; returns (return expression, is_trivial)."""
        args = iter(("score", "b", "h", "q_idx", "kv_idx") if self.kind == "score"
                    else ("b", "h", "q_idx", "kv_idx"))
        result = None
        for node in self.gm.graph.nodes:
            self._node = node
            if node.op == "placeholder":
                arg = next(args)
                if arg == "score":
                    self.env[node] = Val("score", self.score_dtype, frozenset({"score"}))
                else:
                    self.env[node] = Val(arg, torch.int32, frozenset({_INDEX_ARGS[arg]}),
                                         nonneg=True)
            elif node.op == "get_attr":
                self.env[node] = self._get_attr(node)
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "output":
                result = node.args[0]
            else:
                raise self._error(ModError, f"unexpected graph node {node.op} {node.target}")
        return self._finish(result)

    def _finish(self, result) -> tuple[str, bool]:
        self._node = None
        if not isinstance(result, Node):
            raise ModReturnError("the mod must return a tensor", mod_name=self.name)
        v = self.value(result)
        if self.kind == "score":
            if v.dtype == torch.bool:
                raise ModReturnError("a score_mod must return a float tensor, not bool",
                                     mod_name=self.name)
            trivial = v.expr == "score" and v.const is None
            if v.const is not None:  # a 0-d tensor, not a constexpr: callers broadcast it
                return f"tl.full([], {_float_literal(float(v.const))}, {_TL[self.score_dtype]})", False
            return self.cast(v, self.score_dtype), trivial
        if v.dtype != torch.bool:
            raise ModReturnError(f"a mask_mod must return a bool tensor, not {v.dtype}",
                                 mod_name=self.name)
        if v.const is not None:
            return literal(bool(v.const), torch.bool), bool(v.const)
        return v.expr, False

    def _get_attr(self, node: Node):
        tensor = getattr(self.gm, node.target)
        users = list(node.users)
        is_literal = users and all(
            u.op == "call_function" and u.target == torch.ops.aten.lift_fresh_copy.default
            for u in users)
        if is_literal and tensor.dim() == 0:
            # torch.tensor(<number>) written inside the mod: a constant, not a capture.
            value = tensor.item()
            return Val(literal(value, tensor.dtype), tensor.dtype, const=value,
                       nonneg=bool(value >= 0))
        cap = self._capture(tensor)
        return View(cap, tensor.dtype, tuple(tensor.shape), (None,) * tensor.dim(), node)

    # ---------------------------------------------------------------- ops
    def _fold(self, node: Node):
        """Evaluate an op whose inputs are all trace-time constants (None if it is not one)."""
        if node.target == torch.ops.aten.index.Tensor:
            return None
        args = []
        for a in node.args:
            if isinstance(a, Node):
                v = self.env[a]
                if not isinstance(v, Val) or v.const is None:
                    return None
                a = torch.tensor(v.const, dtype=v.dtype)
            elif isinstance(a, (list, tuple)) and any(isinstance(x, Node) for x in a):
                return None
            args.append(a)
        if not any(isinstance(a, Node) for a in node.args):
            return None  # creation ops (full, scalar_tensor) have their own handlers
        try:
            out = node.target(*args, **node.kwargs)
        except Exception:  # noqa: BLE001 - fall back to emitting the op
            return None
        if not isinstance(out, torch.Tensor) or out.dim() != 0 or out.dtype not in _TL:
            return None
        return self._const_result(out.item(), out.dtype)

    def _call(self, node: Node):
        folded = self._fold(node)
        if folded is not None:
            return folded
        target = node.target
        packet = getattr(target, "overloadpacket", None)
        name = packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
        handler = getattr(self, f"_op_{name}", None)
        if handler is None:
            handler = self._generic(name)
        if handler is None:
            shown = self._loc(node)[2]
            what = f"{shown} ({target})" if shown else f"{target}"
            raise self._error(
                UnsupportedOpError, f"{what} has no Triton lowering in flexlab. Supported: "
                "+ - * / // % **, comparisons, &, |, ^, ~, torch.where, abs, exp, exp2, log, log2, "
                "sqrt, rsqrt, tanh, sigmoid, sin, cos, erf, expm1, log1p, minimum, maximum, clamp, "
                "floor, ceil, round, trunc, sign, isnan, isinf, masked_fill, <<, >>, casts, and "
                "indexing captured tensors.",
                op=shown or str(target))
        return handler(node)

    def _generic(self, name: str):
        if name in self._UNARY_FLOAT:
            fast = self.fast_math and self.score_dtype == torch.float32
            template = (self._UNARY_FAST if fast else {}).get(name, self._UNARY_FLOAT[name])
            return lambda node: self._unary_float(node, template)
        if name in self._COMPARE:
            return lambda node: self._compare(node, self._COMPARE[name])
        return None

    def _args(self, node: Node) -> list[Val]:
        return [self.value(a) for a in node.args]

    def _result(self, expr: str, dtype: torch.dtype, deps, nonneg: bool = False) -> Val:
        return Val(self._emit(expr), dtype, frozenset(deps), nonneg=nonneg)

    @staticmethod
    def _deps(*vals: Val) -> frozenset:
        out = frozenset()
        for v in vals:
            out |= v.deps
        return out

    def _const_result(self, value, dtype: torch.dtype) -> Val:
        value = _convert_const(value, dtype)
        return Val(literal(value, dtype), dtype, const=value, nonneg=bool(value >= 0))

    def _finish_op(self, expr: str, compute: torch.dtype, out: torch.dtype, deps,
                   nonneg: bool = False) -> Val:
        if compute != out:
            expr = cast_expr(f"({expr})", out)
        return self._result(expr, out, deps, nonneg)

    # arithmetic ------------------------------------------------------------
    def _arith(self, node: Node, op: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else None)
        out = self._out_dtype(node)
        if out == torch.bool:
            bool_op = {"+": "|", "*": "&"}.get(op)
            if bool_op is None or alpha not in (None, 1):
                raise self._error(UnsupportedOpError, f"'{op}' on bool tensors is not supported")
            return self._result(f"{self.cast(a, out)} {bool_op} {self.cast(b, out)}", out,
                                self._deps(a, b), nonneg=True)
        compute = _opmath(out)
        ea, eb = self.cast(a, compute), self.cast(b, compute)
        if alpha not in (None, 1):
            eb = f"({eb} * {literal(alpha, compute)})"
        nonneg = a.nonneg and b.nonneg and op in "+*" and alpha in (None, 1)
        return self._finish_op(f"{ea} {op} {eb}", compute, out, self._deps(a, b), nonneg)

    def _op_add(self, node):
        return self._arith(node, "+")

    def _op_sub(self, node):
        return self._arith(node, "-")

    def _op_mul(self, node):
        return self._arith(node, "*")

    def _op_rsub(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = _opmath(out)
        alpha = node.kwargs.get("alpha", 1)
        ea = self.cast(a, compute) if alpha == 1 else f"({self.cast(a, compute)} * {alpha})"
        return self._finish_op(f"{self.cast(b, compute)} - {ea}", compute, out,
                               self._deps(a, b))

    def _op_div(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        mode = node.kwargs.get("rounding_mode")
        out = self._out_dtype(node)
        compute = _opmath(out)
        ea, eb = self.cast(a, compute), self.cast(b, compute)
        deps = self._deps(a, b)
        if mode is None:
            return self._finish_op(f"{ea} / {eb}", compute, out, deps)
        nonneg = a.nonneg and b.nonneg
        if mode == "floor":
            fn = "fl_div_floor_float" if compute.is_floating_point else "fl_div_floor_int"
            return self._finish_op(f"{fn}({ea}, {eb})", compute, out, deps, nonneg)
        if compute.is_floating_point:
            return self._finish_op(f"fl_trunc({ea} / {eb})", compute, out, deps, nonneg)
        return self._finish_op(f"fl_div_trunc_int({ea}, {eb})", compute, out, deps, nonneg)

    def _op_floor_divide(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = _opmath(out)
        fn = "fl_div_floor_float" if compute.is_floating_point else "fl_div_floor_int"
        return self._finish_op(f"{fn}({self.cast(a, compute)}, {self.cast(b, compute)})", compute,
                               out, self._deps(a, b), a.nonneg and b.nonneg)

    def _op_remainder(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = _opmath(out)
        fn = "fl_remainder_float" if compute.is_floating_point else "fl_remainder_int"
        return self._finish_op(f"{fn}({self.cast(a, compute)}, {self.cast(b, compute)})", compute,
                               out, self._deps(a, b), b.nonneg)

    def _op_fmod(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = _opmath(out)
        ea, eb = self.cast(a, compute), self.cast(b, compute)
        if compute.is_floating_point:
            expr = f"{ea} % {eb}"
        else:
            expr = f"{ea} - fl_div_trunc_int({ea}, {eb}) * {eb}"
        return self._finish_op(expr, compute, out, self._deps(a, b), a.nonneg)

    def _op_neg(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        compute = _opmath(out)
        return self._finish_op(f"-{self.cast(a, compute)}", compute, out, a.deps)

    def _op_abs(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        if out == torch.bool:
            return self._result(a.expr, out, a.deps, True)
        compute = _opmath(out)
        return self._finish_op(f"tl.abs({self.cast(a, compute)})", compute, out, a.deps, True)

    def _op_sign(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        if out == torch.bool:
            return self._result(a.expr, out, a.deps, True)
        compute = _opmath(out)
        return self._finish_op(f"fl_sign({self.cast(a, compute)})", compute, out, a.deps)

    def _unary_float(self, node: Node, pattern: str) -> Val:
        (a,) = self._args(node)
        out = self._out_dtype(node)
        compute = _opmath(out)
        return self._finish_op(pattern.format(self.cast(a, compute)), compute, out, a.deps)

    def _rounding(self, node: Node, pattern: str) -> Val:
        a = self.value(node.args[0])
        if node.kwargs.get("decimals", 0) or len(node.args) > 1:
            raise self._error(UnsupportedOpError, "round(decimals=...) is not supported",
                              op=str(node.target))
        out = self._out_dtype(node)
        if not out.is_floating_point:
            return Val(self.cast(a, out), out, a.deps, a.const, nonneg=a.nonneg)
        compute = _opmath(out)
        return self._finish_op(pattern.format(self.cast(a, compute)), compute, out, a.deps,
                               a.nonneg)

    def _op_floor(self, node):
        return self._rounding(node, "tl.floor({})")

    def _op_ceil(self, node):
        return self._rounding(node, "tl.ceil({})")

    def _op_round(self, node):
        return self._rounding(node, "fl_round_half_even({})")

    def _op_trunc(self, node):
        return self._rounding(node, "fl_trunc({})")

    def _op_relu(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        compute = _opmath(out)
        return self._finish_op(f"tl.maximum({self.cast(a, compute)}, {literal(0, compute)})",
                               compute, out, a.deps, True)

    def _op_pow(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = _opmath(out)
        deps = self._deps(a, b)
        ea = self.cast(a, compute)
        if b.const is not None and float(b.const) == int(b.const) and 0 <= int(b.const) <= 8:
            n = int(b.const)
            if n == 0:  # x ** 0 == 1 even for NaN and inf
                return self._const_result(1, out)
            x = self._emit(ea) if n > 1 else ea
            return self._finish_op(" * ".join([x] * n), compute, out, deps,
                                   a.nonneg or n % 2 == 0)
        if compute.is_floating_point:
            if b.const is not None and float(b.const) == 0.5:
                return self._finish_op(f"tl.sqrt({ea})", compute, out, deps, True)
            if a.const is not None and float(a.const) == 2.0:
                return self._finish_op(f"tl.exp2({self.cast(b, compute)})", compute, out, deps,
                                       True)
            return self._finish_op(f"fl_pow_float({ea}, {self.cast(b, compute)})", compute, out,
                                   deps)
        return self._finish_op(f"fl_pow_int({ea}, {self.cast(b, compute)})", compute, out, deps)

    # min / max / clamp ------------------------------------------------------
    def _minmax(self, fn: str, x: str, y: str, dtype: torch.dtype) -> str:
        if dtype.is_floating_point:
            return f"tl.{fn}({x}, {y}, propagate_nan=tl.PropagateNan.ALL)"
        return f"tl.{fn}({x}, {y})"

    def _op_minimum(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = _opmath(out)
        return self._finish_op(self._minmax("minimum", self.cast(a, compute),
                                            self.cast(b, compute), compute),
                               compute, out, self._deps(a, b), a.nonneg and b.nonneg)

    def _op_maximum(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = _opmath(out)
        return self._finish_op(self._minmax("maximum", self.cast(a, compute),
                                            self.cast(b, compute), compute),
                               compute, out, self._deps(a, b), a.nonneg or b.nonneg)

    def _clamp(self, node, lo, hi) -> Val:
        x = self.value(node.args[0])
        out = self._out_dtype(node)
        compute = _opmath(out)
        expr, deps, nonneg = self.cast(x, compute), x.deps, x.nonneg
        if lo is not None:
            lo = self.value(lo)
            expr = self._minmax("maximum", expr, self.cast(lo, compute), compute)
            deps |= lo.deps
            nonneg = nonneg or lo.nonneg
        if hi is not None:
            hi = self.value(hi)
            expr = self._minmax("minimum", expr, self.cast(hi, compute), compute)
            deps |= hi.deps
        return self._finish_op(expr, compute, out, deps, nonneg)

    def _op_clamp(self, node):
        args = list(node.args) + [None] * 3
        lo = node.kwargs.get("min", args[1])
        hi = node.kwargs.get("max", args[2])
        return self._clamp(node, lo, hi)

    def _op_clamp_min(self, node):
        return self._clamp(node, node.args[1], None)

    def _op_clamp_max(self, node):
        return self._clamp(node, None, node.args[1])

    # comparisons and logic ----------------------------------------------------
    def _compare(self, node: Node, op: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        compute = _opmath(self._promote(a, b))
        return self._result(f"{self.cast(a, compute)} {op} {self.cast(b, compute)}", torch.bool,
                            self._deps(a, b), True)

    def _logical(self, node, op: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        expr = f"{self.cast(a, torch.bool)} {op} {self.cast(b, torch.bool)}"
        return self._finish_op(expr, torch.bool, out, self._deps(a, b), True)

    def _op_logical_and(self, node):
        return self._logical(node, "&")

    def _op_logical_or(self, node):
        return self._logical(node, "|")

    def _op_logical_xor(self, node):
        return self._logical(node, "^")

    def _op_logical_not(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        return self._finish_op(f"{self.cast(a, torch.bool)} == 0", torch.bool, out, a.deps, True)

    def _bitwise(self, node, op: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        if out.is_floating_point:
            raise self._error(UnsupportedOpError, f"bitwise '{op}' on floats is not supported")
        return self._result(f"{self.cast(a, out)} {op} {self.cast(b, out)}", out,
                            self._deps(a, b), out == torch.bool or (a.nonneg and b.nonneg))

    def _op_bitwise_and(self, node):
        return self._bitwise(node, "&")

    def _op_bitwise_or(self, node):
        return self._bitwise(node, "|")

    def _op_bitwise_xor(self, node):
        return self._bitwise(node, "^")

    def _op_bitwise_not(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        if out == torch.bool:
            return self._result(f"{self.cast(a, out)} == 0", out, a.deps, True)
        return self._result(f"~{self.cast(a, out)}", out, a.deps)

    def _shift(self, node, op: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        if out.is_floating_point or out == torch.bool:
            raise self._error(UnsupportedOpError, f"shift '{op}' needs integer tensors")
        return self._result(f"{self.cast(a, out)} {op} {self.cast(b, out)}", out,
                            self._deps(a, b), a.nonneg and op == ">>")

    def _op___lshift__(self, node):
        return self._shift(node, "<<")

    def _op___rshift__(self, node):
        return self._shift(node, ">>")

    _op_bitwise_left_shift = _op___lshift__
    _op_bitwise_right_shift = _op___rshift__

    def _op_where(self, node):
        c, a, b = (self.value(x) for x in node.args)
        out = self._out_dtype(node)
        expr = f"tl.where({self.cast(c, torch.bool)}, {self.cast(a, out)}, {self.cast(b, out)})"
        return self._result(expr, out, self._deps(c, a, b), a.nonneg and b.nonneg)

    def _op_masked_fill(self, node):
        x, m, fill = (self.value(a) for a in node.args)
        out = self._out_dtype(node)
        expr = (f"tl.where({self.cast(m, torch.bool)}, {self.cast(fill, out)}, "
                f"{self.cast(x, out)})")
        return self._result(expr, out, self._deps(x, m, fill), x.nonneg and fill.nonneg)

    def _op_isnan(self, node):
        (a,) = self._args(node)
        if not a.dtype.is_floating_point:
            return self._const_result(False, torch.bool)
        return self._result(f"{a.expr} != {a.expr}", torch.bool, a.deps, True)

    def _op_isinf(self, node):
        (a,) = self._args(node)
        if not a.dtype.is_floating_point:
            return self._const_result(False, torch.bool)
        x = self.cast(a, _opmath(a.dtype))
        return self._result(f"tl.abs({x}) == float(\"inf\")", torch.bool, a.deps, True)

    # casts, copies, constants ----------------------------------------------
    def _op__to_copy(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        if a.const is not None:
            return self._const_result(a.const, out)
        if out == a.dtype:
            return a
        return Val(self._emit(self.cast(a, out)), out, a.deps,
                   nonneg=a.nonneg or out == torch.bool)

    def _identity(self, node):
        v = self.env[node.args[0]]
        return v

    _op_clone = _identity
    _op_alias = _identity
    _op_detach = _identity
    _op_lift_fresh_copy = _identity

    def _constant(self, node, value):
        out = self._out_dtype(node)
        return self._const_result(value, out)

    def _op_scalar_tensor(self, node):
        return self._constant(node, node.args[0])

    def _op_full(self, node):
        return self._constant(node, node.args[1])

    def _op_full_like(self, node):
        return self._constant(node, node.args[1])

    def _op_zeros_like(self, node):
        return self._constant(node, 0)

    def _op_ones_like(self, node):
        return self._constant(node, 1)

    def _op_zeros(self, node):
        return self._constant(node, 0)

    def _op_ones(self, node):
        return self._constant(node, 1)

    def _op_new_zeros(self, node):
        return self._constant(node, 0)

    def _op_new_ones(self, node):
        return self._constant(node, 1)

    def _op_new_full(self, node):
        return self._constant(node, node.args[2])

    # indexing ------------------------------------------------------------------
    def _op_index(self, node):
        base = self.env[node.args[0]]
        if not isinstance(base, View):
            raise self._error(
                ModError, "only captured tensors can be indexed; a value computed inside the mod "
                "is already one number per position")
        indices = list(node.args[1])
        free = [d for d, i in enumerate(base.index) if i is None]
        if len(indices) > len(free):
            raise self._error(
                ModError, f"too many indices ({len(indices)}) for a captured tensor of shape "
                f"{base.shape} with {len(free)} dimension(s) left to index")
        new_index = list(base.index)
        for d, idx in zip(free, indices):
            if idx is None:
                continue
            v = self.value(idx)
            if v.dtype == torch.bool or v.dtype.is_floating_point:
                raise self._error(ModError, f"index of dtype {v.dtype} is not supported; "
                                  "use integer indices")
            new_index[d] = v
        return View(base.cap, base.dtype, base.shape, tuple(new_index), node)


def generate(gm: GraphModule, kind: str, name: str, score_dtype: torch.dtype = torch.float32,
             fast_math: bool = False):
    """Source of the ``@triton.jit`` function for one traced mod.

    ``fast_math`` (float16/bfloat16 inputs) lets transcendental ops use the GPU's approximate
    instructions where their error is far below the inputs' rounding (tanh).

    Returns:
        (source, cap_params, captured, is_trivial)
    """
    gen = ModCodegen(gm, kind, name, score_dtype, fast_math)
    ret, trivial = gen.run()
    prefix = gen.prefix
    cap_params: list[str] = []
    for i, t in enumerate(gen.captured):
        cap_params.append(f"{prefix}_c{i}_ptr")
        cap_params.extend(f"{prefix}_c{i}_s{d}" for d in range(t.dim()))
    if kind == "score":
        fn_name = "score_mod_fn"
        params = ["score", "b", "h", "q_idx", "kv_idx", "q_ok", "kv_ok"]
    else:
        fn_name = "mask_mod_fn"
        params = ["b", "h", "q_idx", "kv_idx", "q_ok", "kv_ok"]
    header = f"@triton.jit\ndef {fn_name}({', '.join(params + cap_params)}):\n"
    body = "\n".join(gen.lines)
    source = header + (body + "\n" if body else "") + f"    return {ret}\n"
    return source, tuple(cap_params), tuple(gen.captured), trivial
