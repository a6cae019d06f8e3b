"""Trace a score_mod / mask_mod into a small aten graph with make_fx.

Captured tensors (closures, globals) become ``get_attr`` constants holding the user's own tensor
objects; every ``call_function`` node carries ``node.meta["flex_loc"]``: the user's file, line and
the torch function that produced it, so later errors can point at the user's source. Ops the code
generator has no handler for go through torch's own decompositions while tracing (silu becomes
x * sigmoid(x), gelu an erf expression), so the graph holds ops it lowers or refuses by name.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import sysconfig
from dataclasses import dataclass

import torch
from torch.fx import GraphModule
from torch.overrides import TorchFunctionMode

from flexcore._runtime import prepare_triton
from flexcore.errors import (ControlFlowError, ModError, ModIndexError, ModReturnError,
                             ModSignatureError)

_TORCH_DIR = os.path.dirname(torch.__file__)
_LOWERING_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]

#: Arguments each kind of mod takes, in order.
MOD_ARGS = {"score": ("score", "b", "h", "q_idx", "kv_idx"), "mask": ("b", "h", "q_idx", "kv_idx")}

_CONTROL_FLOW = {
    torch.Tensor.__bool__: "bool(tensor) (an `if`, `while`, `and`, `or` or `not` on a tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "using a tensor as a Python index or range bound",
    torch.Tensor.item: "tensor.item()",
    torch.Tensor.tolist: "tensor.tolist()",
    torch.Tensor.numpy: "tensor.numpy()",
}


def control_flow_message(what: str) -> str:
    """The ControlFlowError text for ``what`` (one of :data:`_CONTROL_FLOW`'s values)."""
    return (f"{what} needs the tensor's value, which is unknown while the mod is lowered to a "
            "kernel. Use tensor operations instead: torch.where(cond, a, b) for branches (combine "
            "conditions with &, |, ~ instead of and/or/not) and torch.* functions instead of math.*.")


@dataclass(frozen=True)
class Location:
    filename: str | None
    lineno: int | None


def mod_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<frozen"):
        return False
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_LOWERING_DIR)
                or path.startswith(_STDLIB_DIR))


def user_location_from_stack() -> Location:
    """The innermost frame of the caller's stack that belongs to user code."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        if _is_user_file(frame.f_code.co_filename):
            return Location(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return Location(None, None)


def user_location_from_traceback(tb) -> Location:
    """The innermost frame of a traceback that belongs to user code."""
    found = Location(None, None)
    while tb is not None:
        if _is_user_file(tb.tb_frame.f_code.co_filename):
            found = Location(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def definition_location(fn) -> Location:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return Location(None, None)
    return Location(code.co_filename, code.co_firstlineno)


_TORCH_C_MODULES = {"torch._C._special": "torch.special", "torch._C._nn": "torch.nn.functional",
                    "torch._C._linalg": "torch.linalg", "torch._C._fft": "torch.fft"}


def func_display_name(func) -> str:
    """``torch.sin`` / ``Tensor.sin`` / ``torch.special.erfinv`` for a torch function."""
    name = getattr(func, "__name__", None) or repr(func)
    if func in (getattr(torch.Tensor, name, None), getattr(torch._C.TensorBase, name, None)):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module in _TORCH_C_MODULES:
        module = _TORCH_C_MODULES[module]
        short = module.rsplit(".", 1)[-1] + "_"
        name = name[len(short):] if name.startswith(short) else name
    elif module.startswith("torch._C") or module.startswith("torch._tensor"):
        module = "torch"
    return f"{module}.{name}"


class _TraceError(Exception):
    """Carries a ModError out through make_fx, which may wrap exceptions raised inside it."""

    def __init__(self, error: ModError):
        super().__init__(str(error))
        self.error = error


class _OtherDevice(Exception):
    """A captured tensor lives on another device than the stand-ins: trace again on it."""

    def __init__(self, device: torch.device):
        super().__init__(f"captured tensor on {device}")
        self.device = device


def _captured_device(args, kwargs) -> torch.device | None:
    """The device of the first captured (real, not fake) tensor off the CPU among an op's
    arguments, or None."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu" and not is_fake(leaf):
            return leaf.device
    return None


