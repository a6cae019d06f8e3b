"""Ops that change a per-position value's shape: indexing, views, reductions, constants.

A mod sees 0-d index tensors (torch's vmap semantics), so ``table[q_idx]`` is a row,
``q_idx.unsqueeze(0)`` a one-element vector and ``torch.dot(u[q_idx], w[kv_idx])`` a reduction
over a small fixed dimension. Such values are ``Lanes``: one Triton tile per element, at most
``MAX_LANES`` of them. Captured tensors stay lazy ``View``s until an element is read, so
``table[q_idx][kv_idx]`` is one load, and views (transpose, unsqueeze, slices) only change which
element an index reaches.
"""
from __future__ import annotations

import itertools

import torch
from torch.fx import Node
from torch.fx.operator_schemas import normalize_function

from flexcore.errors import ModError, ModIndexError, UnsupportedOpError
from flexcore.lowering.values import (MAX_LANES, Lanes, ReshapedView, Val, VDim, View, literal,
                                      numel, opmath)


def _const(c: int) -> Val:
    return Val(str(c) if c >= 0 else f"({c})", torch.int64, const=c, nonneg=c >= 0)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class ShapeOps:
    """Mixin of :class:`flexcore.lowering.codegen.ModCodegen`: the ops that do not map one
    element to one element. Each handles scalars (Val), Lanes and Views itself."""

    STRUCTURAL = frozenset({
        "index", "index_select", "unsqueeze", "squeeze", "view", "_unsafe_view", "reshape",
        "expand", "permute", "transpose", "t", "numpy_T", "select", "slice", "clone", "alias",
        "detach", "lift_fresh_copy", "cat", "stack", "unbind", "flip", "repeat", "getitem",
        "sum", "mean", "prod", "amax", "amin", "max", "min", "any", "all", "argmax", "argmin",
        "dot", "vdot", "mv", "mm", "scalar_tensor", "full", "full_like", "zeros_like",
        "ones_like", "zeros", "ones", "new_zeros", "new_ones", "new_full", "arange",
        "index_put", "index_put_", "empty", "empty_like", "empty_permuted", "new_empty",
        "squeeze_", "unsqueeze_", "t_", "transpose_", "scatter", "slice_scatter",
        "select_scatter", "cumsum", "cumprod",
    })

    # ------------------------------------------------------------------ values
    def held(self, arg):
        """What an argument holds: a Val, Lanes or View (Python numbers become Vals)."""
        if isinstance(arg, Node):
            if arg in self._override:
                return self._override[arg]
            return self.env[arg]
        return self.value(arg)

    @staticmethod
    def shape_of(v) -> tuple:
        if isinstance(v, Lanes):
            return tuple(v.shape)
        if isinstance(v, View):
            return tuple(vd.size for vd in v.visible())
        if isinstance(v, ReshapedView):
            return tuple(v.shape[len(v.fixed):])
        return ()

    def check_lanes(self, shape) -> None:
        if numel(shape) > MAX_LANES:
            raise self._error(
                UnsupportedOpError, f"a value of shape {tuple(shape)} per position has "
                f"{numel(shape)} elements, more than the {MAX_LANES} a kernel holds per position; "
                "index captured tensors down to a few elements before computing with them")

    @staticmethod
    def lanes_or_val(shape, vals):
        return vals[0] if tuple(shape) == () else Lanes(tuple(shape), list(vals))

    def materialize(self, view) -> Lanes:
        """Load every element a view still covers (a few, by check_lanes)."""
        shape = self.shape_of(view)
        self.check_lanes(shape)
        vals = [self._load(self._index_scalar(view, [_const(c) for c in coord]))
                for coord in itertools.product(*(range(s) for s in shape))]
        return Lanes(shape, vals)

    def as_lanes(self, v) -> Lanes:
        if isinstance(v, ReshapedView):
            return self.materialize(v)
        if isinstance(v, View):
            if not v.visible():
                return Lanes((), [self._load(v)])
            return self.materialize(v)
        if isinstance(v, Lanes):
            return v
        return Lanes((), [v])

    def _lanes_arg(self, arg) -> Lanes:
        v = self.held(arg)
        if isinstance(v, ReshapedView) and isinstance(arg, Node):
            v = self.env[arg] = self.as_lanes(v)
        if isinstance(v, View) and isinstance(arg, Node):
            v = self.env[arg] = self.as_lanes(v) if v.visible() else self._load(v)
        return self.as_lanes(v)

    def _kw(self, node: Node) -> dict:
        """The node's arguments by schema name, defaults filled in."""
        pair = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                                  normalize_to_only_use_kwargs=True)
        if pair is None:
            raise self._error(ModError, f"cannot read the arguments of {node.target}")
        return pair.kwargs

    # ------------------------------------------------------------------ indexing
    def index_view(self, view: View, indices) -> View:
        """``view[indices]`` for scalar (Val) or None entries, one per visible dimension."""
        vis = list(view.visible())
        if len(indices) > len(vis):
            raise self._error(
                ModError, f"too many indices ({len(indices)}) for a captured tensor of shape "
                f"{view.shape} with {len(vis)} dimension(s) left to index", node=view.node)
        index = list(view.index)
        left = []
        for k, vd in enumerate(vis):
            idx = indices[k] if k < len(indices) else None
            if idx is None:
                left.append(vd)
                continue
            if idx.dtype == torch.bool or idx.dtype.is_floating_point:
                raise self._error(ModError, f"index of dtype {idx.dtype} is not supported; use "
                                  "integer indices")
            whole = vd.dim is not None and vd.start == 0 and vd.step == 1 and \
                vd.size == view.shape[vd.dim]
            if idx.const is not None and not whole:
                c = int(idx.const)
                if not -vd.size <= c < vd.size:
                    raise self._error(ModIndexError, f"index {c} is out of range for a dimension "
                                      f"of size {vd.size} of a captured tensor of shape "
                                      f"{view.shape}", node=view.node)
                idx = _const(c + vd.size if c < 0 else c)
            if vd.dim is None:
                continue  # a broadcast dimension: every index reads the same element
            if whole:
                index[vd.dim] = idx  # offsets wrap negative indices, as torch's indexing does
                continue
            if idx.const is not None:
                index[vd.dim] = _const(vd.start + int(idx.const) * vd.step)
                continue
            expr = idx.expr
            if not idx.nonneg:
                expr = self._emit(f"tl.where({expr} < 0, {expr} + {vd.size}, {expr})")
            if vd.step != 1:
                expr = f"{expr} * {vd.step}"
            if vd.start:
                expr = f"{expr} + {vd.start}"
            if expr != idx.expr:
                expr = self._emit(expr)
            index[vd.dim] = Val(expr, idx.dtype, idx.deps, nonneg=True)
        return View(view.cap, view.dtype, view.shape, tuple(index), view.node, tuple(left))

    def _index_value(self, arg):
        if arg is None:
            return None
        v = self.held(arg)
        if isinstance(v, (View, ReshapedView)):
            v = self.as_lanes(v)
            if v.shape == ():
                v = v.vals[0]
        if isinstance(v, Lanes) and (v.dtype == torch.bool or v.dtype.is_floating_point):
            raise self._error(ModError, f"index of dtype {v.dtype} is not supported; use integer "
                              "indices")
        return v

    def _advanced(self, base, indices: list):
        """torch's advanced indexing with per-position index tensors (Lanes) of any shape: the
        broadcast index shape takes the place of the indexed dimensions when they are adjacent,
        and goes first otherwise."""
        base_shape = self.shape_of(base)
        adv = [k for k, e in enumerate(indices) if e is not None]
        bshape = tuple(torch.broadcast_shapes(*(self.shape_of(indices[k]) for k in adv)))
        rest = [base_shape[k] for k in range(len(base_shape))
                if k >= len(indices) or indices[k] is None]
        contiguous = adv == list(range(adv[0], adv[-1] + 1))
        before = sum(1 for k in range(adv[0]) if indices[k] is None) if contiguous else 0
        shape = tuple(rest[:before]) + bshape + tuple(rest[before:])
        self.check_lanes(shape)
        subs = {}
        for bc in itertools.product(*(range(s) for s in bshape)):
            scalar = [None if e is None else
                      (e.at_broadcast(bc, bshape) if isinstance(e, Lanes) else e) for e in indices]
            subs[bc] = self.as_lanes(self._index_scalar(base, scalar))
        vals = []
        nb = len(bshape)
        for coord in itertools.product(*(range(s) for s in shape)):
            bc = coord[before:before + nb]
            rc = coord[:before] + coord[before + nb:]
            vals.append(subs[bc].at(rc))
        return self.lanes_or_val(shape, vals)

    def _index_scalar(self, base, indices: list):
        """``base[indices]`` for scalar or None entries."""
        if isinstance(base, View):
            return self.index_view(base, indices)
        if isinstance(base, ReshapedView):
            return self._index_reshaped(base, indices)
        lanes = self.as_lanes(base)
        if len(indices) > len(lanes.shape):
            raise self._error(ModError, f"too many indices ({len(indices)}) for a value of shape "
                              f"{lanes.shape}")
        indices = list(indices) + [None] * (len(lanes.shape) - len(indices))
        fixed = [k for k, e in enumerate(indices) if e is not None]
        left = [k for k, e in enumerate(indices) if e is None]
        for k in fixed:
            c = indices[k].const
            if c is not None and not -lanes.shape[k] <= int(c) < lanes.shape[k]:
                raise self._error(ModIndexError, f"index {int(c)} is out of range for a "
                                  f"dimension of size {lanes.shape[k]} (a value of shape "
                                  f"{lanes.shape})")
        # Dynamic indices choose among the candidates with a chain of tl.where.
        dynamic = [k for k in fixed if indices[k].const is None]
        key = None
        if dynamic:
            terms, mult = [], 1
            for k in reversed(dynamic):
                e, n = indices[k], lanes.shape[k]
                x = e.expr if e.nonneg else self._emit(f"tl.where({e.expr} < 0, {e.expr} + {n}, "
                                                      f"{e.expr})")
                terms.append(x if mult == 1 else f"{x} * {mult}")
                mult *= n
            key = self._emit(" + ".join(reversed(terms)))
            deps = frozenset().union(*(indices[k].deps for k in dynamic))
        vals = []
        for rc in itertools.product(*(range(lanes.shape[k]) for k in left)):
            coord = [0] * len(lanes.shape)
            for k, c in zip(left, rc):
                coord[k] = c
            for k in fixed:
                if indices[k].const is not None:
                    c = int(indices[k].const)
                    coord[k] = c + lanes.shape[k] if c < 0 else c
            if not dynamic:
                vals.append(lanes.at(tuple(coord)))
                continue
            cands = []
            for dc in itertools.product(*(range(lanes.shape[k]) for k in dynamic)):
                for k, c in zip(dynamic, dc):
                    coord[k] = c
                cands.append(lanes.at(tuple(coord)))
            sel = cands[-1]
            dtype = sel.dtype
            expr = self.cast(sel, dtype)
            for j in range(len(cands) - 2, -1, -1):
                expr = f"tl.where({key} == {j}, {self.cast(cands[j], dtype)}, {expr})"
            d = deps.union(*(c.deps for c in cands))
            vals.append(Val(self._emit(expr), dtype, d,
                            nonneg=all(c.nonneg for c in cands)))
        return self.lanes_or_val(tuple(lanes.shape[k] for k in left), vals)

    def _index_reshaped(self, rv: ReshapedView, indices: list):
        given = list(indices)
        while given and given[-1] is None:
            given.pop()
        if any(i is None for i in given):
            return self._index_scalar(self.as_lanes(rv), indices)
        left = len(rv.shape) - len(rv.fixed)
        if len(given) > left:
            raise self._error(ModError, f"too many indices ({len(given)}) for a value of shape "
                              f"{rv.shape[len(rv.fixed):]}")
        fixed = rv.fixed + tuple(given)
        if len(fixed) < len(rv.shape):
            return ReshapedView(rv.base, rv.shape, fixed)
        # Every dimension given: the row-major position, unravelled over the base's dimensions.
        linear = self.linear_index(fixed, rv.shape)
        return self.index_view(rv.base, self.unravel(linear, self.shape_of(rv.base)))

    def linear_index(self, indices, shape) -> Val:
        """The row-major position of the element ``indices`` (scalars, negatives wrapping)."""
        terms, const, deps = [], 0, frozenset()
        for k, (i, n) in enumerate(zip(indices, shape)):
            stride = numel(shape[k + 1:])
            if i.const is not None:
                c = int(i.const)
                if not -n <= c < n:
                    raise self._error(ModIndexError, f"index {c} is out of range for a dimension "
                                      f"of size {n} of a value of shape {tuple(shape)}")
                const += (c + n if c < 0 else c) * stride
                continue
            x = i.expr if i.nonneg else self._emit(f"tl.where({i.expr} < 0, {i.expr} + {n}, "
                                                  f"{i.expr})")
            terms.append(x if stride == 1 else f"{x} * {stride}")
            deps |= i.deps
        if not terms:
            return _const(const)
        expr = " + ".join(terms + ([str(const)] if const else []))
        return Val(expr if len(terms) == 1 and not const else self._emit(expr), torch.int64, deps,
                   nonneg=True)

    def unravel(self, linear: Val, shape) -> list:
        """The indices of row-major position ``linear`` in ``shape``."""
        out = []
        for k, n in enumerate(shape):
            stride = numel(shape[k + 1:])
            if linear.const is not None:
                out.append(_const(int(linear.const) // stride % n))
                continue
            expr = linear.expr if stride == 1 else f"{linear.expr} // {stride}"
            if k:
                expr = f"({expr}) % {n}"
            out.append(Val(self._emit(expr) if expr != linear.expr else expr, linear.dtype,
                           linear.deps, nonneg=True))
        return out

    def _op_index(self, node):
        base = self.held(node.args[0])
        if isinstance(base, Val):
            raise self._error(
                ModError, "only captured tensors can be indexed; a value computed inside the mod "
                "is already one number per position")
        indices = [self._index_value(i) for i in node.args[1]]
        if any(isinstance(e, Lanes) for e in indices):
            return self._advanced(base, indices)
        return self._index_scalar(base, indices)

    def _op_index_select(self, node):
        kw = self._kw(node)
        base = self.held(kw["input"])
        dim = _norm_dim(kw["dim"], len(self.shape_of(base)))
        idx = self._index_value(kw["index"])
        if isinstance(idx, Val):
            idx = Lanes((1,), [idx])  # index_select keeps the dimension
        return self._advanced(base, [None] * dim + [idx])

    # ------------------------------------------------------------------ views
    def _identity(self, node):
        return self.held(node.args[0])

    _op_clone = _op_alias = _op_detach = _op_lift_fresh_copy = _identity

    def _op_getitem(self, node):
        return self.held(node.args[0])[node.args[1]]

    def _target_shape(self, node) -> tuple:
        val = node.meta.get("val")
        return tuple(int(s) for s in val.shape)

    def _op_unsqueeze(self, node):
        x = self.held(node.args[0])
        shape = self.shape_of(x)
        dim = _norm_dim(node.args[1], len(shape) + 1)
        if isinstance(x, View):
            vis = list(x.visible())
            vis.insert(dim, VDim(None, 1))
            return View(x.cap, x.dtype, x.shape, x.index, x.node, tuple(vis))
        lanes = self.as_lanes(x)
        return Lanes(shape[:dim] + (1,) + shape[dim:], list(lanes.vals))

    def _squeeze_dims(self, node, ndim: int):
        if len(node.args) < 2:
            return list(range(ndim))
        dims = node.args[1]
        dims = [dims] if isinstance(dims, int) else list(dims)
        return [_norm_dim(d, ndim) for d in dims]

    def _op_squeeze(self, node):
        x = self.held(node.args[0])
        shape = self.shape_of(x)
        drop = {d for d in self._squeeze_dims(node, len(shape)) if shape[d] == 1}
        if isinstance(x, View):
            vis = list(x.visible())
            index = list(x.index)
            for d in drop:
                if vis[d].dim is not None:
                    index[vis[d].dim] = _const(vis[d].start)
            left = tuple(vd for k, vd in enumerate(vis) if k not in drop)
            return View(x.cap, x.dtype, x.shape, tuple(index), x.node, left)
        lanes = self.as_lanes(x)
        return self.lanes_or_val(tuple(s for k, s in enumerate(shape) if k not in drop), lanes.vals)

    def _op_view(self, node):
        x = self.held(node.args[0])
        target = self._target_shape(node)
        if isinstance(x, ReshapedView) and not x.fixed:
            x = x.base
        if isinstance(x, View):
            vis = list(x.visible())
            if [vd.size for vd in vis if vd.size != 1] == [s for s in target if s != 1]:
                index = list(x.index)
                for vd in vis:
                    if vd.size == 1 and vd.dim is not None:
                        index[vd.dim] = _const(vd.start)
                keep = iter(vd for vd in vis if vd.size != 1)
                left = tuple(next(keep) if s != 1 else VDim(None, 1) for s in target)
                return View(x.cap, x.dtype, x.shape, tuple(index), x.node, left)
            return ReshapedView(x, target)  # indices pick one element; nothing is loaded yet
        lanes = self.as_lanes(x)
        return self.lanes_or_val(target, lanes.vals)

    _op__unsafe_view = _op_reshape = _op_view

    def _op_expand(self, node):
        x = self.held(node.args[0])
        target = self._target_shape(node)
        shape = self.shape_of(x)
        lead = len(target) - len(shape)
        if isinstance(x, View):
            vis = list(x.visible())
            index = list(x.index)
            left = [VDim(None, n) for n in target[:lead]]
            for vd, n in zip(vis, target[lead:]):
                if vd.size == n:
                    left.append(vd)
                    continue
                if vd.dim is not None:
                    index[vd.dim] = _const(vd.start)
                left.append(VDim(None, n))
            return View(x.cap, x.dtype, x.shape, tuple(index), x.node, tuple(left))
        self.check_lanes(target)
        lanes = self.as_lanes(x)
        vals = [lanes.at_broadcast(c, target) for c in itertools.product(*(range(n) for n in target))]
        return self.lanes_or_val(target, vals)

    def _permuted(self, x, perm):
        if isinstance(x, View):
            vis = x.visible()
            return View(x.cap, x.dtype, x.shape, x.index, x.node, tuple(vis[p] for p in perm))
        lanes = self.as_lanes(x)
        shape = tuple(lanes.shape[p] for p in perm)
        vals = []
        for coord in itertools.product(*(range(s) for s in shape)):
            src = [0] * len(perm)
            for k, p in enumerate(perm):
                src[p] = coord[k]
            vals.append(lanes.at(tuple(src)))
        return self.lanes_or_val(shape, vals)

    def _op_permute(self, node):
        x = self.held(node.args[0])
        ndim = len(self.shape_of(x))
        return self._permuted(x, [_norm_dim(d, ndim) for d in node.args[1]])

    def _op_transpose(self, node):
        x = self.held(node.args[0])
        ndim = len(self.shape_of(x))
        if ndim < 2:
            return x
        perm = list(range(ndim))
        a, b = _norm_dim(node.args[1], ndim), _norm_dim(node.args[2], ndim)
        perm[a], perm[b] = perm[b], perm[a]
        return self._permuted(x, perm)

    def _op_t(self, node):
        x = self.held(node.args[0])
        ndim = len(self.shape_of(x))
        return x if ndim < 2 else self._permuted(x, [1, 0])

    def _op_numpy_T(self, node):
        x = self.held(node.args[0])
        ndim = len(self.shape_of(x))
        return self._permuted(x, list(reversed(range(ndim))))

    # In-place views of intermediates (matmul's decomposition squeezes its result in place): the
    # graph may read the result through either node.
    def _in_place(self, node, handler):
        out = handler(node)
        if isinstance(node.args[0], Node):
            self.env[node.args[0]] = out
        return out

    def _op_squeeze_(self, node):
        return self._in_place(node, self._op_squeeze)

    def _op_unsqueeze_(self, node):
        return self._in_place(node, self._op_unsqueeze)

    def _op_t_(self, node):
        return self._in_place(node, self._op_t)

    def _op_transpose_(self, node):
        return self._in_place(node, self._op_transpose)

    def _op_scatter(self, node):
        """``self.scatter(dim, index, src)``: each src element goes where its index says."""
        kw = self._kw(node)
        out = self._lanes_arg(kw["input"])
        dim = _norm_dim(kw["dim"], len(out.shape))
        index = self.as_lanes(self._index_value(kw["index"]))
        src = kw.get("src", kw.get("value"))
        src = self._lanes_arg(src) if isinstance(src, Node) else Lanes((), [self.value(src)])
        if kw.get("reduce") is not None:
            raise self._error(UnsupportedOpError, "scatter with reduce= is not supported")
        vals = list(out.vals)
        dtype = out.dtype
        for p in itertools.product(*(range(s) for s in index.shape)):
            i = index.at(p)
            v = src.at_broadcast(p, index.shape) if src.shape else src.vals[0]
            for j in range(out.shape[dim]):
                coord = list(p)
                coord[dim] = j
                flat = 0
                for c, s in zip(coord, out.shape):
                    flat = flat * s + c
                if i.const is not None:
                    if int(i.const) == j:
                        vals[flat] = Val(self.cast(v, dtype), dtype, v.deps, nonneg=v.nonneg)
                    continue
                cur = vals[flat]
                vals[flat] = Val(self._emit(f"tl.where({i.expr} == {j}, {self.cast(v, dtype)}, "
                                            f"{self.cast(cur, dtype)})"), dtype,
                                 cur.deps | v.deps | i.deps)
        return Lanes(out.shape, vals)

    def _scatter(self, out: Lanes, src: Lanes, dim: int, positions) -> Lanes:
        """``out`` with ``src`` written into it, ``src``'s index j along ``dim`` at ``positions[j]``."""
        vals = list(out.vals)
        dtype = out.dtype
        for coord in itertools.product(*(range(s) for s in src.shape)):
            target = list(coord)
            target[dim] = positions[coord[dim]]
            flat = 0
            for c, s in zip(target, out.shape):
                flat = flat * s + c
            v = src.at(coord)
            vals[flat] = Val(self.cast(v, dtype), dtype, v.deps, v.const, nonneg=v.nonneg)
        return Lanes(out.shape, vals)

    def _op_slice_scatter(self, node):
        kw = self._kw(node)
        out = self._lanes_arg(kw["input"])
        src = self._lanes_arg(kw["src"])
        dim = _norm_dim(kw["dim"], len(out.shape))
        picked = range(out.shape[dim])[slice(kw["start"], kw["end"], kw["step"] or 1)]
        return self._scatter(out, src, dim, picked)

    def _op_select_scatter(self, node):
        kw = self._kw(node)
        out = self._lanes_arg(kw["input"])
        dim = _norm_dim(kw["dim"], len(out.shape))
        src = self._lanes_arg(kw["src"])
        src = Lanes(src.shape[:dim] + (1,) + src.shape[dim:], src.vals)
        i = kw["index"] % out.shape[dim]
        return self._scatter(out, src, dim, [i])

    def _op_select(self, node):
        x = self.held(node.args[0])
        dim = _norm_dim(node.args[1], len(self.shape_of(x)))
        index = node.args[2]
        idx = self.value(index) if isinstance(index, Node) else _const(int(index))
        return self._index_scalar(x, [None] * dim + [idx])

    def _op_slice(self, node):
        kw = self._kw(node)
        x = self.held(kw["input"])
        shape = self.shape_of(x)
        dim = _norm_dim(kw["dim"], len(shape))
        if any(isinstance(kw[k], Node) for k in ("start", "end", "step")):
            raise self._error(UnsupportedOpError, "slices with tensor bounds are not supported; "
                              "index with an offset expression instead")
        n = shape[dim]
        start, end, step = kw["start"], kw["end"], kw["step"] or 1
        picked = range(n)[slice(start, end, step)]
        if isinstance(x, View):
            vis = list(x.visible())
            vd = vis[dim]
            first = picked.start if len(picked) else 0
            vis[dim] = VDim(vd.dim, len(picked), vd.start + first * vd.step, vd.step * step)
            return View(x.cap, x.dtype, x.shape, x.index, x.node, tuple(vis))
        lanes = self.as_lanes(x)
        out = shape[:dim] + (len(picked),) + shape[dim + 1:]
        vals = []
        for coord in itertools.product(*(range(s) for s in out)):
            src = list(coord)
            src[dim] = picked[coord[dim]]
            vals.append(lanes.at(tuple(src)))
        return self.lanes_or_val(out, vals)

    def _cat_lanes(self, parts: list, dim: int) -> Lanes:
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.check_lanes(shape)
        vals = []
        for coord in itertools.product(*(range(s) for s in shape)):
            c = coord[dim]
            for p in parts:
                if c < p.shape[dim]:
                    src = list(coord)
                    src[dim] = c
                    vals.append(p.at(tuple(src)))
                    break
                c -= p.shape[dim]
        return Lanes(tuple(shape), vals)

    def _op_cat(self, node):
        parts = [self._lanes_arg(a) for a in node.args[0]]
        parts = [p for p in parts if numel(p.shape) or len(p.shape) > 1]  # torch skips (0,)
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0),
                        len(parts[0].shape))
        return self._cat_lanes(parts, dim)

    def _op_stack(self, node):
        parts = [self._lanes_arg(a) for a in node.args[0]]
        ndim = len(parts[0].shape) + 1
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), ndim)
        parts = [Lanes(p.shape[:dim] + (1,) + p.shape[dim:], p.vals) for p in parts]
        return self._cat_lanes(parts, dim)

    def _op_unbind(self, node):
        x = self.held(node.args[0])
        shape = self.shape_of(x)
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
        return tuple(self._index_scalar(x, [None] * dim + [_const(i)]) for i in range(shape[dim]))

    def _op_flip(self, node):
        lanes = self._lanes_arg(node.args[0])
        dims = {_norm_dim(d, len(lanes.shape)) for d in node.args[1]}
        vals = [lanes.at(tuple(lanes.shape[k] - 1 - c if k in dims else c
                               for k, c in enumerate(coord)))
                for coord in itertools.product(*(range(s) for s in lanes.shape))]
        return Lanes(lanes.shape, vals)

    def _op_repeat(self, node):
        lanes = self._lanes_arg(node.args[0])
        reps = list(node.args[1])
        shape = (1,) * (len(reps) - len(lanes.shape)) + tuple(lanes.shape)
        out = tuple(s * r for s, r in zip(shape, reps))
        self.check_lanes(out)
        src = Lanes(shape, lanes.vals)
        vals = [src.at(tuple(c % s for c, s in zip(coord, shape)))
                for coord in itertools.product(*(range(s) for s in out))]
        return self.lanes_or_val(out, vals)

    # ------------------------------------------------------------------ constants
    def _constant(self, node, value):
        out = self._out_dtype(node)
        shape = self._target_shape(node)
        if shape == ():
            return self._const_result(value, out)
        self.check_lanes(shape)
        return Lanes(shape, [self._const_result(value, out) for _ in range(numel(shape))])

    def _op_scalar_tensor(self, node):
        return self._constant(node, node.args[0])

    def _op_full(self, node):
        return self._constant(node, node.args[1])

    _op_full_like = _op_full

    def _op_zeros(self, node):
        return self._constant(node, 0)

    def _op_ones(self, node):
        return self._constant(node, 1)

    _op_zeros_like = _op_new_zeros = _op_zeros
    _op_ones_like = _op_new_ones = _op_ones

    def _op_new_full(self, node):
        return self._constant(node, node.args[2])

    # Uninitialized tensors (derivative formulas make them, then fill them): zeros are as good as
    # any contents.
    def _op_empty(self, node):
        return self._constant(node, 0)

    _op_empty_like = _op_empty_permuted = _op_new_empty = _op_empty

    def _op_arange(self, node):
        if any(isinstance(a, Node) for a in node.args):
            raise self._error(UnsupportedOpError, "torch.arange with tensor bounds is not "
                              "supported; its length must be known when the mod is lowered")
        out = self._out_dtype(node)
        values = torch.arange(*node.args, dtype=out).tolist()
        self.check_lanes((len(values),))
        return self.lanes_or_val((len(values),), [self._const_result(v, out) for v in values])

    # ------------------------------------------------------------------ reductions
    def _reduce_dims(self, dim, ndim: int) -> list:
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return list(range(ndim))
        dims = [dim] if isinstance(dim, int) else list(dim)
        return sorted({_norm_dim(d, max(ndim, 1)) for d in dims if ndim})

    def _groups(self, lanes: Lanes, dims: list, keepdim: bool):
        """(output shape, [(output coordinate, [reduced Vals])])."""
        shape = lanes.shape
        kept = [k for k in range(len(shape)) if k not in dims]
        out = tuple(1 if k in dims else shape[k] for k in range(len(shape))) if keepdim else \
            tuple(shape[k] for k in kept)
        groups = []
        for kc in itertools.product(*(range(shape[k]) for k in kept)):
            members = []
            for rc in itertools.product(*(range(shape[k]) for k in dims)):
                coord = [0] * len(shape)
                for k, c in zip(kept, kc):
                    coord[k] = c
                for k, c in zip(dims, rc):
                    coord[k] = c
                members.append(lanes.at(tuple(coord)))
            groups.append(members)
        return out, groups

    def _fold_vals(self, vals: list, compute: torch.dtype, combine) -> tuple[str, frozenset]:
        operand = self.bool_operand if compute == torch.bool else (lambda v: self.cast(v, compute))
        acc = operand(vals[0])
        deps = vals[0].deps
        for v in vals[1:]:
            acc = self._emit(combine(acc, operand(v)))
            deps |= v.deps
        return acc, deps

    def _reduction(self, node, dim, keepdim, combine, empty=None, finish=None, compute=None):
        lanes = self._lanes_arg(node.args[0])
        out = self._out_dtype(node)
        compute = compute or opmath(out)
        dims = self._reduce_dims(dim, len(lanes.shape))
        shape, groups = self._groups(lanes, dims, keepdim)
        vals = []
        for members in groups:
            if not members:
                vals.append(self._const_result(empty, out))
                continue
            acc, deps = self._fold_vals(members, compute, combine)
            if finish is not None:
                acc = finish(acc, len(members))
            nonneg = all(m.nonneg for m in members)
            vals.append(self._finish_op(acc, compute, out, deps, nonneg))
        return self.lanes_or_val(shape, vals)

    def _dim_args(self, node):
        kw = self._kw(node)
        return kw.get("dim"), kw.get("keepdim", False)

    def _op_sum(self, node):
        dim, keepdim = self._dim_args(node)
        return self._reduction(node, dim, keepdim, lambda a, b: f"{a} + {b}", empty=0)

    def _op_prod(self, node):
        dim, keepdim = self._dim_args(node)
        return self._reduction(node, dim, keepdim, lambda a, b: f"{a} * {b}", empty=1)

    def _op_mean(self, node):
        dim, keepdim = self._dim_args(node)
        return self._reduction(node, dim, keepdim, lambda a, b: f"{a} + {b}", empty=float("nan"),
                               finish=lambda acc, n: f"{acc} / {float(n)!r}")

    def _extreme(self, node, fn: str, dim, keepdim):
        out = self._out_dtype(node)
        return self._reduction(node, dim, keepdim,
                               lambda a, b: self._minmax(fn, a, b, opmath(out)))

    def _op_amax(self, node):
        dim, keepdim = self._dim_args(node)
        return self._extreme(node, "maximum", dim, keepdim)

    def _op_amin(self, node):
        dim, keepdim = self._dim_args(node)
        return self._extreme(node, "minimum", dim, keepdim)

    def _max_min(self, node, fn: str, arg: str, binary):
        overload = getattr(node.target, "_overloadname", "default")
        if overload == "other":  # torch.max(a, b): elementwise
            lanes = self._lane_args(node)
            return self._elementwise_lanes(node, binary, lanes) if lanes else binary(node)
        if overload == "default":
            return self._extreme(node, fn, None, False)
        kw = self._kw(node)
        values = self._extreme(node, fn, kw["dim"], kw["keepdim"])
        return values, self._arg_extreme(node, arg, kw["dim"], kw["keepdim"])

    def _op_max(self, node):
        return self._max_min(node, "maximum", "max", self._op_maximum)

    def _op_min(self, node):
        return self._max_min(node, "minimum", "min", self._op_minimum)

    def _arg_extreme(self, node, which: str, dim, keepdim):
        """Index of the first maximum (minimum); a NaN counts as the extreme, as in torch."""
        lanes = self._lanes_arg(node.args[0])
        if dim is None:
            lanes = Lanes((numel(lanes.shape),), lanes.vals)
            dims, keepdim = [0], False
        else:
            dims = self._reduce_dims(dim, len(lanes.shape))
        compute = opmath(lanes.dtype)
        shape, groups = self._groups(lanes, dims, keepdim)
        op = ">" if which == "max" else "<"
        vals = []
        for members in groups:
            best = self.cast(members[0], compute)
            pos = "0"
            deps = members[0].deps
            for j, m in enumerate(members[1:], 1):
                x = self.cast(m, compute)
                better = f"({x} {op} {best})"
                if compute.is_floating_point:
                    better = f"({better} | (({x} != {x}) & ({best} == {best})))"
                better = self._emit(better)
                best = self._emit(f"tl.where({better}, {x}, {best})")
                pos = self._emit(f"tl.where({better}, {j}, {pos})")
                deps |= m.deps
            vals.append(Val(self._emit(f"({pos}).to(tl.int64)") if pos != "0" else
                            literal(0, torch.int64), torch.int64, deps,
                            const=0 if pos == "0" else None, nonneg=True))
        return self.lanes_or_val(shape, vals)

    def _op_argmax(self, node):
        kw = self._kw(node)
        return self._arg_extreme(node, "max", kw.get("dim"), kw.get("keepdim", False))

    def _op_argmin(self, node):
        kw = self._kw(node)
        return self._arg_extreme(node, "min", kw.get("dim"), kw.get("keepdim", False))

    def _logical_reduce(self, node, op: str):
        kw = self._kw(node)
        dim = kw.get("dim")
        return self._reduction(node, dim, kw.get("keepdim", False),
                               lambda a, b: f"{a} {op} {b}", empty=op == "&",
                               compute=torch.bool)

    def _op_any(self, node):
        return self._logical_reduce(node, "|")

    def _op_all(self, node):
        return self._logical_reduce(node, "&")

    def _products(self, node, pairs) -> Val:
        out = self._out_dtype(node)
        compute = opmath(out)
        terms, deps = [], frozenset()
        for a, b in pairs:
            terms.append(self._emit(f"{self.cast(a, compute)} * {self.cast(b, compute)}"))
            deps |= a.deps | b.deps
        acc = terms[0]
        for t in terms[1:]:
            acc = self._emit(f"{acc} + {t}")
        return self._finish_op(acc, compute, out, deps)

    def _scan(self, node, op: str):
        kw = self._kw(node)
        lanes = self._lanes_arg(kw["input"])
        out = self._out_dtype(node)
        compute = opmath(out)
        if not lanes.shape:
            return self._finish_op(self.cast(lanes.vals[0], compute), compute, out,
                                   lanes.vals[0].deps)
        dim = _norm_dim(kw["dim"], len(lanes.shape))
        vals = list(lanes.vals)
        others = [range(s) if k != dim else range(1) for k, s in enumerate(lanes.shape)]
        for base in itertools.product(*others):
            acc, deps = None, frozenset()
            for j in range(lanes.shape[dim]):
                coord = list(base)
                coord[dim] = j
                v = lanes.at(tuple(coord))
                x = self.cast(v, compute)
                acc = x if acc is None else self._emit(f"{acc} {op} {x}")
                deps = deps | v.deps
                flat = 0
                for c, n in zip(coord, lanes.shape):
                    flat = flat * n + c
                vals[flat] = self._finish_op(acc, compute, out, deps)
        return Lanes(lanes.shape, vals)

    def _op_cumsum(self, node):
        return self._scan(node, "+")

    def _op_cumprod(self, node):
        return self._scan(node, "*")

    def _op_dot(self, node):
        a, b = self._lanes_arg(node.args[0]), self._lanes_arg(node.args[1])
        if a.shape != b.shape or len(a.shape) != 1:
            raise self._error(ModError, f"torch.dot needs two vectors of the same length, got "
                              f"{a.shape} and {b.shape}")
        return self._products(node, zip(a.vals, b.vals))

    _op_vdot = _op_dot

    def _op_mv(self, node):
        m, v = self._lanes_arg(node.args[0]), self._lanes_arg(node.args[1])
        n, k = m.shape
        return self.lanes_or_val((n,), [self._products(node, [(m.at((i, j)), v.at((j,)))
                                                              for j in range(k)])
                                        for i in range(n)])

    def _op_mm(self, node):
        a, b = self._lanes_arg(node.args[0]), self._lanes_arg(node.args[1])
        n, k = a.shape
        m = b.shape[1]
        self.check_lanes((n, m))
        return Lanes((n, m), [self._products(node, [(a.at((i, j)), b.at((j, c))) for j in range(k)])
                              for i in range(n) for c in range(m)])


def flat_nodes(items) -> list:
    """The fx Nodes in ``items`` and in the lists and tuples nested in it, in order."""
    out = []
    for x in items:
        if isinstance(x, Node):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(flat_nodes(x))
    return out

