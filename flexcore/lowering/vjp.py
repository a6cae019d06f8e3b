"""Lower a score_mod's vector-Jacobian product into a ``@triton.jit`` function for the backward.

The mod is traced once (:func:`flexcore.lowering.trace.trace_mod`), its captured tensors that
require grad are made explicit inputs, and ``torch.func.vjp`` of that function is traced again with
``make_fx``: no derivative is written by hand. The resulting aten graph is emitted by the forward's
code generator (:class:`flexcore.lowering.codegen.ModCodegen`), extended with two things:

- the gradient placeholder ``grad`` (d loss / d modified score) and a tuple output;
- ``index_put(zeros, idx, values, accumulate=True)`` (the backward of reading ``t[idx]``) and sums of
  them, which become masked atomic adds into a gradient buffer at the same offsets.

Generated signature::

    score_mod_bwd_fn(score, b, h, q_idx, kv_idx, q_ok, kv_ok, grad, valid,
                     WRITE_CAPTURED_GRADS: tl.constexpr, FIXED_POINT_GRADS: tl.constexpr,
                     <forward cap params>, <grad params: sm_g{i}_ptr, sm_g{i}_s0, ...>)

returning d loss / d score (float32, or ``score_dtype``). ``valid`` is a bool tile (positions kept
by the mask and inside both sequences); only those add into the gradient buffers.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from flexcore.errors import ModError, UnsupportedOpError
from flexcore.lowering import codegen as _codegen
from flexcore.lowering.cache import LRUCache, guard_key
from flexcore.lowering.trace import mod_name, trace_mod

FN_NAME = "score_mod_bwd_fn"
_PARAMS = ["score", "b", "h", "q_idx", "kv_idx", "q_ok", "kv_ok", "grad", "valid",
           "WRITE_CAPTURED_GRADS: tl.constexpr", "FIXED_POINT_GRADS: tl.constexpr"]

# Add gradient contributions; in fixed point the int64 sum is the same in any order.
_ACCUMULATE_SOURCE = '''
@triton.jit
def _sm_grad_fixed_point(vals):
    # vals * 2**32 rounded to nearest, clamped into int64 (see flexcore.kernels.backward).
    scaled = vals.to(tl.float64) * 4294967296.0
    scaled = tl.minimum(tl.maximum(scaled, -9.2e18), 9.2e18)
    return tl.floor(scaled + 0.5).to(tl.int64)


@triton.jit
def _sm_grad_accumulate(ptrs, vals, mask, FIXED_POINT_GRADS: tl.constexpr):
    if FIXED_POINT_GRADS:
        tl.atomic_add(ptrs, _sm_grad_fixed_point(vals), mask=mask)
    else:
        tl.atomic_add(ptrs, vals, mask=mask)


@triton.jit
def _sm_grad_accumulate_one(ptr, val, FIXED_POINT_GRADS: tl.constexpr):
    if FIXED_POINT_GRADS:
        tl.atomic_add(ptr, _sm_grad_fixed_point(val))
    else:
        tl.atomic_add(ptr, val)
'''


@dataclass(frozen=True)
class LoweredScoreBackward:
    """The lowered VJP of a score_mod (the fields of flexcore's LoweredMod, plus gradient buffers).

    Attributes:
        source: ``@triton.jit`` source of ``score_mod_bwd_fn`` and its helper.
        cap_params: the forward score_mod's captured-tensor parameters (same names and order).
        captured: the forward's captured tensors (same order as the forward's LoweredMod).
        grad_params: gradient-buffer parameters, e.g. ``("sm_g0_ptr", "sm_g0_s0")``.
        grad_of: indices into ``captured`` of the tensors that get a gradient buffer.
    """

    kind: str
    fn_name: str
    source: str
    cap_params: tuple
    captured: tuple
    grad_params: tuple
    grad_of: tuple
    key: str
    is_trivial: bool
    _pins: tuple = field(default=(), repr=False, compare=False)

    def kernel_args(self) -> list:
        out = []
        for t in self.captured:
            out.append(t)
            out.extend(t.stride())
        return out


@dataclass
class _GradSum:
    """A captured tensor's gradient: a sum of scattered contributions ``(index Vals, value Val)``."""

    shape: tuple
    terms: list