class _LoweringMode(TorchFunctionMode):
    """Rewrites tensor indexing into ``aten.index.Tensor``, rejects Python control flow on tensors
    and tags the graph nodes each torch call creates with the user's source line.

    While ``find_device`` is set (the user's code runs on CPU stand-ins), a captured tensor off
    the CPU stops the trace (``_OtherDevice``): the stand-ins must live on the captured tensors'
    device, as torch's index tensors live on the query's, or ops that need one device
    (index_select) fail and the gradient's autograd graph spans two devices, whose engine threads
    then share one fake-tensor mode."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.find_device = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.find_device:
            device = _captured_device(args, kwargs)
            if device is not None:
                raise _OtherDevice(device)
        if func in _CONTROL_FLOW:
            loc = user_location_from_stack()
            raise _TraceError(ControlFlowError(
                control_flow_message(_CONTROL_FLOW[func]),
                mod_name=self.name, filename=loc.filename, lineno=loc.lineno,
                op=func_display_name(func)))
        graph = _current_graph()
        before = len(graph.nodes) if graph is not None else 0
        if func is torch.Tensor.__getitem__:
            out = _index(self.name, *args)
        else:
            out = func(*args, **kwargs)
        if graph is not None and len(graph.nodes) > before:
            loc = user_location_from_stack()
            shown = ("Tensor.__getitem__" if func is torch.Tensor.__getitem__
                     else func_display_name(func))
            for node in list(graph.nodes)[before:]:
                node.meta.setdefault("flex_loc", (loc.filename, loc.lineno, shown))
        return out


def _current_graph():
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def _index(name: str, tensor, index):
    """``tensor[index]`` as ``aten.index.Tensor`` (tensor and int indices, slices, ``None`` and
    ``...``): ``None`` becomes an unsqueeze and a slice an ``aten.slice`` before the index."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        at = items.index(Ellipsis)
        fill = tensor.dim() - (len(items) - 1 - sum(i is None for i in items))
        items[at:at + 1] = [slice(None)] * max(fill, 0)
    converted = []
    for pos, item in enumerate(items):
        if item is None:
            tensor = tensor.unsqueeze(pos)
            converted.append(None)
        elif isinstance(item, torch.Tensor):
            if item.dtype == torch.bool or item.is_floating_point():
                loc = user_location_from_stack()
                raise _TraceError(ModError(
                    f"indexing with a {item.dtype} tensor is not supported; index captured tensors "
                    "with integer expressions of b, h, q_idx, kv_idx.", mod_name=name,
                    filename=loc.filename, lineno=loc.lineno, op="Tensor.__getitem__"))
            converted.append(item)
        elif isinstance(item, bool) or not isinstance(item, (int, slice)):
            loc = user_location_from_stack()
            raise _TraceError(ModError(
                f"index {item!r} is not supported; use tensors, ints, slices, None or '...'.",
                mod_name=name, filename=loc.filename, lineno=loc.lineno, op="Tensor.__getitem__"))
        elif isinstance(item, int):
            converted.append(torch.full((), item, dtype=torch.int64, device=tensor.device))
        elif item == slice(None):
            converted.append(None)
        else:
            bounds = (item.start, item.stop, item.step)
            if any(not (b is None or isinstance(b, int)) for b in bounds):
                loc = user_location_from_stack()
                raise _TraceError(ModError(
                    f"slice {item!r} has tensor bounds; slices must have int bounds (the shape "
                    "of a value is fixed when the mod is lowered), so index the tensor with an "
                    "offset expression instead.", mod_name=name, filename=loc.filename,
                    lineno=loc.lineno, op="Tensor.__getitem__"))
            tensor = torch.ops.aten.slice.Tensor(tensor, pos, item.start, item.stop, item.step or 1)
            converted.append(None)
    while converted and converted[-1] is None:
        converted.pop()
    if not converted:
        return tensor
    return torch.ops.aten.index.Tensor(tensor, converted)


#: Decompositions outside torch's core set whose results the code generator handles.
_EXTRA_DECOMPOSITIONS = ("gelu", "elu", "leaky_relu", "hardtanh", "ldexp", "logsumexp",
                         "_softmax", "_log_softmax")


def _float_operands(a, b):
    """a and b as tensors of xlogy's result dtype (a Python number as a 0-d tensor)."""
    dtype = torch.result_type(a, b)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) else torch.scalar_tensor(t, dtype=dtype)
                 for t in (a, b))


def _safe_sinc(a):
    # The branch not taken gets an operand where it is finite (1): its gradient there is then
    # 0 · finite, not the 0 · NaN of sin(0)/0, and sinc'(0) = 0 as torch's own derivative says.
    zero = a == 0
    x = torch.where(zero, 1, a) * math.pi
    return torch.where(zero, 1, torch.sin(x) / x)


