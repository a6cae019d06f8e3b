"""Lower a score_mod's vector-Jacobian product into a ``@triton.jit`` function for the backward.

The mod is traced once (:func:`flexcore.lowering.trace.trace_mod`), its captured tensors that
require grad are made explicit inputs, and ``torch.func.vjp`` of that function is traced again with
``make_fx``: no derivative is written by hand. The resulting aten graph is emitted by the forward's
code generator (:class:`flexcore.lowering.codegen.ModCodegen`), extended with two things:

- the gradient placeholder ``grad`` (d loss / d modified score) and a tuple output;
- ``index_put(zeros, idx, values, accumulate=True)`` (the backward of reading ``t[idx]``) and sums of
  them, which become masked atomic adds into a gradient buffer at the same offsets. The backward
  of nested subscripts (``t[i][j]``), of views of a captured tensor (``t.T``, ``t[None]``,
  ``t.view(-1)``, slices, expand) and of index tensors per position moves those indices to the
  captured tensor's own dimensions; a scattered sum that turns out to be an ordinary small value
  (the backward of indexing a per-position vector) is added up element by element.

Generated signature::

    score_mod_bwd_fn(score, b, h, q_idx, kv_idx, q_ok, kv_ok, grad, valid,
                     WRITE_CAPTURED_GRADS: tl.constexpr, FIXED_POINT_GRADS: tl.constexpr,
                     <forward cap params>, <grad params: sm_g{i}_ptr, sm_g{i}_s0, ...>)

returning d loss / d score (float32, or ``score_dtype``). ``valid`` is a bool tile (positions kept
by the mask and inside both sequences); only those add into the gradient buffers.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from flexcore.errors import ModError, UnsupportedOpError
from flexcore.lowering import codegen as _codegen
from flexcore.lowering.cache import LRUCache, guard_key
from flexcore.lowering.shapes import flat_nodes
from flexcore.lowering.trace import (decompositions, mod_name, saved_tensor_hooks_set_aside,
                                     stand_in_device, stand_ins, trace_mod)
from flexcore.lowering.values import Lanes, Val, literal, opmath

FN_NAME = "score_mod_bwd_fn"
_PARAMS = ["score", "b", "h", "q_idx", "kv_idx", "q_ok", "kv_ok", "grad", "valid",
           "WRITE_CAPTURED_GRADS: tl.constexpr", "FIXED_POINT_GRADS: tl.constexpr"]

# Add gradient contributions; in fixed point the int64 sums are the same in any order.
_ACCUMULATE_SOURCE = '''
@triton.jit
def _sm_grad_fixed_point(vals):
    # (integer part, fraction * 2**32 rounded): two int64 words per element of the buffer (see
    # flexcore.kernels.backward), so that no realistic sum wraps. A magnitude past 2**62 is
    # clamped there, and the host reads such a word as an infinity.
    v = vals.to(tl.float64)
    whole = tl.floor(v)
    fraction = tl.floor((v - whole) * 4294967296.0 + 0.5)
    whole = tl.minimum(tl.maximum(whole, -4.611686018427388e18), 4.611686018427388e18)
    return whole.to(tl.int64), fraction.to(tl.int64)


@triton.jit
def _sm_grad_accumulate(ptrs, vals, mask, FIXED_POINT_GRADS: tl.constexpr):
    if FIXED_POINT_GRADS:
        whole, fraction = _sm_grad_fixed_point(vals)
        tl.atomic_add(ptrs, whole, mask=mask)
        tl.atomic_add(ptrs + 1, fraction, mask=mask)
    else:
        tl.atomic_add(ptrs, vals, mask=mask)


@triton.jit
def _sm_grad_accumulate_one(ptr, val, FIXED_POINT_GRADS: tl.constexpr):
    if FIXED_POINT_GRADS:
        whole, fraction = _sm_grad_fixed_point(val)
        tl.atomic_add(ptr, whole)
        tl.atomic_add(ptr + 1, fraction)
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
    """A captured tensor's gradient (or the gradient of a view of it): a sum of scattered
    contributions. Each term is ``(indices, value)``: per dimension a scalar index (Val) or None
    for the whole dimension, and the value added there: a Val, or Lanes over the whole
    dimensions in order (broadcast as torch's index_put broadcasts)."""

    shape: tuple
    dtype: torch.dtype
    terms: list


def _const(c: int) -> Val:
    return Val(str(c), torch.int64, const=c, nonneg=True)


class _VjpCodegen(_codegen.ModCodegen):
    """ModCodegen over the VJP graph: a ``grad`` input, scatter-adds, and a tuple output."""

    def __init__(self, gm: GraphModule, name: str, captured, detached_of: dict[int, torch.Tensor],
                 score_dtype: torch.dtype, fast_math: bool = False):
        super().__init__(gm, "score", name, fast_math=fast_math)
        self._detached_of = detached_of
        self.score_dtype = score_dtype
        for t in captured:  # the forward's order, so that the parameter names match the forward's
            self._capture(t)

    def _capture(self, tensor):
        return super()._capture(self._detached_of.get(id(tensor), tensor))

    def _placeholder(self, arg: str) -> Val:
        if arg == "grad":
            # grad varies with both indices: loads that depend on it need both masks.
            return Val(arg, self.score_dtype, frozenset({"score"}))
        return super()._placeholder(arg)

    def run(self):
        result = self._walk(("score", "b", "h", "q_idx", "kv_idx", "grad"))
        self._node = None
        return result

    def _unsupported(self, what: str):
        return self._error(UnsupportedOpError, f"{what} in the gradient of a captured tensor is "
                           "not supported; index the tensor with one subscript per dimension "
                           "(t[i, j]) or detach it")

    # A zero tensor with a shape may start a gradient: kept symbolic until its use shows which.
    def _constant(self, node, value):
        val = node.meta.get("val")
        if val is not None and val.dim() != 0 and value == 0:
            return _GradSum(tuple(val.shape), val.dtype, [])
        return super()._constant(node, value)

    def _dense(self, gs: "_GradSum"):
        """A scattered sum used as an ordinary value (the backward of indexing a small per-position
        tensor): every element adds the terms whose indices reach it."""
        self.check_lanes(gs.shape)
        vals = []
        for coord in itertools.product(*(range(s) for s in gs.shape)):
            acc = self._const_result(0, gs.dtype)
            for indices, value in gs.terms:
                whole = [k for k, i in enumerate(indices) if i is None]
                lanes = self._expand_lanes(value, tuple(gs.shape[k] for k in whole))
                v = lanes.at(tuple(coord[k] for k in whole))
                conds = []
                skip = False
                for k, i in enumerate(indices):
                    if i is None:
                        continue
                    if i.const is not None:
                        skip = skip or int(i.const) % gs.shape[k] != coord[k]
                        continue
                    x = i.expr if i.nonneg else self._emit(
                        f"tl.where({i.expr} < 0, {i.expr} + {gs.shape[k]}, {i.expr})")
                    conds.append(f"({x} == {coord[k]})")
                if skip:
                    continue
                term = self.cast(v, gs.dtype)
                if conds:
                    term = self._emit(f"tl.where({' & '.join(conds)}, {term}, 0)")
                acc = Val(self._emit(f"{self.cast(acc, gs.dtype)} + {term}"), gs.dtype,
                          acc.deps | v.deps | frozenset().union(*(i.deps for i in indices if i)))
            vals.append(acc)
        return self.lanes_or_val(gs.shape, vals)

    def _lane_args(self, node):
        args = flat_nodes(node.args)
        held = [self.env.get(a) for a in args]
        sums = [v for v in held if isinstance(v, _GradSum)]
        if self.op_name(node) == "add" and len(sums) == 2 and len(held) == 2:
            return {}  # two gradients summed: _op_add keeps them scattered
        found = {}
        for arg, v in zip(args, held):
            if isinstance(v, _GradSum):  # a scattered sum that turns out to be an ordinary value
                found[arg] = self.env[arg] = self._dense(v)
        found.update(super()._lane_args(node))
        return {a: v for a, v in found.items() if isinstance(v, Lanes)}

    def held(self, arg):
        v = super().held(arg)
        return self._dense(v) if isinstance(v, _GradSum) else v

    def _op_index_put(self, node):
        base = self.env.get(node.args[0])
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if not isinstance(base, _GradSum) or not accumulate:
            raise self._error(UnsupportedOpError, "index_put outside a captured tensor's gradient "
                              "is not supported")
        indices = [None if i is None else self._index_value(i) for i in node.args[1]]
        indices += [None] * (len(base.shape) - len(indices))
        if any(isinstance(i, Lanes) for i in indices):
            return self._index_put_advanced(node, base, indices)
        values = self.env.get(node.args[2]) if isinstance(node.args[2], Node) else None
        if not isinstance(values, _GradSum):
            values = self.held(node.args[2])
        if isinstance(values, _GradSum):
            # The gradient of t[i] was scattered into t[i]'s shape: place it at i (t[i][j]).
            terms = []
            for inner, value in values.terms:
                inner = iter(inner)
                terms.append(([next(inner) if i is None else i for i in indices], value))
            return _GradSum(base.shape, base.dtype, base.terms + terms)
        if not isinstance(values, (Val, Lanes)):
            values = self.as_lanes(values)
        return _GradSum(base.shape, base.dtype, base.terms + [(indices, values)])

    _op_index_put_ = _op_index_put

    def _index_put_advanced(self, node, base, indices):
        """index_put with index tensors per position (t[q_idx.unsqueeze(0)], index_select): one
        term per element of the broadcast index shape."""
        adv = [k for k, i in enumerate(indices) if i is not None]
        if adv != list(range(adv[0], adv[-1] + 1)):
            raise self._unsupported("indexing non-adjacent dimensions with index tensors")
        bshape = tuple(torch.broadcast_shapes(*(self.shape_of(indices[k]) for k in adv)))
        before = [base.shape[k] for k in range(adv[0])]
        after = [base.shape[k] for k in range(adv[-1] + 1, len(base.shape))]
        shape = tuple(before) + bshape + tuple(after)
        values = self.env.get(node.args[2]) if isinstance(node.args[2], Node) else None
        if isinstance(values, _GradSum):
            return self._compose_advanced(base, indices, values, len(before), bshape)
        values = self.held(node.args[2])
        lanes = self._expand_lanes(values, shape)
        terms = []
        for bc in itertools.product(*(range(s) for s in bshape)):
            scalar = [None if i is None else (i.at_broadcast(bc, bshape) if isinstance(i, Lanes)
                                              else i) for i in indices]
            whole = tuple(before) + tuple(after)
            vals = [lanes.at(tuple(c[:len(before)]) + bc + tuple(c[len(before):]))
                    for c in itertools.product(*(range(s) for s in whole))]
            terms.append((scalar, self.lanes_or_val(whole, vals)))
        return _GradSum(base.shape, base.dtype, base.terms + terms)

    def _compose_advanced(self, base, indices, inner: "_GradSum", nbefore: int, bshape):
        """index_put(zeros, indices with index tensors, gradient of the indexed value): each term
        of the inner gradient lands at the outer indices its position in ``bshape`` selects."""
        nb = len(bshape)
        terms = []
        for idx, value in inner.terms:
            bpart = idx[nbefore:nbefore + nb]
            rest = list(idx[:nbefore]) + list(idx[nbefore + nb:])
            if any(i is not None and i.const is None for i in bpart):
                raise self._unsupported("a gradient scattered through index tensors twice")
            whole = [k for k, i in enumerate(idx) if i is None]
            lanes = self._expand_lanes(value, tuple(inner.shape[k] for k in whole))
            free = [j for j, i in enumerate(bpart) if i is None]
            for fc in itertools.product(*(range(bshape[j]) for j in free)):
                bc = [int(i.const) if i is not None else 0 for i in bpart]
                for j, c in zip(free, fc):
                    bc[j] = c
                scalar = [None if i is None else (i.at_broadcast(tuple(bc), bshape)
                                                  if isinstance(i, Lanes) else i) for i in indices]
                rest_iter = iter(rest)
                new = [next(rest_iter) if i is None else i for i in scalar]
                # lanes over the inner whole dims, fixed at the chosen bshape coordinate
                keep = [k for k in whole if not nbefore <= k < nbefore + nb]
                vals = []
                for c in itertools.product(*(range(inner.shape[k]) for k in keep)):
                    full = dict(zip(keep, c))
                    for j in free:
                        full[nbefore + j] = bc[j]
                    vals.append(lanes.at(tuple(full[k] for k in whole)))
                terms.append((new, self.lanes_or_val(tuple(inner.shape[k] for k in keep), vals)))
        return _GradSum(base.shape, base.dtype, base.terms + terms)

    def _op_slice_scatter(self, node):
        kw = self._kw(node)
        src = self.env.get(kw["src"])
        if not isinstance(src, _GradSum):
            return super()._op_slice_scatter(node)
        base = self.env.get(kw["input"])
        dim = kw["dim"] % len(base.shape)
        picked = range(base.shape[dim])[slice(kw["start"], kw["end"], kw["step"] or 1)]
        terms = []
        for indices, value in src.terms:
            i = indices[dim]
            if i is None:  # a whole dimension of the slice: one term per element
                whole = [k for k, x in enumerate(indices) if x is None]
                lanes = self._expand_lanes(value, tuple(src.shape[k] for k in whole))
                pos = whole.index(dim)
                for j in range(src.shape[dim]):
                    sub = [c for c in itertools.product(*(range(src.shape[k]) for k in whole))
                           if c[pos] == j]
                    new = list(indices)
                    new[dim] = _const(picked[j])
                    rest = tuple(src.shape[k] for k in whole if k != dim)
                    terms.append((new, self.lanes_or_val(rest, [lanes.at(c) for c in sub])))
                continue
            new = list(indices)
            if i.const is not None:
                new[dim] = _const(picked[int(i.const) % len(picked)])
            else:
                expr = i.expr if i.nonneg else self._emit(
                    f"tl.where({i.expr} < 0, {i.expr} + {len(picked)}, {i.expr})")
                new[dim] = Val(self._emit(f"{picked.start} + {expr} * {picked.step}"), i.dtype,
                               i.deps, nonneg=True)
            terms.append((new, value))
        return _GradSum(base.shape, base.dtype, base.terms + terms)

    def _op_select_scatter(self, node):
        kw = self._kw(node)
        src = self.env.get(kw["src"])
        if not isinstance(src, _GradSum):
            return super()._op_select_scatter(node)
        base = self.env.get(kw["input"])
        dim = kw["dim"] % len(base.shape)
        i = _const(kw["index"] % base.shape[dim])
        terms = [(list(idx[:dim]) + [i] + list(idx[dim:]), v) for idx, v in src.terms]
        return _GradSum(base.shape, base.dtype, base.terms + terms)

    def _op_sgn(self, node):  # the derivative of abs; sgn is sign for real tensors
        return self._op_sign(node)

    def _op_add(self, node):
        a, b = (self.env.get(x) if isinstance(x, Node) else None for x in node.args[:2])
        if isinstance(a, _GradSum) or isinstance(b, _GradSum):
            alpha = node.kwargs.get("alpha", 1)
            if not (isinstance(a, _GradSum) and isinstance(b, _GradSum)) or alpha != 1:
                raise self._error(UnsupportedOpError, "this combination of captured-tensor "
                                  "gradients is not supported")
            return _GradSum(a.shape, a.dtype, a.terms + b.terms)
        return super()._op_add(node)

    # Views of a gradient buffer: the backward of views of a captured tensor (t.T, t.unsqueeze,
    # t[None], expand) moves the scattered indices to the captured tensor's dimensions.
    @staticmethod
    def _regrid(gs: "_GradSum", shape, move):
        """A GradSum of ``shape`` whose term indices are ``move(indices)``."""
        return _GradSum(tuple(shape), gs.dtype, [(move(list(i)), v) for i, v in gs.terms])

    def _gs_arg(self, node):
        v = self.env.get(node.args[0]) if isinstance(node.args[0], Node) else None
        return v if isinstance(v, _GradSum) else None

    def _op_permute(self, node):
        gs = self._gs_arg(node)
        if gs is None:
            return super()._op_permute(node)
        perm = [d % len(gs.shape) for d in node.args[1]]
        return self._permute_gs(node, gs, perm)

    def _permute_gs(self, node, gs, perm):
        for indices, _ in gs.terms:
            whole = [p for p in perm if indices[p] is None]
            if whole != sorted(whole):
                raise self._unsupported("transposing whole dimensions")
        return self._regrid(gs, [gs.shape[p] for p in perm],
                            lambda idx: [idx[p] for p in perm])

    def _op_transpose(self, node):
        gs = self._gs_arg(node)
        if gs is None:
            return super()._op_transpose(node)
        perm = list(range(len(gs.shape)))
        a, b = node.args[1] % len(gs.shape), node.args[2] % len(gs.shape)
        perm[a], perm[b] = perm[b], perm[a]
        return self._permute_gs(node, gs, perm)

    def _op_t(self, node):
        gs = self._gs_arg(node)
        if gs is None:
            return super()._op_t(node)
        return self._permute_gs(node, gs, [1, 0] if len(gs.shape) == 2 else [0])

    def _op_unsqueeze(self, node):
        gs = self._gs_arg(node)
        if gs is None:
            return super()._op_unsqueeze(node)
        d = node.args[1] % (len(gs.shape) + 1)
        shape = list(gs.shape)
        shape.insert(d, 1)
        return self._regrid(gs, shape, lambda idx: idx[:d] + [_const(0)] + idx[d:])

    def _op_squeeze(self, node):
        gs = self._gs_arg(node)
        if gs is None:
            return super()._op_squeeze(node)
        drop = {d for d in self._squeeze_dims(node, len(gs.shape)) if gs.shape[d] == 1}
        return self._drop_dims(node, gs, drop, keep=False)

    def _drop_dims(self, node, gs, drop, keep: bool):
        """Sum a GradSum over the dimensions ``drop`` (the backward of expand and unsqueeze)."""
        shape = [1 if k in drop else s for k, s in enumerate(gs.shape) if keep or k not in drop]
        terms = []
        for indices, value in gs.terms:
            whole = [k for k, i in enumerate(indices) if i is None]
            pos = [j for j, k in enumerate(whole) if k in drop]
            if pos:
                lanes = self._expand_lanes(value, tuple(gs.shape[k] for k in whole))
                out_shape, groups = self._groups(lanes, pos, keepdim=keep)
                value = self.lanes_or_val(out_shape, [self._sum_vals(g) for g in groups])
            new = []
            for k, i in enumerate(indices):
                if k not in drop:
                    new.append(i)
                elif keep:
                    new.append(None if i is None else _const(0))
            terms.append((new, value))
        return _GradSum(tuple(shape), gs.dtype, terms)

    def _expand_lanes(self, value, shape) -> Lanes:
        lanes = self.as_lanes(value)
        if tuple(lanes.shape) == tuple(shape):
            return lanes
        self.check_lanes(shape)
        return Lanes(tuple(shape), [lanes.at_broadcast(c, shape)
                                    for c in itertools.product(*(range(s) for s in shape))])

    def _sum_vals(self, vals):
        compute = opmath(vals[0].dtype)
        acc, deps = self._fold_vals(vals, compute, lambda a, b: f"{a} + {b}")
        return Val(self._emit(acc), compute, deps)

    def _op_sum(self, node):
        gs = self._gs_arg(node)
        if gs is None:
            return super()._op_sum(node)
        dim, keepdim = self._dim_args(node)
        drop = set(self._reduce_dims(dim, len(gs.shape)))
        return self._drop_dims(node, gs, drop, keep=keepdim)

    def _op_view(self, node):
        gs = self._gs_arg(node)
        if gs is None:
            return super()._op_view(node)
        target = self._target_shape(node)
        if [s for s in gs.shape if s != 1] != [s for s in target if s != 1]:
            return self._reshape_gs(gs, target)
        # Only size-1 dimensions come and go: drop them all, then insert the new ones.
        squeezed = self._drop_dims(node, gs, {k for k, s in enumerate(gs.shape) if s == 1},
                                   keep=False)
        out = squeezed
        for k, s in enumerate(target):
            if s == 1:
                shape = list(out.shape)
                shape.insert(k, 1)
                out = self._regrid(out, shape,
                                   lambda idx, k=k: idx[:k] + [_const(0)] + idx[k:])
        return out

    _op__unsafe_view = _op_reshape = _op_view

    def _reshape_gs(self, gs: "_GradSum", target) -> "_GradSum":
        """The gradient of a reshaped captured tensor (``t.view(-1)[i]``): each scattered index
        moves to the same row-major position in the tensor's own shape."""
        terms = []
        for indices, value in gs.terms:
            whole = [k for k, i in enumerate(indices) if i is None]
            lanes = self._expand_lanes(value, tuple(gs.shape[k] for k in whole))
            for coord in itertools.product(*(range(gs.shape[k]) for k in whole)):
                full = list(indices)
                for k, c in zip(whole, coord):
                    full[k] = _const(c)
                linear = self.linear_index(full, gs.shape)
                terms.append((self.unravel(linear, target), lanes.at(coord)))
        return _GradSum(tuple(target), gs.dtype, terms)

    def emit_accumulate(self, grad, cap: int, shape: tuple, dtype: torch.dtype) -> None:
        """Emit the atomic adds of one captured tensor's gradient (an output node) into ``sm_g{cap}``."""
        p = f"sm_g{cap}"
        found = self.env.get(grad) if isinstance(grad, Node) else None
        if isinstance(found, _GradSum):
            terms = found.terms
        elif shape and isinstance(found, Lanes) and tuple(found.shape) == tuple(shape):
            # A captured tensor read whole (``(w * score).sum()``): one lane per element.
            terms = [([None] * len(shape), found)]
        else:  # a 0-d captured tensor: its gradient is an ordinary per-position value
            terms = [([], self.value(grad))]
        for indices, value in terms:
            whole = [d for d, i in enumerate(indices) if i is None]
            whole_shape = tuple(shape[d] for d in whole)
            lanes = self._expand_lanes(value, whole_shape)
            for coord in itertools.product(*(range(s) for s in whole_shape)):
                full = list(indices)
                for d, c in zip(whole, coord):
                    full[d] = _const(c)
                self._accumulate_one(p, shape, full, lanes.at(coord), dtype)

    def _accumulate_one(self, p: str, shape, indices, value: Val, dtype: torch.dtype) -> None:
        offset, deps = self.offset_terms(p, shape, indices)
        off = " + ".join(offset) if offset else "0"
        vals = self.cast(value, torch.float64 if dtype == torch.float64 else torch.float32)
        self.lines.append("    if WRITE_CAPTURED_GRADS:")
        if not ({"q", "kv", "score"} & deps):
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

    # The forward's stand-ins and grad on one device: an autograd graph over two devices runs on
    # two engine threads at once, which share the trace's fake-tensor mode.
    device = stand_in_device(gm)
    args = stand_ins("score", score_dtype, device) + [torch.zeros((), dtype=score_dtype, device=device)]
    # Backward formulas such as tanh_backward become the pointwise ops the code generator knows.
    decomps = core_aten_decompositions()
    table = {op: fn for op, fn in decomps.items()
             if "backward" in str(op) or str(op).startswith("aten.where")}
    table.update(decompositions())
    # functionalize: derivative formulas use in-place ops (mask.logical_and_(...)) on temporaries.
    with saved_tensor_hooks_set_aside():
        graph = make_fx(torch.func.functionalize(bwd), tracing_mode="fake", _allow_non_fake_inputs=True,
                        decomposition_table=table)(*args)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph, {id(d): t for d, t in zip(detached, grad_caps)}


def lower_score_mod_backward(fn, forward=None, score_dtype: torch.dtype = torch.float32,
                             fast_math: bool = False) -> LoweredScoreBackward:
    """Lower the vector-Jacobian product of ``fn`` (a score_mod) to ``score_mod_bwd_fn``.

    The backward kernel recomputes the forward (``score_mod_fn``) and then calls
    ``score_mod_bwd_fn`` on the same score, so the two are lowered alike: the derivative's copy of
    the forward's ops (the tanh of a softcap) is then the same instruction on the same operands,
    and Triton's common-subexpression elimination computes it once.

    Args:
        fn: the score_mod, or None (identity).
        forward: the forward's LoweredMod of ``fn``; its ``captured`` order fixes the parameter
            names and its ``fast_math`` the lowering of transcendental ops. Traced here when not
            given.
        score_dtype: dtype of the score and gradient tiles (float32; float64 for float64 inputs).
        fast_math: as :func:`flexcore.lowering.lower_score_mod`'s, where ``forward`` is not given.

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
        _, cap_params, captured, trivial = _codegen.generate(gm, "score", name, score_dtype, fast_math)
    else:
        cap_params, captured, trivial = tuple(forward.cap_params), tuple(forward.captured), forward.is_trivial
        fast_math = forward.fast_math
    if trivial:
        return _trivial(captured, cap_params)
    requires = tuple(bool(t.requires_grad and t.is_floating_point()) for t in captured)
    key = None
    if guard is not None:
        key = (guard[0], tuple(id(t) for t in captured), requires, score_dtype, fast_math)
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

    gen = _VjpCodegen(graph, name, captured, detached_of, score_dtype, fast_math)
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
        ret = (f"tl.zeros_like(grad) + {literal(float(v.const), score_dtype)}"
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
