"""Index safety: every index a mod takes into a captured tensor lies in range, or the call raises.

torch's eager evaluation raises IndexError on an out-of-range index; a kernel would read
whatever lies there. Before a call over the grid ``b < B, h < H, q_idx < L, kv_idx < S``:

1. An interval analysis of the traced mod (:mod:`flexcore.lowering.intervals`) proves most
   indices in range from the grid's bounds alone (affine indices, clamps, remainders). Nothing
   else runs for them, ever again at this shape.
2. An index that depends only on b, h, q_idx, kv_idx (not on captured values) and is not proven
   is evaluated with torch over every position it depends on (its own dimensions only: ``t[kv_idx]``
   costs S evaluations), once per shape; the verdict is kept.
3. An index that depends on captured values (``lengths[doc_ids[q_idx]]``) is proven from those
   tensors' current min and max, else evaluated like 2, at each call that asks for run-time
   checks, unless no captured tensor changed (``Tensor._version``) since the last check at
   this shape.

The evaluation never indexes out of bounds (indices are clamped while their range is checked),
runs each mod once per element as torch's vmap does, and stops at the first offending position,
which the error names with the tensor, its size, the index expression and the user's line.
"""
from __future__ import annotations

import contextlib
import linecache
import math
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.utils.weak import WeakIdKeyDictionary

from flexcore.errors import ModIndexError
from flexcore.lowering.intervals import Interval, IntervalAnalysis, dtype_range
from flexcore.lowering.shapes import flat_nodes

_GRID = ("b", "h", "q_idx", "kv_idx")
#: Positions evaluated per torch call of the check.
CHUNK = 1 << 20
#: Above this many positions, a value-independent check waits for a call with run-time checks (a
#: warning until then): it would cost seconds at the first call.
STATIC_BUDGET = 1 << 26


@dataclass(frozen=True)
class IndexSite:
    """One index into a tensor: ``node`` (aten.index / index_select), which index argument, and
    what an error message needs."""

    node: Node
    arg: object          # the index: a Node, or an int
    position: int        # dimension of the indexed value
    size: int            # its size there
    tensor: str          # the user's name and shape of the tensor, as the message shows it
    expression: str
    location: tuple      # (filename, lineno)
    deps: frozenset      # of b, h, q_idx, kv_idx, score, and "values" (reads captured tensors)

    @property
    def describe(self) -> str:
        return f"{self.tensor}[{self.expression}] (dimension {self.position}, size {self.size})"


@dataclass(frozen=True)
class IndexVerdict:
    """What :func:`check_indices` established (it raises instead when an index is out of range).

    Attributes:
        proven: sites proven in range by interval analysis.
        checked: sites evaluated over every position they depend on, all in range.
        unchecked: sites neither proven nor checked, each with the reason (run-time checks off,
            the index depends on the score, the grid is too large, inside a CUDA graph capture).
        lowered: False when the mod could not be lowered (nothing was checked).
    """

    proven: tuple = ()
    checked: tuple = ()
    unchecked: tuple = ()
    lowered: bool = True

    @property
    def complete(self) -> bool:
        """True when every index of the mod is known to be in range."""
        return self.lowered and not self.unchecked


@dataclass
class _Static:
    """The value-independent part of a verdict at one shape, and what is left for run time."""

    proven: list = field(default_factory=list)
    checked: list = field(default_factory=list)
    skipped: list = field(default_factory=list)   # (site, reason)
    costly: list = field(default_factory=list)    # value-independent, above STATIC_BUDGET
    dynamic: list = field(default_factory=list)   # sites whose index reads captured values
    error: ModIndexError | None = None
    verdicts: dict = field(default_factory=dict)  # built verdicts, by what the run-time step did


_lock = threading.Lock()
_sites: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_static: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_runtime_ok: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------------------------
# Sites
# ---------------------------------------------------------------------------------------------