def _safe_xlog(log):
    def xlog(a, b):
        x, y = _float_operands(a, b)
        zero = x == 0
        # As _safe_sinc: log's operand is 1 (log1p's 0) where x is 0, so neither the value nor
        # the gradient of the branch not taken is -inf or NaN (torch's xlogy gives 0 there).
        safe = torch.where(zero, 0 if log is torch.log1p else 1, y)
        out = torch.where(zero, 0, x * log(safe))
        return torch.where(torch.isnan(y), math.nan, out)  # NaN in y wins, as in torch

    return xlog


def _safe_gradient_decompositions() -> dict:
    """Decompositions that replace torch's where its ``where`` form has a NaN gradient in the
    branch not taken (sinc and xlogy at 0): such a NaN reaches a captured tensor's gradient,
    0 · NaN, where torch's own derivative is finite."""
    aten = torch.ops.aten
    xlogy, xlog1py = _safe_xlog(torch.log), _safe_xlog(torch.log1p)
    return {aten.sinc.default: _safe_sinc,
            aten.xlogy.Tensor: xlogy, aten.xlogy.Scalar_Self: xlogy, aten.xlogy.Scalar_Other: xlogy,
            aten.special_xlog1py.default: xlog1py, aten.special_xlog1py.self_scalar: xlog1py,
            aten.special_xlog1py.other_scalar: xlog1py}


def decompositions() -> dict:
    """Decompositions applied while tracing: every op the code generator has no handler for,
    where torch's decomposition turns it into ops it has (silu -> mul, sigmoid; gelu -> erf ...)."""
    global _DECOMPOSITIONS
    if _DECOMPOSITIONS is None:
        from torch._decomp import core_aten_decompositions, decomposition_table

        from flexcore.lowering.codegen import handled_ops

        handled = handled_ops()
        table = {}
        extra = {op: fn for op, fn in decomposition_table.items()
                 if _packet_name(op) in _EXTRA_DECOMPOSITIONS}
        for op, fn in {**extra, **core_aten_decompositions()}.items():
            name = _packet_name(op)
            if name is not None and name not in handled:
                table[op] = fn
        table.update({op: fn for op, fn in _safe_gradient_decompositions().items() if op in table})
        _DECOMPOSITIONS = table
    return _DECOMPOSITIONS


_DECOMPOSITIONS = None


def _packet_name(op) -> str | None:
    packet = getattr(op, "overloadpacket", None)
    return None if packet is None else packet.__name__


def check_signature(fn, kind: str) -> None:
    """Raise ModSignatureError unless ``fn`` accepts the mod's positional arguments."""
    if not callable(fn):
        raise ModSignatureError(
            f"expected a {kind}_mod callable {MOD_ARGS[kind]}, got {type(fn).__name__}",
            mod_name=None)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature: find out when tracing
    try:
        sig.bind(*MOD_ARGS[kind])
    except TypeError as e:
        loc = definition_location(fn)
        n = len(MOD_ARGS[kind])
        raise ModSignatureError(
            f"a {kind}_mod takes {n} arguments {MOD_ARGS[kind]}, but its signature is "
            f"{mod_name(fn)}{sig} ({e}).", mod_name=mod_name(fn), filename=loc.filename,
            lineno=loc.lineno) from None


def _normalize_return(fn, kind: str, out, device: torch.device):
    """Python bools (mask) and numbers (score) become 0-d tensors; other non-tensors are errors."""
    if isinstance(out, torch.Tensor):
        return out
    if kind == "mask" and isinstance(out, bool):
        return torch.full((), out, dtype=torch.bool, device=device)
    if kind == "score" and isinstance(out, (int, float)) and not isinstance(out, bool):
        return torch.full((), float(out), dtype=torch.float32, device=device)
    loc = definition_location(fn)
    raise _TraceError(ModReturnError(
        _return_message(kind, type(out).__name__), mod_name=mod_name(fn), filename=loc.filename,
        lineno=loc.lineno))


def _return_message(kind: str, got: str) -> str:
    if kind == "mask":
        return (f"a mask_mod must return a bool tensor (True keeps the position), but it returned "
                f"{got}; return a comparison such as q_idx >= kv_idx, or cast with .bool().")
    return (f"a score_mod must return a float tensor (the modified score), but it returned {got}; "
            "use a mask_mod for boolean masks, or torch.where(cond, score, float('-inf')).")


