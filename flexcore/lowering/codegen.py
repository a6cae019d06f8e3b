"""Translate a traced mod's aten graph into the source of one ``@triton.jit`` function.

Every node's result gets the dtype torch computes for it (``node.meta["val"]``): operands are cast
explicitly because Triton's promotion rules differ from torch's, and half-precision maths runs in
float32 and is rounded back, as torch's kernels do. Captured tensors become pointer + stride
parameters; their loads are masked with ``q_ok`` / ``kv_ok`` according to which indices the offset
depends on, so padded rows and columns never read out of bounds.
"""
from __future__ import annotations

import itertools

import torch
from torch.fx import GraphModule, Node

from flexcore.errors import ModError, ModIndexError, ModReturnError, UnsupportedOpError
from flexcore.lowering.shapes import ShapeOps, flat_nodes
from flexcore.lowering.values import (INDEX_ARGS, MAX_LANES, TL_TYPES, Lanes, ReshapedView, Val, View,
                                      cast_expr, convert_const, float_literal, literal, opmath)

def _may_wrap(dtype: torch.dtype) -> bool:
    """Whether a sum or product of non-negative values of ``dtype`` can wrap around to a negative
    one at sizes a mod meets (int32 and narrower signed ints: ``q_idx * 100_000_000`` does), so
    that its sign is not known and a negative index's wrap-around must stay."""
    if dtype.is_floating_point or dtype == torch.bool:
        return False
    info = torch.iinfo(dtype)
    return info.min < 0 and info.bits <= 32


def _unsigned(dtype: torch.dtype) -> bool:
    return dtype == torch.bool or (not dtype.is_floating_point and torch.iinfo(dtype).min == 0)


def _holds(dst: torch.dtype, src: torch.dtype) -> bool:
    """Whether a cast to ``dst`` keeps a non-negative ``src`` value non-negative: floats do, and
    ints that hold the whole of an int ``src`` (a float, or an int64 narrowed to int32, may wrap
    around to a negative value)."""
    if dst.is_floating_point or dst == torch.bool or src == torch.bool:
        return True
    if src.is_floating_point:
        return False
    wide, narrow = torch.iinfo(dst), torch.iinfo(src)
    return wide.min <= narrow.min and narrow.max <= wide.max


_RANDOM = "random numbers differ between evaluations; capture a random tensor instead"
_NO_PORTABLE = "it has no Triton implementation that also runs under the interpreter"
#: Ops with no lowering, and why (the error names the op, the user's line and this reason).
REFUSED = {
    "special_zeta": "it has no Triton implementation (libdevice has none)",
    "igamma": "it has no Triton implementation (libdevice has none)",
    "igammac": "it has no Triton implementation (libdevice has none)",
    "special_erfcx": _NO_PORTABLE, "special_ndtri": _NO_PORTABLE, "special_log_ndtr": _NO_PORTABLE,
    "i0": _NO_PORTABLE, "special_i0e": _NO_PORTABLE, "special_i1": _NO_PORTABLE,
    "special_i1e": _NO_PORTABLE, "special_bessel_j0": _NO_PORTABLE,
    "special_bessel_j1": _NO_PORTABLE, "special_bessel_y0": _NO_PORTABLE,
    "special_bessel_y1": _NO_PORTABLE, "special_modified_bessel_i0": _NO_PORTABLE,
    "nextafter": "it steps floats bit by bit, which flexlab does not lower",
    "rand": _RANDOM, "rand_like": _RANDOM, "randn": _RANDOM, "randn_like": _RANDOM,
    "randint": _RANDOM, "randint_like": _RANDOM, "bernoulli": _RANDOM, "normal": _RANDOM,
    "uniform": _RANDOM, "native_dropout": _RANDOM, "multinomial": _RANDOM,
}