def _name(node: Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", "")


def _dependencies(gm: GraphModule) -> dict:
    names = [n for n in gm.graph.nodes if n.op == "placeholder"]
    order = ("score",) + _GRID if len(names) == 5 else _GRID
    deps: dict[Node, frozenset] = {n: frozenset({o}) for n, o in zip(names, order)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            literal = all(u.op == "call_function" and "lift_fresh" in str(u.target)
                          for u in node.users)
            deps[node] = frozenset() if literal else frozenset({"values"})
        elif node.op == "call_function":
            out = frozenset()
            for a in flat_nodes(node.args) + flat_nodes(list(node.kwargs.values())):
                out |= deps.get(a, frozenset())
            deps[node] = out
    return deps


def _root_tensor(gm: GraphModule, node: Node):
    """The get_attr a value is read from through indexing and views, if any."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    if node.op == "get_attr":
        return getattr(gm, node.target)
    return None


_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floor_divide": "//",
            "remainder": "%", "bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^",
            "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
            "__lshift__": "<<", "__rshift__": ">>", "bitwise_left_shift": "<<",
            "bitwise_right_shift": ">>"}
_PASS = {"_to_copy", "clone", "alias", "detach", "lift_fresh_copy"}


def expression(gm: GraphModule, arg, names: dict, depth: int = 0) -> str:
    """A Python-like rendering of the expression that computes ``arg``."""
    if not isinstance(arg, Node):
        return repr(arg)
    if depth > 6:
        return "..."
    if arg.op == "placeholder":
        return names.get(arg, str(arg.target))
    if arg.op == "get_attr":
        t = getattr(gm, arg.target)
        if t.dim() == 0 and all("lift_fresh" in str(u.target) for u in arg.users):
            return repr(t.item())
        return names.get(id(t)) or f"<tensor {tuple(t.shape)}>"
    name = _name(arg)
    sub = [expression(gm, a, names, depth + 1) for a in arg.args if not isinstance(a, (list, tuple))]
    if name in _PASS and sub:
        return sub[0]
    if name in ("full", "scalar_tensor"):
        return repr(arg.args[1] if name == "full" else arg.args[0])
    if name in _SYMBOLS and len(sub) >= 2:
        if name == "div" and arg.kwargs.get("rounding_mode") == "floor":
            return f"({sub[0]} // {sub[1]})"
        return f"({sub[0]} {_SYMBOLS[name]} {sub[1]})"
    if name == "rsub" and len(sub) >= 2:
        return f"({sub[1]} - {sub[0]})"
    if name == "neg" and sub:
        return f"-{sub[0]}"
    if name == "index":
        idx = ", ".join(":" if i is None else expression(gm, i, names, depth + 1)
                        for i in arg.args[1])
        return f"{sub[0]}[{idx}]"
    return f"{name}({', '.join(sub)})"


def _strip(text: str) -> str:
    if text.startswith("(") and text.endswith(")"):
        depth = 0
        for i, c in enumerate(text):
            depth += (c == "(") - (c == ")")
            if depth == 0 and i < len(text) - 1:
                return text
        return text[1:-1]
    return text


def index_sites(lowered) -> list:
    """The indices into tensors in a lowered mod's graph, in graph order (cached)."""
    found = _sites.get(lowered)
    if found is not None:
        return found
    gm = lowered.graph
    found = []
    if gm is not None:
        names: dict = {id(t): n for t, n in zip(lowered.captured, lowered.cap_names) if n}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names.update(zip(placeholders, (("score",) if len(placeholders) == 5 else ()) + _GRID))
        deps = _dependencies(gm)
        for node in gm.graph.nodes:
            if node.op != "call_function" or _name(node) not in ("index", "index_select"):
                continue
            base = node.args[0]
            shape = tuple(base.meta["val"].shape)
            root = _root_tensor(gm, base)
            base_text = expression(gm, base, names)
            if root is not None and root.dim() and base.op == "get_attr":
                tensor = f"`{base_text}` (captured, shape {tuple(root.shape)})"
            elif root is not None:
                tensor = f"`{base_text}` (shape {shape}, read from a captured tensor of shape " \
                         f"{tuple(root.shape)})"
            else:
                tensor = f"`{base_text}` (shape {shape}, computed in the mod)"
            if _name(node) == "index":
                entries = list(enumerate(node.args[1]))
            else:
                entries = [(node.args[1] % max(len(shape), 1), node.args[2])]
            loc = node.meta.get("flex_loc") or (None, None, None)
            for position, idx in entries:
                if idx is None:
                    continue
                found.append(IndexSite(
                    node, idx, position, int(shape[position]), tensor,
                    _strip(expression(gm, idx, names)), (loc[0], loc[1]),
                    deps.get(idx, frozenset()) if isinstance(idx, Node) else frozenset()))
    with _lock:
        _sites[lowered] = found
    return found


# ---------------------------------------------------------------------------------------------
# Evaluation over the grid, with torch's per-element semantics and clamped indices
# ---------------------------------------------------------------------------------------------

def _needed(sites) -> set:
    """The nodes the sites' indices are computed from."""
    need: set = set()
    stack = [s.arg for s in sites if isinstance(s.arg, Node)]
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        stack.extend(flat_nodes(n.args) + flat_nodes(list(n.kwargs.values())))
    return need


def _bound_tensors(lowered) -> dict:
    """``id(graph's tensor) -> call's tensor`` where a lowering was bound to other tensors than
    its graph reads (LoweredMod.graph_captured): the checks read the call's values."""
    return {id(g): t for g, t in zip(lowered.graph_captured, lowered.captured) if g is not t}


def _evaluator(gm: GraphModule, sites, device: torch.device, bound: dict | None = None):
    """``fn(b, h, q_idx, kv_idx) -> (in range, index) per site`` at one position (vmapped),
    reading ``bound``'s tensor in place of a graph tensor it names (:func:`_bound_tensors`).

    Every index a needed node takes is clamped into range first, so no read goes out of bounds
    even where an earlier index was wrong."""
    bound = bound or {}
    need = _needed(sites)
    bounds: dict[Node, list] = {}
    for node in gm.graph.nodes:
        if node in need and node.op == "call_function" and _name(node) in ("index",
                                                                           "index_select"):
            shape = tuple(node.args[0].meta["val"].shape)
            if _name(node) == "index":
                bounds[node] = [(k, int(shape[k])) for k, i in enumerate(node.args[1])
                                if i is not None]
            else:
                bounds[node] = [(2, int(shape[node.args[1] % max(len(shape), 1)]))]
    nodes = [n for n in gm.graph.nodes if n in need]
    grid_nodes = [n for n in gm.graph.nodes if n.op == "placeholder"][-4:]

    def clamp(idx, n):
        idx = torch.as_tensor(idx, device=device)
        return torch.where((idx >= -n) & (idx < n), idx, torch.zeros_like(idx))

    def fn(*grid):
        env: dict = dict(zip(grid_nodes, grid))

        def val(a):
            if isinstance(a, Node):
                return env[a]
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a

        for node in nodes:
            if node.op == "placeholder":
                continue
            if node.op == "get_attr":
                t = getattr(gm, node.target)
                env[node] = bound.get(id(t), t)
                continue
            args = list(val(node.args))
            kwargs = {k: val(v) for k, v in node.kwargs.items()}
            if "device" in kwargs:
                kwargs["device"] = device
            for k, n in bounds.get(node, ()):
                if _name(node) == "index":
                    entries = list(args[1])
                    entries[k] = clamp(entries[k], n)
                    args[1] = entries
                else:
                    args[2] = clamp(args[2], n)
            env[node] = node.target(*args, **kwargs)
        oks, values = [], []
        for s in sites:
            idx = torch.as_tensor(val(s.arg), device=device)
            inside = (idx >= -s.size) & (idx < s.size)
            oks.append(inside.all())
            if idx.dim():
                first = torch.argmin(inside.flatten().to(torch.uint8))
                idx = idx.flatten()[first]
            values.append(idx.to(torch.int64))
        return tuple(oks), tuple(values)

    return fn


def _grid_positions(dims, sizes, start, stop, device):
    """Index tensors of positions [start, stop) of the row-major grid over ``dims``."""
    p = torch.arange(start, stop, device=device, dtype=torch.int64)
    out = {}
    for d in reversed(dims):
        out[d] = (p % sizes[d]).to(torch.int32)
        p = p // sizes[d]
    return out


# functorch's dispatch keys, which a custom op's kernel runs without (flexcore.ops under
# torch.compile) and torch.vmap needs.
_FUNCTORCH_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in (
    "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchBatched",
    "FuncTorchVmapMode", "BatchedNestedTensor", "FuncTorchGradWrapper")
    if hasattr(torch._C.DispatchKey, name))


@contextlib.contextmanager
def _vmap_dispatch():
    """functorch's keys taken off the dispatcher's thread-local exclude set while inside: a
    custom op's kernel excludes them, and vmap then fails (``NYI: querying is_contiguous inside
    of vmap``)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    if not any(exclude.has(k) for k in _FUNCTORCH_KEYS):
        yield
        return
    for k in _FUNCTORCH_KEYS:
        exclude = exclude.remove(k)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _evaluate(lowered, sites, sizes: dict) -> tuple[int, dict, int] | None:
    """Evaluate ``sites`` of ``lowered``'s graph, on the tensors it is bound to, at every
    position of the grid over their dimensions; None when every index is in range, else (site
    number, position, index value) of the first offending one."""
    device = _device(lowered)
    dims = [d for d in _GRID if any(d in s.deps for s in sites)]
    total = math.prod(sizes[d] for d in dims)
    fn = _evaluator(lowered.graph, sites, device, _bound_tensors(lowered))
    in_dims = tuple(0 if d in dims else None for d in _GRID)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    with torch.no_grad(), _vmap_dispatch():
        if not dims:
            oks, values = fn(zero, zero, zero, zero)
            for i, ok in enumerate(oks):
                if not bool(ok):
                    return i, {}, int(values[i])
            return None
        batched = torch.vmap(fn, in_dims=in_dims)
        for start in range(0, total, CHUNK):
            stop = min(start + CHUNK, total)
            grid = _grid_positions(dims, sizes, start, stop, device)
            oks, values = batched(*(grid.get(d, zero) for d in _GRID))
            for i, ok in enumerate(oks):
                bad = ~ok
                if bool(bad.any()):
                    j = int(bad.to(torch.uint8).argmax())
                    position = {d: int(grid[d][j]) for d in dims}
                    return i, position, int(values[i][j])
    return None


def _error(lowered, site: IndexSite, position: dict, value: int, shape: tuple) -> ModIndexError:
    filename, lineno = site.location
    line = linecache.getline(filename, lineno).strip() if filename and lineno else ""
    at = ", ".join(f"{k}={v}" for k, v in position.items()) or "every position"
    others = [d for d in _GRID if d not in position]
    B, H, L, S = shape
    message = (f"index out of range: {site.tensor} has size {site.size} in dimension "
               f"{site.position}, but the index `{site.expression}` is {value} at {at}"
               + (f" (for any {', '.join(others)})" if position and others else "")
               + f"; valid indices are {-site.size}..{site.size - 1}. The call covers "
               f"B={B}, H={H}, Q_LEN={L}, KV_LEN={S}: size the tensor for it or clamp the index"
               + (f".\n    {line}" if line else "."))
    return ModIndexError(message, mod_name=lowered.mod_name, filename=filename, lineno=lineno,
                         op="index", tensor=site.tensor, size=site.size, dim=site.position,
                         expression=site.expression, position=position, value=value)


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------

def _static_range(t: torch.Tensor) -> Interval:
    return dtype_range(t.dtype)


_minmax_cache = WeakIdKeyDictionary()  # tensors compare elementwise: key them by identity


def _value_range(t: torch.Tensor) -> Interval:
    """The tensor's current min and max (remembered per in-place version)."""
    version = _version(t)
    hit = _minmax_cache.get(t)
    if hit is not None and version is not None and hit[0] == version:
        return hit[1]
    if t.numel() == 0:
        iv = Interval(0, 0)
    else:
        lo, hi = torch.aminmax(t.detach().reshape(-1).to(
            torch.float64 if t.is_floating_point() else torch.int64))
        iv = Interval(lo.item(), hi.item())
    _minmax_cache[t] = (version, iv)
    return iv


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def _device(lowered) -> torch.device:
    return lowered.captured[0].device if lowered.captured else torch.device("cpu")


def _analysis(lowered, shape, tensor_range):
    B, H, L, S = shape
    inputs = {"b": Interval(0, B - 1), "h": Interval(0, H - 1), "q_idx": Interval(0, L - 1),
              "kv_idx": Interval(0, S - 1)}
    bound = _bound_tensors(lowered)
    if bound:  # the values of the call's tensors, not of those the graph was traced with
        return IntervalAnalysis(lowered.graph, inputs, lambda t: tensor_range(bound.get(id(t), t)))
    return IntervalAnalysis(lowered.graph, inputs, tensor_range)


def _in_range(analysis, site: IndexSite) -> bool:
    iv = analysis.of(site.arg)
    return iv.within(-site.size, site.size - 1)


def _kind(analysis, site: IndexSite) -> str:
    """How the static check treats an index: "proven" in range by interval analysis, left to the
    kernel ("score") or to run-time checks ("values"), or "evaluate"d over the grid with torch."""
    if _in_range(analysis, site):
        return "proven"
    if "score" in site.deps:
        return "score"
    return "values" if "values" in site.deps else "evaluate"


def _static_verdict(lowered, shape) -> tuple[_Static, bool]:
    """The verdict that holds whatever the captured values are, and whether it may be kept."""
    sites = index_sites(lowered)
    out = _Static()
    if not sites:
        return out, True
    analysis = _analysis(lowered, shape, _static_range)
    sizes = dict(zip(_GRID, shape))
    todo = []
    for s in sites:
        kind = _kind(analysis, s)
        if kind == "proven":
            out.proven.append(s)
        elif kind == "score":
            out.skipped.append((s, "the index depends on the score, which is only known inside "
                                   "the kernel"))
        elif kind == "values":
            out.dynamic.append(s)
        else:
            todo.append(s)
    if todo:
        cost = math.prod(sizes[d] for d in _GRID if any(d in s.deps for s in todo))
        from flexcore._runtime import capturing
        if capturing():
            out.skipped += [(s, "inside a CUDA graph capture") for s in todo]
            return out, False
        if cost > STATIC_BUDGET:
            out.costly = todo
        else:
            bad = _evaluate(lowered, todo, sizes)
            if bad is None:
                out.checked.extend(todo)
            else:
                i, position, value = bad
                out.error = _error(lowered, todo[i], position, value, shape)
    return out, True


def decided_without_evaluation(lowered, B: int, H: int, L: int, S: int) -> bool:
    """Whether :func:`check_indices` decides ``lowered`` (a LoweredMod or None) on this grid
    without evaluating index expressions with torch: every index is proven by interval analysis
    or depends on the score or on captured values (which only run-time checks read). Such a
    check reads no tensor, so it also runs on fake tensors (flexcore.ops traces one so)."""
    if lowered is None or lowered.graph is None:
        return True
    sites = index_sites(lowered)
    if not sites:
        return True
    analysis = _analysis(lowered, (int(B), int(H), int(L), int(S)), _static_range)
    return all(_kind(analysis, s) != "evaluate" for s in sites)


def _lowered_of(mod, kind: str):
    from flexcore.lowering.api import LoweredMod, lower_mask_mod, lower_score_mod

    if mod is None or isinstance(mod, LoweredMod):
        return mod, None
    try:
        return (lower_score_mod(mod) if kind == "score" else lower_mask_mod(mod)), None
    except ModIndexError:
        raise  # a constant index out of range: proven at lowering
    except Exception as e:  # noqa: BLE001 - a mod that cannot be lowered is evaluated eagerly
        return None, e


def check_indices(mod, kind: str, B: int, H: int, L: int, S: int, *,
                  runtime: bool) -> IndexVerdict:
    """Raise ModIndexError when a mod would index a tensor out of range somewhere on the grid
    ``b < B, h < H, q_idx < L, kv_idx < S``; else say how that is known.

    Args:
        mod: a LoweredMod (from :func:`lower_score_mod` / :func:`lower_mask_mod`), the user's mod
            function (lowered here, through the same cache), or None.
        kind: ``"score"`` or ``"mask"`` (only used to lower a function).
        B, H, L, S: batch, query heads, query and key lengths of the call.
        runtime: also check the indices that depend on captured tensors' values (step 3 of the
            module docstring). Pass True on the CPU/interpreter path, in the reference, and on
            the GPU under ``KernelOptions(check_indices=True)``.

    Returns:
        IndexVerdict: which indices were proven, checked, or left unchecked and why.

    Raises:
        ModIndexError (a ModError and an IndexError): names the tensor (the user's variable where
        found), its size, the index expression, one offending position and the user's line.

    Cost: the proof and the value-independent checks run once per lowered mod and shape (a dict
    lookup afterwards). Run-time checks cost one min/max per captured tensor an index reads
    (a device sync on the GPU) and, where that does not prove the index, one torch evaluation
    of the index expressions over the positions they depend on; both are skipped while no
    captured tensor changed since the last check at this shape.
    """
    lowered, failure = _lowered_of(mod, kind)
    if lowered is None:
        if failure is None:
            return IndexVerdict()
        return IndexVerdict(unchecked=(f"the mod could not be lowered: {failure}",),
                            lowered=False)
    if lowered.graph is None:
        return IndexVerdict()
    shape = (int(B), int(H), int(L), int(S))
    with _lock:
        per_mod = _static.setdefault(lowered, {})
        static = per_mod.get(shape)
    if static is None:
        static, keep = _static_verdict(lowered, shape)
        if keep:
            with _lock:
                per_mod[shape] = static
    if static.costly and runtime:
        _check_costly(lowered, static, shape)
    if static.error is not None:
        raise static.error
    outcome = "none"
    if static.dynamic:
        outcome = "off" if not runtime else (
            "checked" if _runtime_check(lowered, static.dynamic, shape) else "deferred")
    verdict = static.verdicts.get(outcome)
    if verdict is None:
        verdict = static.verdicts[outcome] = _verdict(lowered, static, outcome)
    return verdict


_DYNAMIC_WHY = {"off": "its value depends on captured tensors and run-time checks are off",
                "deferred": "its value depends on captured tensors, which cannot be read inside "
                            "a CUDA graph capture"}


def _check_costly(lowered, static: _Static, shape) -> None:
    """Evaluate the value-independent sites that were too costly without run-time checks; the
    result is kept like any value-independent one."""
    from flexcore._runtime import capturing

    if capturing():
        return
    bad = _evaluate(lowered, static.costly, dict(zip(_GRID, shape)))
    with _lock:
        if bad is None:
            static.checked = static.checked + static.costly
        else:
            i, position, value = bad
            static.error = _error(lowered, static.costly[i], position, value, shape)
        static.costly = []
        static.verdicts = {}


def _verdict(lowered, static: _Static, outcome: str) -> IndexVerdict:
    unchecked = [f"{s.describe}: {why}" for s, why in static.skipped]
    unchecked += [f"{s.describe}: checking it costs more than {STATIC_BUDGET} evaluations, "
                  "which waits for run-time checks" for s in static.costly]
    checked = list(static.checked)
    if outcome == "checked":
        checked += static.dynamic
    elif outcome in _DYNAMIC_WHY:
        unchecked += [f"{s.describe}: {_DYNAMIC_WHY[outcome]}" for s in static.dynamic]
    if (static.skipped or static.costly) and not static.verdicts:
        warnings.warn(f"{lowered.mod_name}: some indices into tensors could not be checked "
                      f"before the kernel runs: {'; '.join(unchecked)}", stacklevel=3)
    return IndexVerdict(tuple(s.describe for s in static.proven),
                        tuple(s.describe for s in checked), tuple(unchecked))


def _runtime_check(lowered, sites, shape) -> bool:
    """Check the value-dependent sites now (raising on a bad index); False when it cannot be
    done (inside a CUDA graph capture)."""
    from flexcore._runtime import capturing

    versions = tuple(_version(t) for t in lowered.captured)
    with _lock:
        passed = _runtime_ok.setdefault(lowered, {})
        if None not in versions and passed.get(shape) == versions:
            return True
    if capturing():
        return False
    analysis = _analysis(lowered, shape, _value_range)
    todo = [s for s in sites if not _in_range(analysis, s)]
    if todo:
        bad = _evaluate(lowered, todo, dict(zip(_GRID, shape)))
        if bad is not None:
            i, position, value = bad
            raise _error(lowered, todo[i], position, value, shape)
    with _lock:
        passed[shape] = versions
    return True