class _VjpCodegen(_codegen.ModCodegen):
    """ModCodegen over the VJP graph: a ``grad`` input, scatter-adds, and a tuple output."""

    def __init__(self, gm: GraphModule, name: str, captured, detached_of: dict[int, torch.Tensor],
                 score_dtype: torch.dtype):
        super().__init__(gm, "score", name)
        self._detached_of = detached_of
        self.score_dtype = score_dtype
        for t in captured:  # the forward's order, so that the parameter names match the forward's
            self._capture(t)

    def _capture(self, tensor):
        return super()._capture(self._detached_of.get(id(tensor), tensor))

    def run(self):
        names = iter(("score", "b", "h", "q_idx", "kv_idx", "grad"))
        result = None
        for node in self.gm.graph.nodes:
            self._node = node
            if node.op == "placeholder":
                arg = next(names)
                if arg in ("score", "grad"):
                    # grad varies with both indices: loads that depend on it need both masks.
                    self.env[node] = _codegen.Val(arg, self.score_dtype, frozenset({"score"}))
                else:
                    self.env[node] = _codegen.Val(arg, torch.int32,
                                                  frozenset({_codegen._INDEX_ARGS[arg]}), nonneg=True)
            elif node.op == "get_attr":
                self.env[node] = self._get_attr(node)
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "output":
                result = node.args[0]
        self._node = None
        return result

    # A zero tensor of the captured tensor's shape starts a gradient; 0-d constants stay constants.
    def _constant(self, node, value):
        val = node.meta.get("val")
        if val is not None and val.dim() != 0:
            if value != 0:
                raise self._error(UnsupportedOpError, f"a constant tensor of shape {tuple(val.shape)} "
                                  "in the score_mod's gradient is not supported")
            return _GradSum(tuple(val.shape), [])
        return super()._constant(node, value)

    def _op_index_put(self, node):
        base = self.env[node.args[0]]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if not isinstance(base, _GradSum) or not accumulate:
            raise self._error(UnsupportedOpError, "index_put outside a captured tensor's gradient "
                              "is not supported")
        indices = [None if i is None else self.value(i) for i in node.args[1]]
        value = self.value(node.args[2])
        return _GradSum(base.shape, base.terms + [(indices, value)])

    _op_index_put_ = _op_index_put

    def _op_sgn(self, node):  # the derivative of abs; sgn is sign for real tensors
        return self._op_sign(node)

    def _op_add(self, node):
        a, b = (self.env.get(x) if isinstance(x, Node) else None for x in node.args[:2])
        if isinstance(a, _GradSum) or isinstance(b, _GradSum):
            alpha = node.kwargs.get("alpha", 1)
            if not (isinstance(a, _GradSum) and isinstance(b, _GradSum)) or alpha != 1:
                raise self._error(UnsupportedOpError, "this combination of captured-tensor "
                                  "gradients is not supported")
            return _GradSum(a.shape, a.terms + b.terms)
        return super()._op_add(node)

    def _op_index(self, node):
        if isinstance(self.env.get(node.args[0]), _GradSum):
            raise self._error(UnsupportedOpError, "a captured tensor that requires grad is indexed in "
                              "several steps (t[i][j]); index it in one subscript, t[i, j]")
        return super()._op_index(node)

    def emit_accumulate(self, grad, cap: int, shape: tuple, dtype: torch.dtype) -> None:
        """Emit the atomic adds of one captured tensor's gradient (an output node) into ``sm_g{cap}``."""
        p = f"sm_g{cap}"
        found = self.env.get(grad) if isinstance(grad, Node) else None
        if isinstance(found, _GradSum):
            terms = found.terms
        else:  # a 0-d captured tensor: its gradient is an ordinary per-position value
            terms = [([], self.value(grad))]
        for indices, value in terms:
            for d, idx in enumerate(indices):
                if idx is None and shape[d] != 1:
                    raise self._error(ModError, f"gradient over a whole dimension of a captured "
                                      f"tensor of shape {shape}; index every dimension")
            offset, deps = self.offset_terms(p, shape, indices)
            off = " + ".join(offset) if offset else "0"
            vals = self.cast(value, torch.float64 if dtype == torch.float64 else torch.float32)
            self.lines.append("    if WRITE_CAPTURED_GRADS:")
            if not ({"q", "kv"} & deps):
                # One address per tile (the index depends on b and h only): reduce, then one add.
                total = f"tl.sum(tl.sum(tl.where(valid, {vals}, 0.0), 1), 0)"
                self.lines.append(f"        _sm_grad_accumulate_one({p}_ptr + {off}, {total}, "
                                  "FIXED_POINT_GRADS)")
            else:
                self.lines.append(
                    f"        _sm_grad_accumulate({p}_ptr + tl.where(valid, {off}, 0), "
                    f"tl.where(valid, {vals}, 0.0), valid, FIXED_POINT_GRADS)")


_cache = LRUCache(128)


def _trivial(captured=(), cap_params=()) -> LoweredScoreBackward:
    params = _PARAMS + list(cap_params)
    source = f"@triton.jit\ndef {FN_NAME}({', '.join(params)}):\n    return grad\n" + _ACCUMULATE_SOURCE
    return LoweredScoreBackward("score_bwd", FN_NAME, source, tuple(cap_params), tuple(captured), (),
                                (), hashlib.sha256(source.encode()).hexdigest()[:16], True)