class ModCodegen(ShapeOps):
    """Walks one traced graph and emits the body of the generated function."""

    _UNARY_FLOAT = {
        "exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})", "log2": "tl.log2({})",
        "log10": "(tl.log({}) * 0.4342944819032518)", "sqrt": "tl.sqrt({})",
        "rsqrt": "tl.rsqrt({})", "sigmoid": "tl.sigmoid({})", "tanh": "fl_tanh({})",
        "sin": "tl.sin({})", "cos": "tl.cos({})", "erf": "tl.erf({})", "expm1": "fl_expm1({})",
        "log1p": "fl_log1p({})", "reciprocal": "(1.0 / {})", "tan": "fl_tan({})",
        "asin": "fl_asin({})", "acos": "fl_acos({})", "atan": "fl_atan({})",
        "sinh": "fl_sinh({})", "cosh": "fl_cosh({})", "asinh": "fl_asinh({})",
        "acosh": "fl_acosh({})", "atanh": "fl_atanh({})", "erfc": "fl_erfc({})",
        "erfinv": "fl_erfinv({})", "lgamma": "fl_lgamma({})", "angle": "fl_angle({})",
        "digamma": "fl_digamma({})",
    }
    _BINARY_FLOAT = {"atan2": "fl_atan2({}, {})", "hypot": "fl_hypot({}, {})",
                     "copysign": "fl_copysign({}, {})"}
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
        self._emitted: dict[str, str] = {}  # expression -> the name holding it
        self.env: dict[Node, object] = {}
        self.captured: list[torch.Tensor] = []
        self._cap_ids: dict[int, int] = {}
        self._counter = 0
        self._node: Node | None = None
        # Per-element values of Lanes arguments while an elementwise op runs once per element.
        self._override: dict[Node, Val] = {}

    # ---------------------------------------------------------------- helpers
    def _fresh(self) -> str:
        self._counter += 1
        return f"v{self._counter}"

    def _emit(self, expr: str) -> str:
        # Common subexpressions are emitted once: every expression is pure (loads read captured
        # tensors, which the function never writes) and every name is assigned once.
        name = self._emitted.get(expr)
        if name is None:
            name = self._emitted[expr] = self._fresh()
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
        if isinstance(val, (tuple, list)):
            val = val[0]
        if val is None:
            raise self._error(ModError, f"no type information for {node.target}")
        if val.dtype not in TL_TYPES:
            raise self._error(ModError, f"dtype {val.dtype} is not supported in mods")
        return val.dtype

    def cast(self, v: Val, dtype: torch.dtype) -> str:
        if v.dtype == dtype and not v.pyscalar:
            return v.expr
        if v.const is not None:
            return literal(convert_const(v.const, dtype), dtype)
        if v.dtype == dtype:
            return v.expr
        return cast_expr(v.expr, dtype)

    def bool_operand(self, v: Val) -> str:
        """``v`` as an operand of ``&``, ``|``, ``^``. A value of b and h only is 0-d in most
        kernels, and the interpreter cannot combine a 0-d float comparison with ``&``; ``!= 0``
        turns it into a plain boolean (free on the GPU)."""
        expr = self.cast(v, torch.bool)
        if v.const is None and not (v.deps & {"q", "kv", "score"}):
            return f"({expr} != 0)"
        return expr

    def _capture(self, tensor: torch.Tensor) -> int:
        key = id(tensor)
        if key not in self._cap_ids:
            if tensor.dtype not in TL_TYPES:
                raise self._error(ModError, f"captured tensor of dtype {tensor.dtype} is not "
                                  f"supported; use one of {sorted(str(d) for d in TL_TYPES)}")
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
            if arg in self._override:
                return self._override[arg]
            v = self.env[arg]
            if isinstance(v, View):
                if v.visible():
                    raise self._whole_dims_error(v)
                v = self._load(v)
                self.env[arg] = v
            if not isinstance(v, Val):
                raise self._error(ModError, f"{self._loc(arg)[2] or arg.target} gives a "
                                  f"{type(v).__name__} where one value per position is needed")
            return v
        if isinstance(arg, bool):
            return Val(literal(arg, torch.bool), torch.bool, const=arg, pyscalar=True, nonneg=True)
        if isinstance(arg, int):
            return Val(str(arg), torch.int64, const=arg, pyscalar=True, nonneg=arg >= 0)
        if isinstance(arg, float):
            return Val(float_literal(arg), torch.float32, const=arg, pyscalar=True,
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
                        ModIndexError, f"index {c} is out of range for dimension {d} (size "
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

    def _whole_dims_error(self, view: View) -> ModError:
        shape = tuple(vd.size for vd in view.visible())
        return self._error(
            ModError, f"a captured tensor of shape {view.shape} is used with shape {shape} left "
            f"after indexing, more than the {MAX_LANES} elements a position can hold; index "
            "every dimension (e.g. t[h, q_idx]) so that each position reads one element",
            node=view.node)

    def _load(self, view: View) -> Val:
        """Read the one element a fully indexed view selects."""
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
        return self._finish(self._walk(("score", "b", "h", "q_idx", "kv_idx") if self.kind == "score"
                                       else ("b", "h", "q_idx", "kv_idx")))

    def _placeholder(self, arg: str) -> Val:
        """The value of the graph input named ``arg``."""
        if arg == "score":
            return Val("score", self.score_dtype, frozenset({"score"}))
        return Val(arg, torch.int32, frozenset({INDEX_ARGS[arg]}), nonneg=True)

    def _walk(self, arg_names) -> object:
        """Emit every node of the graph, whose inputs are named ``arg_names`` in order; returns the
        output node's argument."""
        args = iter(arg_names)
        result = None
        for node in self.gm.graph.nodes:
            self._node = node
            if node.op == "placeholder":
                self.env[node] = self._placeholder(next(args))
            elif node.op == "get_attr":
                self.env[node] = self._get_attr(node)
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "output":
                result = node.args[0]
            else:
                raise self._error(ModError, f"unexpected graph node {node.op} {node.target}")
        return result

    def _finish(self, result) -> tuple[str, bool]:
        self._node = None
        if not isinstance(result, Node):
            raise ModReturnError("the mod must return a tensor", mod_name=self.name)
        held = self.env.get(result)
        if isinstance(held, (Lanes, ReshapedView)) or (isinstance(held, View) and held.visible()):
            raise ModReturnError(f"the {self.kind}_mod returns a tensor of shape "
                                 f"{self.shape_of(held)} for one position; it must return a "
                                 "single value (index every dimension of captured tensors)",
                                 mod_name=self.name)
        v = self.value(result)
        if self.kind == "score":
            if v.dtype == torch.bool:
                raise ModReturnError("a score_mod must return a float tensor, not bool",
                                     mod_name=self.name)
            trivial = v.expr == "score" and v.const is None
            if v.const is not None:
                return f"tl.full(score.shape, {float_literal(float(v.const))}, {TL_TYPES[self.score_dtype]})", False
            expr = self.cast(v, self.score_dtype)
            if not ("score" in v.deps or {"q", "kv"} <= v.deps):
                # A value of the row, the column or the head alone: the kernels reduce the tile
                # along both axes, so it takes the tile's shape (free in Triton).
                expr = f"tl.broadcast_to({expr}, score.shape)"
            return expr, trivial
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
                v = self._override.get(a, self.env.get(a))
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
        if not isinstance(out, torch.Tensor) or out.dim() != 0 or out.dtype not in TL_TYPES:
            return None
        return self._const_result(out.item(), out.dtype)

    @staticmethod
    def op_name(node: Node) -> str:
        target = node.target
        packet = getattr(target, "overloadpacket", None)
        return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))

    def _call(self, node: Node):
        name = self.op_name(node)
        handler = getattr(self, f"_op_{name}", None)
        if handler is None:
            handler = self._generic(name)
        if handler is None:
            shown = self._loc(node)[2]
            what = f"{shown} ({node.target})" if shown else f"{node.target}"
            reason = REFUSED.get(name)
            raise self._error(
                UnsupportedOpError, f"{what} has no Triton lowering in flexlab"
                + (f": {reason}." if reason else
                   ". Elementwise torch ops, views of size-1 dimensions, small reductions "
                   "(sum, amax, any, dot, ...) and indexing captured tensors are supported; "
                   "see 'Supported ops' in flexcore/lowering/README.md."),
                op=shown or str(node.target))
        if name in self.STRUCTURAL:
            return handler(node)
        lanes = self._lane_args(node)
        if lanes:
            return self._elementwise_lanes(node, handler, lanes)
        folded = self._fold(node)
        if folded is not None:
            return folded
        return handler(node)

    def _lane_args(self, node: Node) -> dict:
        """The arguments of ``node`` that hold several elements per position (Lanes, or views
        with dimensions left), materialized as Lanes."""
        found = {}
        for arg in flat_nodes(node.args) + flat_nodes(list(node.kwargs.values())):
            v = self.env.get(arg)
            if isinstance(v, ReshapedView) or (isinstance(v, View) and v.visible()):
                v = self.env[arg] = self.materialize(v)
            if isinstance(v, Lanes):
                found[arg] = v
        return found

    def _elementwise_lanes(self, node: Node, handler, lanes: dict):
        """Run an elementwise op once per element of its broadcast Lanes arguments."""
        try:
            shape = tuple(torch.broadcast_shapes(*(tuple(v.shape) for v in lanes.values())))
        except RuntimeError as e:
            raise self._error(ModError, f"shapes do not broadcast: {e}") from None
        self.check_lanes(shape)
        vals = []
        for coord in itertools.product(*(range(s) for s in shape)):
            for arg, v in lanes.items():
                self._override[arg] = v.at_broadcast(coord, shape)
            try:
                vals.append(self._fold(node) or handler(node))
            finally:
                self._override.clear()
        return self.lanes_or_val(shape, vals)

    def _generic(self, name: str):
        if name in self._UNARY_FLOAT:
            fast = self.fast_math and self.score_dtype == torch.float32
            template = (self._UNARY_FAST if fast else {}).get(name, self._UNARY_FLOAT[name])
            return lambda node: self._unary_float(node, template)
        if name in self._BINARY_FLOAT:
            return lambda node: self._binary_float(node, self._BINARY_FLOAT[name])
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
        value = convert_const(value, dtype)
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
            return self._result(f"{self.bool_operand(a)} {bool_op} {self.bool_operand(b)}", out,
                                self._deps(a, b), nonneg=True)
        compute = opmath(out)
        ea, eb = self.cast(a, compute), self.cast(b, compute)
        if alpha not in (None, 1):
            eb = f"({eb} * {literal(alpha, compute)})"
        nonneg = (a.nonneg and b.nonneg and op in "+*" and alpha in (None, 1)
                  and not _may_wrap(compute))
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
        compute = opmath(out)
        alpha = node.kwargs.get("alpha", 1)
        ea = self.cast(a, compute) if alpha == 1 else f"({self.cast(a, compute)} * {alpha})"
        return self._finish_op(f"{self.cast(b, compute)} - {ea}", compute, out,
                               self._deps(a, b))

    def _int_divisor(self, node, b, compute) -> None:
        """ModError on an integer division by a constant zero: torch raises ZeroDivisionError
        there, and a kernel would give an arbitrary value."""
        if not compute.is_floating_point and b.const is not None and b.const == 0:
            raise self._error(ModError, f"integer division by zero in {node.target} (torch raises "
                              "ZeroDivisionError here); divide by a nonzero value", node=node)

    def _division_operands(self, a: Val, b: Val, compute: torch.dtype) -> tuple[str, str, torch.dtype]:
        """Operands of an integer division or remainder and the type it runs in: int8 and int16
        values (constants converted to them first, as torch does) in int32, where the helpers'
        absolute values cannot overflow at -128 or -32768; others in ``compute``."""
        ea, eb = self.cast(a, compute), self.cast(b, compute)
        if _may_wrap(compute) and torch.iinfo(compute).bits < 32:
            return cast_expr(f"({ea})", torch.int32), cast_expr(f"({eb})", torch.int32), torch.int32
        return ea, eb, compute

    def _op_div(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        mode = node.kwargs.get("rounding_mode")
        out = self._out_dtype(node)
        compute = opmath(out)
        if mode is not None:
            self._int_divisor(node, b, compute)
        ea, eb = self.cast(a, compute), self.cast(b, compute)
        deps = self._deps(a, b)
        if mode is None:
            return self._finish_op(f"{ea} / {eb}", compute, out, deps)
        nonneg = a.nonneg and b.nonneg
        if mode == "floor":
            if compute.is_floating_point:
                return self._finish_op(f"fl_div_floor_float({ea}, {eb})", compute, out, deps, nonneg)
            ea, eb, work = self._division_operands(a, b, compute)
            return self._finish_op(f"fl_div_floor_int({ea}, {eb})", work, out, deps, nonneg)
        if compute.is_floating_point:
            return self._finish_op(f"fl_trunc({ea} / {eb})", compute, out, deps, nonneg)
        ea, eb, work = self._division_operands(a, b, compute)
        return self._finish_op(f"fl_div_trunc_int({ea}, {eb})", work, out, deps, nonneg)

    def _op_floor_divide(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        self._int_divisor(node, b, compute)
        fn = "fl_div_floor_float" if compute.is_floating_point else "fl_div_floor_int"
        ea, eb, work = self._division_operands(a, b, compute)
        return self._finish_op(f"{fn}({ea}, {eb})", work, out, self._deps(a, b), a.nonneg and b.nonneg)

    def _op_remainder(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        self._int_divisor(node, b, compute)
        fn = "fl_remainder_float" if compute.is_floating_point else "fl_remainder_int"
        ea, eb, work = self._division_operands(a, b, compute)
        return self._finish_op(f"{fn}({ea}, {eb})", work, out, self._deps(a, b), b.nonneg)

    def _op_fmod(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        self._int_divisor(node, b, compute)
        ea, eb, work = self._division_operands(a, b, compute)
        if compute.is_floating_point:
            expr = f"{ea} % {eb}"
        else:
            expr = f"{ea} - fl_div_trunc_int({ea}, {eb}) * {eb}"
        return self._finish_op(expr, work, out, self._deps(a, b), a.nonneg)

    def _op_neg(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        compute = opmath(out)
        if compute.is_floating_point:  # Triton's -x is 0 - x, which maps +0 to +0 where torch gives -0
            return self._finish_op(f"({self.cast(a, compute)} * -1.0)", compute, out, a.deps)
        return self._finish_op(f"-{self.cast(a, compute)}", compute, out, a.deps)

    def _op_abs(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        if out == torch.bool:
            return self._result(a.expr, out, a.deps, True)
        compute = opmath(out)
        return self._finish_op(f"tl.abs({self.cast(a, compute)})", compute, out, a.deps, True)

    def _op_sign(self, node):
        (a,) = self._args(node)
        out = self._out_dtype(node)
        if out == torch.bool:
            return self._result(a.expr, out, a.deps, True)
        compute = opmath(out)
        return self._finish_op(f"fl_sign({self.cast(a, compute)})", compute, out, a.deps)

    def _unary_float(self, node: Node, pattern: str) -> Val:
        (a,) = self._args(node)
        out = self._out_dtype(node)
        compute = opmath(out)
        return self._finish_op(pattern.format(self.cast(a, compute)), compute, out, a.deps)

    def _rounding(self, node: Node, pattern: str) -> Val:
        a = self.value(node.args[0])
        decimals = node.kwargs.get("decimals", node.args[1] if len(node.args) > 1 else 0)
        out = self._out_dtype(node)
        if not out.is_floating_point:
            return Val(self.cast(a, out), out, a.deps, a.const, nonneg=a.nonneg)
        compute = opmath(out)
        x = self.cast(a, compute)
        if decimals:
            # torch: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for d < 0.
            ten = literal(10.0 ** abs(decimals), compute)
            inner = pattern.format(f"({x} * {ten})" if decimals > 0 else f"({x} / {ten})")
            expr = f"{inner} / {ten}" if decimals > 0 else f"{inner} * {ten}"
            return self._finish_op(expr, compute, out, a.deps, a.nonneg)
        return self._finish_op(pattern.format(x), compute, out, a.deps, a.nonneg)

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
        compute = opmath(out)
        return self._finish_op(f"tl.maximum({self.cast(a, compute)}, {literal(0, compute)})",
                               compute, out, a.deps, True)

    def _op_pow(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        deps = self._deps(a, b)
        ea = self.cast(a, compute)
        if b.const is not None and float(b.const) == int(b.const) and 0 <= int(b.const) <= 8:
            n = int(b.const)
            if n == 0:  # x ** 0 == 1 even for NaN and inf
                return self._const_result(1, out)
            x = self._emit(ea) if n > 1 else ea
            return self._finish_op(" * ".join([x] * n), compute, out, deps,
                                   (a.nonneg or n % 2 == 0) and not _may_wrap(compute))
        if compute.is_floating_point:
            if b.const is not None and float(b.const) == 0.5:
                return self._finish_op(f"tl.sqrt({ea})", compute, out, deps, True)
            if a.const is not None and float(a.const) == 2.0:
                return self._finish_op(f"tl.exp2({self.cast(b, compute)})", compute, out, deps,
                                       True)
            return self._finish_op(f"fl_pow_float({ea}, {self.cast(b, compute)})", compute, out,
                                   deps)
        return self._finish_op(f"fl_pow_int({self.tensor_arg(a, compute)}, {self.cast(b, compute)})",
                               compute, out, deps)

    # min / max / clamp ------------------------------------------------------
    def _minmax(self, fn: str, x: str, y: str, dtype: torch.dtype) -> str:
        if dtype.is_floating_point:
            return f"tl.{fn}({x}, {y}, propagate_nan=tl.PropagateNan.ALL)"
        return f"tl.{fn}({x}, {y})"

    def _op_minimum(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        return self._finish_op(self._minmax("minimum", self.cast(a, compute),
                                            self.cast(b, compute), compute),
                               compute, out, self._deps(a, b), a.nonneg and b.nonneg)

    def _op_maximum(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        return self._finish_op(self._minmax("maximum", self.cast(a, compute),
                                            self.cast(b, compute), compute),
                               compute, out, self._deps(a, b), a.nonneg or b.nonneg)

    def _clamp(self, node, lo, hi) -> Val:
        x = self.value(node.args[0])
        out = self._out_dtype(node)
        compute = opmath(out)
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
        common = self._promote(a, b)
        compute = opmath(common)
        if common in (torch.float16, torch.bfloat16):
            # torch converts both sides to the common dtype first: a constant is rounded to it
            # (f16(0.1) == 0.1 holds, and 1e5 becomes inf), the tensor side is exact in float32.
            a, b = (self._rounded_const(v, common) for v in (a, b))
        return self._result(f"{self.cast(a, compute)} {op} {self.cast(b, compute)}", torch.bool,
                            self._deps(a, b), True)

    @staticmethod
    def _rounded_const(v: Val, dtype: torch.dtype) -> Val:
        """``v``, a constant rounded to ``dtype`` (as float32), else ``v`` itself."""
        if v.const is None or isinstance(v.const, bool):
            return v
        rounded = float(torch.tensor(float(v.const), dtype=dtype))
        return Val(float_literal(rounded), torch.float32, v.deps, const=rounded, pyscalar=v.pyscalar,
                   nonneg=rounded >= 0)

    def _logical(self, node, op: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        expr = f"{self.bool_operand(a)} {op} {self.bool_operand(b)}"
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
        if out == torch.bool:
            return self._result(f"{self.bool_operand(a)} {op} {self.bool_operand(b)}", out,
                                self._deps(a, b), True)
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
        if torch.iinfo(out).min == 0:  # unsigned: all bits flipped, without a -1 of that type
            return self._result(f"{self.cast(a, out)} ^ {literal(torch.iinfo(out).max, out)}", out,
                                a.deps, True)
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
        x = self._emit(self.cast(a, opmath(a.dtype)))  # the interpreter compares bfloat16 bits
        return self._result(f"{x} != {x}", torch.bool, a.deps, True)

    def _op_isinf(self, node):
        (a,) = self._args(node)
        if not a.dtype.is_floating_point:
            return self._const_result(False, torch.bool)
        x = self.cast(a, opmath(a.dtype))
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
                   nonneg=(a.nonneg and _holds(out, a.dtype)) or _unsigned(out))

    # more elementwise ops -------------------------------------------------------
    def tensor_arg(self, v: Val, dtype: torch.dtype) -> str:
        """``v`` as a tensor of ``dtype``: fl_* helpers call tl functions that need tensors."""
        if v.const is not None:
            return f"tl.full([], {literal(convert_const(v.const, dtype), dtype)}, {TL_TYPES[dtype]})" \
                if dtype in (torch.float32, torch.int32) else literal(convert_const(v.const, dtype), dtype)
        return self.cast(v, dtype)

    def _binary_float(self, node: Node, pattern: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        return self._finish_op(pattern.format(self.tensor_arg(a, compute),
                                              self.tensor_arg(b, compute)),
                               compute, out, self._deps(a, b))

    def _fminmax(self, node, fn: str) -> Val:
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        compute = opmath(out)
        ea, eb = self.tensor_arg(a, compute), self.tensor_arg(b, compute)
        expr = (f"fl_{fn}({ea}, {eb})" if compute.is_floating_point
                else f"tl.{'maximum' if fn == 'fmax' else 'minimum'}({ea}, {eb})")
        return self._finish_op(expr, compute, out, self._deps(a, b))

    def _op_fmax(self, node):
        return self._fminmax(node, "fmax")

    def _op_fmin(self, node):
        return self._fminmax(node, "fmin")

    def _op_signbit(self, node):
        (a,) = self._args(node)
        if a.dtype == torch.bool:
            return self._const_result(False, torch.bool)
        if not a.dtype.is_floating_point:
            return self._result(f"{a.expr} < 0", torch.bool, a.deps, True)
        return self._result(f"fl_signbit({self.cast(a, opmath(a.dtype))})", torch.bool, a.deps, True)

    def _op_polygamma(self, node):
        n = node.args[0]
        if n not in (0, 1):
            raise self._error(UnsupportedOpError, f"torch.polygamma({n}, x) has no Triton lowering "
                              "in flexlab: only orders 0 (digamma) and 1 are lowered")
        return self._unary_float_of(node, node.args[1], "fl_digamma({})" if n == 0 else
                                    "fl_trigamma({})")

    def _unary_float_of(self, node: Node, arg, pattern: str) -> Val:
        a = self.value(arg)
        out = self._out_dtype(node)
        compute = opmath(out)
        return self._finish_op(pattern.format(self.cast(a, compute)), compute, out, a.deps)

    def _op_gcd(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        steps = 92 if out == torch.int64 else 46  # Euclid's worst case: consecutive Fibonacci
        return self._result(f"fl_gcd({self.tensor_arg(a, out)}, {self.tensor_arg(b, out)}, "
                            f"{steps})", out,
                            self._deps(a, b), True)

    def _op_lcm(self, node):
        a, b = self.value(node.args[0]), self.value(node.args[1])
        out = self._out_dtype(node)
        steps = 92 if out == torch.int64 else 46
        ea, eb = self.tensor_arg(a, out), self.tensor_arg(b, out)
        g = self._emit(f"fl_gcd({ea}, {eb}, {steps})")
        # |a / gcd * b|, and 0 when both are 0 (gcd 0), as torch computes it.
        expr = f"tl.where({g} == 0, 0, tl.abs({ea} // tl.where({g} == 0, 1, {g}) * {eb}))"
        return self._result(expr, out, self._deps(a, b), True)

def handled_ops() -> frozenset:
    """Names (aten overload packets) of the ops the code generator lowers itself."""
    names = {n[len("_op_"):] for n in dir(ModCodegen) if n.startswith("_op_")}
    names |= set(ModCodegen._UNARY_FLOAT) | set(ModCodegen._BINARY_FLOAT) | set(ModCodegen._COMPARE)
    return frozenset(names)


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