def _check_output(gm: GraphModule, fn, kind: str) -> None:
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
    if val is None:
        return
    flex_loc = out.meta.get("flex_loc")
    loc = Location(*flex_loc[:2]) if flex_loc and flex_loc[1] else definition_location(fn)
    wrong_dtype = (val.dtype != torch.bool) if kind == "mask" else (
        val.dtype == torch.bool or val.is_complex())
    if wrong_dtype:
        raise ModReturnError(_return_message(kind, f"a {val.dtype} tensor"), mod_name=mod_name(fn),
                             filename=loc.filename, lineno=loc.lineno)
    if val.dim() != 0:
        raise ModReturnError(
            f"the {kind}_mod returns a tensor of shape {tuple(val.shape)} for one position; it "
            "must return a single value (index every dimension of captured tensors).",
            mod_name=mod_name(fn), filename=loc.filename, lineno=loc.lineno)


def stand_ins(kind: str, score_dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The 0-d tensors a mod is traced over: (score,) b, h, q_idx, kv_idx on ``device``."""
    args = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(4)]
    if kind == "score":
        args.insert(0, torch.zeros((), dtype=score_dtype, device=device))
    return args


def stand_in_device(gm: GraphModule) -> torch.device:
    """The device ``gm`` was traced on (its placeholders')."""
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


@contextlib.contextmanager
def saved_tensor_hooks_set_aside():
    """Without the saved-tensor hooks that are set (activation checkpointing sets them around the
    forward and its recomputation), restored after. A lowering's traces save nothing for the
    caller's autograd graph: under the hooks they would add saved tensors to a first call only
    (checkpointing's recomputation then counts fewer and fails), and torch.func refuses them."""
    hooks = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        hooks.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def trace_mod(fn, kind: str, score_dtype: torch.dtype = torch.float32) -> GraphModule:
    """Trace ``fn`` over 0-d tensors (score ``score_dtype``; b, h, q_idx, kv_idx int32) to an
    aten graph.

    The stand-ins live on the device of the tensors the mod captures (the CPU when it captures
    none), as torch evaluates a mod on the query's device: the trace starts on the CPU and starts
    again on that device when it meets a captured tensor elsewhere.

    Raises:
        ModError and its subclasses, with the user's file and line where known.
    """
    # make_fx imports triton; the interpreter must be chosen before triton's own @jit
    # functions (tl.zeros, ...) are decorated, or later kernels cannot call them.
    prepare_triton()
    check_signature(fn, kind)
    try:
        gm = _trace(fn, kind, score_dtype, torch.device("cpu"))
    except _OtherDevice as found:
        gm = _trace(fn, kind, score_dtype, found.device)
    _check_output(gm, fn, kind)
    return gm


def _trace(fn, kind: str, score_dtype: torch.dtype, device: torch.device) -> GraphModule:
    """make_fx of ``fn`` over stand-ins on ``device``; on the CPU, raises _OtherDevice where a
    captured tensor lives elsewhere."""
    from torch.fx.experimental.proxy_tensor import make_fx

    name = mod_name(fn)
    args = stand_ins(kind, score_dtype, device)

    mode = _LoweringMode(name)

    def traced(*a):
        # Only the user's own calls: make_fx's conversions to fake tensors go through meta tensors.
        mode.find_device = device.type == "cpu"
        try:
            out = fn(*a)
        finally:
            mode.find_device = False
        return _normalize_return(fn, kind, out, device)
    traced.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_ONLY) for p in MOD_ARGS[kind]])

    try:
        with mode, saved_tensor_hooks_set_aside():
            return make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=True,
                           decomposition_table=decompositions())(*args)
    except _OtherDevice:
        raise
    except _TraceError as e:
        raise e.error from None
    except Exception as e:  # noqa: BLE001 - anything the user's code raised is reported as theirs
        if isinstance(e.__cause__, _OtherDevice):
            raise e.__cause__ from None
        if isinstance(e.__cause__, _TraceError):
            raise e.__cause__.error from None
        if isinstance(e, ModError):
            raise
        loc = user_location_from_traceback(e.__traceback__)
        if isinstance(e, IndexError):
            raise ModIndexError(f"{e} (a constant index out of range)", mod_name=name,
                                filename=loc.filename, lineno=loc.lineno) from e
        if "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__:
            raise ControlFlowError(
                "the mod needs a tensor's value in Python (data-dependent control flow), which is "
                "unknown while it is lowered to a kernel. Use torch.where(cond, a, b) instead.",
                mod_name=name, filename=loc.filename, lineno=loc.lineno) from e
        raise ModError(f"{type(e).__name__} while tracing the mod: {e}", mod_name=name,
                       filename=loc.filename, lineno=loc.lineno) from e