def _vjp_graph(gm: GraphModule, grad_caps: list[torch.Tensor], score_dtype: torch.dtype):
    """make_fx graph of (score, b, h, q_idx, kv_idx, grad) -> (d score, *d grad_caps)."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    detached = [t.detach() for t in grad_caps]
    index_of = {id(t): i for i, t in enumerate(grad_caps)}

    class _Substitute(torch.fx.Interpreter):
        def __init__(self, primals):
            super().__init__(gm)
            self.primals = primals

        def get_attr(self, target, args, kwargs):
            t = super().get_attr(target, args, kwargs)
            i = index_of.get(id(t))
            return t if i is None else self.primals[i]

    def bwd(score, b, h, q_idx, kv_idx, grad):
        def fwd(s, *caps):
            return _Substitute(caps).run(s, b, h, q_idx, kv_idx)

        _, vjp_fn = torch.func.vjp(fwd, score, *detached)
        return vjp_fn(grad)

    args = [torch.zeros((), dtype=score_dtype)] + [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    args.append(torch.zeros((), dtype=score_dtype))
    # Backward formulas such as tanh_backward become the pointwise ops the code generator knows.
    decomps = core_aten_decompositions()
    table = {op: fn for op, fn in decomps.items()
             if "backward" in str(op) or str(op).startswith("aten.where")}
    # functionalize: derivative formulas use in-place ops (mask.logical_and_(...)) on temporaries.
    graph = make_fx(torch.func.functionalize(bwd), tracing_mode="fake", _allow_non_fake_inputs=True,
                    decomposition_table=table)(*args)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph, {id(d): t for d, t in zip(detached, grad_caps)}


def lower_score_mod_backward(fn, forward=None, score_dtype: torch.dtype = torch.float32
                             ) -> LoweredScoreBackward:
    """Lower the vector-Jacobian product of ``fn`` (a score_mod) to ``score_mod_bwd_fn``.

    Args:
        fn: the score_mod, or None (identity).
        forward: the forward's LoweredMod of ``fn``; its ``captured`` order fixes the parameter
            names. Traced here when not given.
        score_dtype: dtype of the score and gradient tiles (float32; float64 for float64 inputs).

    Returns:
        LoweredScoreBackward. Captured floating-point tensors with ``requires_grad`` get gradient
        buffers (``grad_of``); the others are read only.

    Raises:
        ModError (UnsupportedOpError, ...) naming the mod and, where known, its line.
    """
    if fn is None:
        return _trivial()
    name = mod_name(fn)
    guard = guard_key(fn)
    gm = None
    if forward is None:
        gm = trace_mod(fn, "score")
        _, cap_params, captured, trivial = _codegen.generate(gm, "score", name)
    else:
        cap_params, captured, trivial = tuple(forward.cap_params), tuple(forward.captured), forward.is_trivial
    if trivial:
        return _trivial(captured, cap_params)
    requires = tuple(bool(t.requires_grad and t.is_floating_point()) for t in captured)
    key = None
    if guard is not None:
        key = (guard[0], tuple(id(t) for t in captured), requires, score_dtype)
        hit = _cache.get(key)
        if hit is not None:
            return hit
    if gm is None:
        gm = trace_mod(fn, "score")
    grad_of = tuple(i for i, r in enumerate(requires) if r)
    try:
        graph, detached_of = _vjp_graph(gm, [captured[i] for i in grad_of], score_dtype)
    except ModError:
        raise
    except Exception as e:  # noqa: BLE001 - report any tracing failure against the user's mod
        raise ModError(f"could not trace the gradient of the score_mod ({type(e).__name__}: {e})",
                       mod_name=name) from e

    gen = _VjpCodegen(graph, name, captured, detached_of, score_dtype)
    outputs = gen.run()
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 1 + len(grad_of):
        raise ModError("unexpected gradient graph output", mod_name=name)
    if len(gen.captured) != len(captured):
        raise ModError("the gradient of the score_mod reads tensors that the forward does not",
                       mod_name=name)
    grad_params = []
    for i in grad_of:
        shape = tuple(captured[i].shape)
        gen.emit_accumulate(outputs[1 + grad_of.index(i)], i, shape, captured[i].dtype)
        grad_params.append(f"sm_g{i}_ptr")
        grad_params.extend(f"sm_g{i}_s{d}" for d in range(len(shape)))

    dscore = outputs[0]
    if isinstance(dscore, Node):
        v = gen.value(dscore)
        ret = (f"tl.zeros_like(grad) + {_codegen.literal(float(v.const), score_dtype)}"
               if v.const is not None else gen.cast(v, score_dtype))
    else:
        ret = "tl.zeros_like(grad)"
    params = _PARAMS + list(cap_params) + grad_params
    body = "\n".join(gen.lines)
    source = (f"@triton.jit\ndef {FN_NAME}({', '.join(params)}):\n" + (body + "\n" if body else "")
              + f"    return {ret}\n" + _ACCUMULATE_SOURCE)
    lowered = LoweredScoreBackward("score_bwd", FN_NAME, source, tuple(cap_params), tuple(captured),
                                   tuple(grad_params), grad_of,
                                   hashlib.sha256(source.encode()).hexdigest()[:16], False,
                                   tuple(guard[1]) if guard is not None else ())
    if key is not None:
        _cache.put(key, lowered)
    return lowered
