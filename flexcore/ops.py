"""flex_attention as torch custom ops: what ``torch.compile`` captures of a flexcore call.

Dynamo must not trace flexcore's host code (lowering with make_fx, code generation, launches), so
a call under ``torch.compile`` takes three steps while Dynamo traces it (flexcore/README.md,
"torch.compile"):

1. :func:`record` runs each mod once under a ``TorchFunctionMode`` on 0-d stand-ins of
   ``(score, b, h, q_idx, kv_idx)``. Dynamo inlines the mod and the mode, so what the mod reads
   reaches flexcore as Dynamo values with their sources: tensors (closure cells, globals, module
   parameters, values computed earlier in the model) and Python numbers. What the mod computes is
   kept as a program: the torch functions it called, with arguments that are constants or
   references to its inputs, earlier results, its tensors and its numbers.
2. :func:`register_call` is marked ``torch.compiler.assume_constant_result``: Dynamo runs it in
   Python (not traced) on the programs, which are Python constants, and puts its result, a string
   key into a process-level registry, in the graph as a constant.
3. ``flexcore::flex_attention_forward`` / ``flexcore::flex_attention_backward`` are custom ops
   with fake implementations and registered autograd, whose inputs are q, k, v, the BlockMask's
   tables, the mods' tensors and numbers, the key, and the learnable sinks (or None). At run time the programs are replayed on
   the numbers and lowered by the eager path's lowering (cached), so numbers are constants of the
   generated code as in an eager call, whether torch.compile kept them static or symbolic.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import operator
import threading
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from flexcore.blockmask import check_guards, check_recorded, recorded_versions
from flexcore.errors import ControlFlowError, InputError, ModError, UnsupportedOpError
from flexcore.lowering.indexcheck import decided_without_evaluation
from flexcore.lowering.trace import _CONTROL_FLOW, control_flow_message

__all__ = ["record", "register_call", "compiled_flex_attention", "flex_attention_forward",
           "flex_attention_backward", "flex_attention_sink_backward"]

_LN2 = math.log(2.0)
# Tags in recorded programs: a reference (_REF, where, index...) or a list (_LIST, items). The
# leading NUL keeps them apart from any tuple a mod could pass to a torch function.
_REF = "\x00ref"
_LIST = "\x00list"
_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


# ----------------------------------------------------------------------------------------------
# Recording a mod while Dynamo traces it
# ----------------------------------------------------------------------------------------------

def _index_list(tensor: Tensor, index) -> tuple[Tensor, list] | None:
    """``tensor[index]`` as ``aten.index(base, indices)``: ``base`` is ``tensor`` with the index's
    slices and ``None``s applied (basic indexing), ``indices`` the index list of ``aten.index``
    (tensors, and ``None`` for a dimension taken whole). None where the index holds no tensor or
    something else. Tensor indices must not become Python ints, as ``Tensor.__getitem__`` makes
    a 0-d one beside a slice: under Dynamo that reads a value not known while tracing."""
    items = list(index) if isinstance(index, tuple) else [index]
    tensors = [i for i in items if isinstance(i, Tensor)]
    if not tensors or any(t.dtype == torch.bool for t in tensors):
        return None
    if any(t.dim() for t in tensors) and any(isinstance(i, int) for i in items):
        # Beside a tensor of several positions, torch places the dimensions of Python ints' and
        # tensors' results its own way, not as the conversion here would; such an index reads no
        # 0-d value, so torch's own indexing serves it.
        return None
    if any(i is Ellipsis for i in items):
        at = items.index(Ellipsis)
        used = sum(i is not None for i in items) - 1
        items[at:at + 1] = [slice(None)] * max(tensor.dim() - used, 0)
    basic, converted = [], []
    for item in items:
        if isinstance(item, Tensor):
            basic.append(slice(None))
            converted.append(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            basic.append(slice(None))
            converted.append(torch.full((), item, dtype=torch.int64, device=tensor.device))
        elif isinstance(item, slice) or item is None:
            basic.append(item)
            converted.append(None)
        else:
            return None
    if any(b != slice(None) for b in basic):
        tensor = tensor[tuple(basic)]
    while converted and converted[-1] is None:
        converted.pop()
    return tensor, converted


class _Recorder(TorchFunctionMode):
    """Records the torch calls a mod makes on ``inputs``: each call's function and its arguments,
    as constants or references (to the inputs, to earlier results, to captured tensors, to
    numbers). Tensors that are none of the former are the mod's captured tensors, in the order it
    first reads them; Python ints and floats are kept apart, as values torch.compile may hold
    symbolically."""

    def __init__(self, inputs: list, wide: bool = False):
        super().__init__()
        self.inputs = inputs
        self.wide = wide  # stand-ins with extra dimensions (_untracked): products of vectors summed
        self.refused: str | None = None  # the first Python use of a tensor's value (_CONTROL_FLOW)
        self.results: list = []   # (tensor, its reference)
        self.captured: list = []
        self.ints: list = []
        self.floats: list = []
        self.steps: list = []

    def ref(self, x):
        if isinstance(x, Tensor):
            for i, t in enumerate(self.inputs):
                if x is t:
                    return (_REF, "in", i)
            for t, ref in self.results:
                if x is t:
                    return ref
            for i, t in enumerate(self.captured):
                if x is t:
                    return (_REF, "cap", i)
            self.captured.append(x)
            return (_REF, "cap", len(self.captured) - 1)
        if isinstance(x, bool):
            return x
        if isinstance(x, int):
            self.ints.append(x)
            return (_REF, "int", len(self.ints) - 1)
        if isinstance(x, float):
            self.floats.append(x)
            return (_REF, "float", len(self.floats) - 1)
        if isinstance(x, list):
            return (_LIST, tuple(self.ref(y) for y in x))
        if isinstance(x, tuple):
            return tuple(self.ref(y) for y in x)
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONTROL_FLOW:
            # As the eager lowering, refused; raised where the program is lowered (in the op, at
            # the first run), since an error raised while Dynamo traces would reach the user as
            # Dynamo's own. The trace goes on with a Python one (a symbolic value would fail in
            # Dynamo first; one survives the divisions and logarithms that follow such a use).
            self.refused = self.refused or _CONTROL_FLOW[func]
            one = _PYTHON_ONES.get(func)
            if one is not None:
                return one(args[0]) if callable(one) else one
        getitem = func is Tensor.__getitem__ and len(args) == 2
        index = _index_list(args[0], args[1]) if getitem else None
        if self.wide and func in _VECTOR_PRODUCTS and _vectors_widened(args):
            # A dot product of per-position vectors, (1, ..., D) here: what shapes follow is all
            # this recording reads, and a matmul of these would fail.
            out = (args[0] * args[1]).sum(-1)
        elif index is not None:
            out = torch.ops.aten.index(*index)
        else:
            out = func(*args, **kwargs)
        tensors = isinstance(out, Tensor) or (
            isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out))
        if tensors:  # other results (sizes, dtypes) are constants in the calls that use them
            step = len(self.steps)
            refs = tuple((k, self.ref(v)) for k, v in kwargs.items())
            self.steps.append((func, self.ref(args), refs))
            if isinstance(out, Tensor):
                self.results.append((out, (_REF, "val", step)))
            else:
                for j, o in enumerate(out):
                    if isinstance(o, Tensor):
                        self.results.append((o, (_REF, "item", step, j)))
        return out


_VECTOR_PRODUCTS = {torch.dot, Tensor.dot, torch.inner, Tensor.inner, torch.vdot, Tensor.vdot, torch.matmul,
                    Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__}


def _vectors_widened(args) -> bool:
    a, b = args[:2] if len(args) >= 2 else (None, None)
    return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() >= 2 and b.dim() >= 2
            and a.shape[-1] != b.shape[-2])


# What a refused Python use of a tensor's value gives the rest of a recording.
_PYTHON_ONES = {Tensor.__bool__: True, Tensor.__int__: 1, Tensor.__index__: 1, Tensor.__float__: 1.0,
                Tensor.item: lambda t: True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1}


class Recorded(NamedTuple):
    """A recorded mod: ``constants`` = (program, meta, name) are Python constants (what
    register_call receives), the rest are the values the mod read (op inputs).

    ``program`` is (steps, output reference), plus what the mod did that the lowering refuses
    (a tensor's value used in Python, :data:`flexcore.lowering.trace._CONTROL_FLOW`); ``meta``
    holds (dtype, shape, gets a gradient) per captured tensor; ``name`` is the mod's ``__name__``.
    """

    constants: tuple
    captured: list
    ints: list
    floats: list


# A recording's refusal (program[2]) where the mod computed a tensor that the recorder did not see.
_UNTRACKED = "\x00untracked"
UNTRACKED_MESSAGE = (
    "the mod computes a tensor that torch.compile does not show to flexcore (Python's builtin "
    "abs() on a tensor, and attributes such as .data or .T of a 0-d one, are evaluated by "
    "torch.compile itself), so the compiled kernel would read it as a constant. Use torch.abs or "
    "the tensor's own methods (x.abs(), x.detach()) instead")


def _recorded_once(mod, kind: str, score_dtype: torch.dtype, device: torch.device, dims: int = 0):
    shape = (1,) * dims
    inputs = [torch.zeros(shape, dtype=torch.int32, device=device) for _ in range(4)]
    if kind == "score":
        inputs.insert(0, torch.zeros(shape, dtype=score_dtype, device=device))
    recorder = _Recorder(inputs, wide=dims > 0)
    with recorder:
        out = mod(*inputs)
    return recorder, out


def _untracked(mod, kind: str, score_dtype: torch.dtype, device: torch.device, captured: list) -> bool:
    """Whether a mod traced by Dynamo computed from its arguments a tensor that the recorder did
    not see: Dynamo evaluates some builtins and attributes of tensors (abs(), ``.T``) without the
    recorder's mode, so their results pass for captured tensors. Those of captured tensors alone
    are (``table.T``); those of the arguments are not. A captured tensor is the same object in
    a second recording; a result that is not, in a third over stand-ins with one more dimension
    than any captured tensor, has a broadcast shape that differs where it read an argument. A
    0-d one that is not is refused as well: a reduction of the arguments (``abs(x.sum())``) has
    that shape in every recording (a 0-d captured tensor's ``abs()`` is refused with it)."""
    again, _ = _recorded_once(mod, kind, score_dtype, device)
    if len(again.captured) != len(captured):
        return True
    fresh = [t for a, t in zip(again.captured, captured) if a is not t]
    if not fresh:
        return False
    if any(t.dim() == 0 for t in fresh):
        return True
    dims = 1 + max([t.dim() for t in captured] + [0])
    wider, _ = _recorded_once(mod, kind, score_dtype, device, dims)
    return len(wider.captured) != len(captured) or any(
        a is not b and tuple(a.shape) != tuple(b.shape) for a, b in zip(wider.captured, captured))


def record(mod, kind: str, score_dtype: torch.dtype, device: torch.device) -> Recorded:
    """Run ``mod`` on 0-d stand-ins of its arguments and record what it computes."""
    recorder, out = _recorded_once(mod, kind, score_dtype, device)
    program = (tuple(recorder.steps), recorder.ref(out))
    if recorder.refused is not None:
        program += (recorder.refused,)
    elif torch.compiler.is_compiling() and _untracked(mod, kind, score_dtype, device, recorder.captured):
        program += (_UNTRACKED,)
    if torch.compiler.is_compiling():
        # The lowering reads captured shapes (index wrapping, per-element indexing): they are
        # specialised, with guards, under dynamic shapes too.
        for t in recorder.captured:
            torch._dynamo.mark_static(t)
    # operator.index specialises a size that Dynamo keeps symbolic (a tensor computed in the
    # compiled function, whose mark_static has no effect); int() would leave it symbolic.
    meta = tuple((t.dtype, tuple(operator.index(s) for s in t.shape),
                  bool(t.requires_grad and t.is_floating_point())) for t in recorder.captured)
    name = getattr(mod, "__name__", None)
    if not isinstance(name, str):  # a bound method's name, under some torch versions
        name = f"{kind}_mod"
    return Recorded((program, meta, name), recorder.captured, recorder.ints, recorder.floats)


def _resolve(spec, inputs, results, values):
    if isinstance(spec, tuple):
        if spec and spec[0] == _REF:
            where = spec[1]
            if where == "in":
                return inputs[spec[2]]
            if where == "val":
                return results[spec[2]]
            if where == "item":
                return results[spec[2]][spec[3]]
            return values[where][spec[2]]
        if spec and spec[0] == _LIST:
            return [_resolve(s, inputs, results, values) for s in spec[1]]
        return tuple(_resolve(s, inputs, results, values) for s in spec)
    return spec


def replay(program, name: str, captured, ints=(), floats=()):
    """The mod a program was recorded from, as a function of its arguments, reading ``captured``
    (in the program's order) where the mod read its tensors and ``ints``/``floats`` where it
    read numbers."""
    steps, out = program[:2]
    values = {"cap": captured, "int": ints, "float": floats}

    def replayed(*inputs):
        results = []
        for func, args, kwargs in steps:
            results.append(func(*_resolve(args, inputs, results, values),
                                **{k: _resolve(v, inputs, results, values) for k, v in kwargs}))
        return _resolve(out, inputs, results, values)

    replayed.__name__ = replayed.__qualname__ = name if isinstance(name, str) else "mod"
    return replayed


# ----------------------------------------------------------------------------------------------
# The registry of recorded calls, lowered per set of numbers
# ----------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Lowered:
    """A call's mods lowered for one set of numbers.

    Attributes:
        score, mask: LoweredMods whose ``captured`` are stand-ins (:meth:`CallSpec.bind` puts the
            call's tensors in their place).
        score_order, mask_order: for each of ``score.captured`` (``mask.captured``), the index of
            its tensor among the recorded ones.
        score_fn: the score_mod replayed on the stand-ins (its gradient is lowered from it).
    """

    score: object
    score_order: tuple
    score_fn: object
    mask: object
    mask_order: tuple
    score_bwd: object = None


@dataclass(eq=False)
class CallSpec:
    """What a compiled call fixes: the recorded mods, the query's dtype and the kernel options.

    Attributes:
        key: the registry key.
        dtype: the query's dtype.
        score, mask: ``Recorded.constants`` of the score_mod and the mask_mod, or None.
        score_grads: recorded indices of the score_mod's tensors that get a gradient.
        opts: KernelOptions. want_max: the call returns max_scores.
    """

    key: str
    dtype: torch.dtype
    score: tuple | None
    mask: tuple | None
    score_grads: tuple
    opts: object
    want_max: bool
    _lowered: dict = field(default_factory=dict, repr=False)

    def lowered(self, numbers: tuple) -> Lowered:
        """The mods lowered for ``numbers`` ((score ints, score floats, mask ints, mask floats)),
        lowered once per distinct set."""
        found = self._lowered.get(numbers)
        if found is None:
            found = _in_own_thread(self._lower, numbers)
            with _lock:
                if len(self._lowered) >= _LOWERED_PER_CALL:  # a number that changes at every step
                    self._lowered.pop(next(iter(self._lowered)))
                self._lowered.setdefault(numbers, found)
        return found

    def _lower(self, numbers) -> Lowered:
        score_ints, score_floats, mask_ints, mask_floats = numbers
        score_dtype = _score_dtype_of(self.dtype)
        fast_math = self.dtype in (torch.float16, torch.bfloat16)
        with _without_lines():
            score, score_order, score_fn = _lower("score", self.score, score_ints, score_floats,
                                                  score_dtype, fast_math)
            mask, mask_order, _ = _lower("mask", self.mask, mask_ints, mask_floats, score_dtype, False)
        return Lowered(score, score_order, score_fn, mask, mask_order)

    def bind(self, lowered: Lowered, score_caps, mask_caps):
        """(score, mask) LoweredMods reading the call's captured tensors."""
        score, mask = lowered.score, lowered.mask
        if lowered.score_order:
            score = dataclasses.replace(
                score, captured=tuple(score_caps[i] for i in lowered.score_order))
        if lowered.mask_order:
            mask = dataclasses.replace(mask, captured=tuple(mask_caps[i] for i in lowered.mask_order))
        return score, mask

    def score_backward(self, lowered: Lowered):
        """The score_mod's lowered gradient (flexcore.lowering.vjp), lowered once."""
        if lowered.score_bwd is None:
            from flexcore.lowering.vjp import lower_score_mod_backward

            with _without_lines():
                lowered.score_bwd = _in_own_thread(lower_score_mod_backward, lowered.score_fn,
                                                   lowered.score, _score_dtype_of(self.dtype))
        return lowered.score_bwd


@contextlib.contextmanager
def _without_lines():
    """A ModError from lowering a replayed program names the mod and the op, not a line: the
    program has none of the user's."""
    try:
        yield
    except ModError as error:
        extra = {name: getattr(error, name) for name in _INDEX_ERROR_FIELDS if hasattr(error, name)}
        message = error.message.split("\n", 1)[0]  # a quoted source line would be the replay's
        # A refusal of the compiled path alone (_COMPILE_ONLY): an eager call runs the mod.
        hint = "" if getattr(error, _COMPILE_ONLY, False) else "; call it eagerly to see the line"
        raise type(error)(f"{message} (in a call compiled by torch.compile{hint})", mod_name=error.mod_name,
                          op=error.op, **extra) from None


_COMPILE_ONLY = "compile_only"


def _compile_only(error: ModError) -> ModError:
    setattr(error, _COMPILE_ONLY, True)
    return error


_INDEX_ERROR_FIELDS = ("tensor", "size", "dim", "expression", "position", "value")


def _score_dtype_of(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_calls: dict[str, CallSpec] = {}
_lock = threading.Lock()
_LOWERED_PER_CALL = 64


def _stand_ins(meta) -> list[Tensor]:
    """One tensor per captured tensor with its dtype, shape and requires_grad, holding one
    element (stride 0): the lowering reads only those."""
    return [torch.empty_strided(shape, (0,) * len(shape), dtype=dtype).requires_grad_(grad)
            for dtype, shape, grad in meta]


def _lower(kind: str, recorded, ints, floats, score_dtype: torch.dtype, fast_math: bool):
    """(LoweredMod on stand-ins, order, replayed fn) of a recorded mod (None: the trivial mod)."""
    from flexcore.lowering import lower_mask_mod, lower_score_mod

    if recorded is None:
        lowered = lower_score_mod(None) if kind == "score" else lower_mask_mod(None)
        return lowered, (), None
    program, meta, name = recorded
    if len(program) > 2:
        if program[2] == _UNTRACKED:
            raise _compile_only(UnsupportedOpError(UNTRACKED_MESSAGE, mod_name=name))
        raise ControlFlowError(control_flow_message(program[2]), mod_name=name)
    stand_ins = _stand_ins(meta)
    fn = replay(program, name, stand_ins, ints, floats)
    if kind == "score":
        lowered = lower_score_mod(fn, score_dtype, fast_math=fast_math)
    else:
        lowered = lower_mask_mod(fn)
    position = {id(t): i for i, t in enumerate(stand_ins)}
    for t in lowered.captured:
        if id(t) not in position:
            raise _compile_only(UnsupportedOpError(
                f"the mod builds a tensor of shape {tuple(t.shape)} from Python values "
                "(torch.tensor([...]) or similar) and indexes it: under torch.compile flexcore's "
                "kernels read only tensors made outside the mod. Make it once outside the mod, on "
                "the query's device, and read it there", mod_name=name))
    return lowered, tuple(position[id(t)] for t in lowered.captured), fn


def _in_own_thread(fn, *args):
    """``fn(*args)`` in a new thread: away from the tracing state that torch keeps per thread
    (torch.compile's tracing context and fake tensor mode, which make_fx would otherwise join,
    and the dispatch state of a running op)."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = error

    worker = threading.Thread(target=run, name="flexcore-lowering")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


@torch.compiler.assume_constant_result
def register_call(score, mask, dtype: torch.dtype, device_type: str, kernel_options,
                  want_max: bool) -> str:
    """Keep a recorded call in the registry and return its key (which Dynamo keeps in the graph
    as a constant). The key is a hash of the call's constants, the same in every process.

    Args:
        score, mask: ``Recorded.constants`` of the score_mod and of the mask_mod, or None.
        dtype: the query's dtype. device_type: the query's device type.
        kernel_options: as flex_attention takes it (a dict as a tuple of its items).
        want_max: the call returns max_scores.
    """
    from flexcore._runtime import use_interpreter
    from flexcore.options import KernelOptions

    if device_type != "cuda" and not use_interpreter():
        raise InputError(f"flexcore's kernels run on CUDA tensors on this machine; query is on "
                         f"{device_type}. Move the inputs with .cuda(), or use flexcore.reference")
    kernel_options = _rebuilt(kernel_options)
    if isinstance(kernel_options, tuple):  # a dict's items
        kernel_options = dict(kernel_options)
    opts = KernelOptions.from_any(kernel_options)
    score_grads = () if score is None else tuple(i for i, (_, _, grad) in enumerate(score[1]) if grad)
    text = repr((_describe(score), _describe(mask), str(dtype), opts, want_max))
    key = "flexcore-" + hashlib.sha256(text.encode()).hexdigest()[:32]
    with _lock:
        if key not in _calls:
            _calls[key] = CallSpec(key, dtype, score, mask, score_grads, opts, want_max)
    return key


_DATACLASS = "\x00dataclass"


def _plain(kernel_options):
    """``kernel_options`` in a form Dynamo passes to :func:`register_call` as a constant: a dict
    as its items, with a dataclass value (a DispatchPolicy) as (tag, its class, its fields'
    items), which Dynamo cannot rebuild itself; :func:`_rebuilt` undoes it. A KernelOptions
    takes the dataclass form too (torch 2.11's Dynamo cannot pass a frozen dataclass instance as
    a constant); None passes unchanged."""
    if isinstance(kernel_options, dict):
        return tuple((k, _plain_value(v)) for k, v in kernel_options.items())
    return _plain_value(kernel_options)


def _plain_value(value):
    # Options are constants of a call (tiles, stages): an int that Dynamo made symbolic (one that
    # changed between compiles; it passes isinstance(int) while traced) is specialised to its
    # value by operator.index, where int() would keep it symbolic.
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return operator.index(value)
    if isinstance(value, tuple):
        return tuple(_plain_value(v) for v in value)
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (_DATACLASS, type(value),
                tuple((f.name, _plain_value(getattr(value, f.name))) for f in dataclasses.fields(value)))
    return value


def _rebuilt(value):
    """Undoes :func:`_plain` (and :func:`_plain_value`), tuples included."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] == _DATACLASS:
        return value[1](**{name: _rebuilt(v) for name, v in value[2]})
    if isinstance(value, tuple):
        return tuple(_rebuilt(v) for v in value)
    return value


def _describe(constants) -> str:
    """A text of a recorded mod that is the same in every process: functions by their module
    and name (a default repr shows an address)."""
    def text(x):
        if isinstance(x, tuple):
            return "(" + ", ".join(text(y) for y in x) + ")"
        if callable(x):
            owner = getattr(x, "__objclass__", None)
            return ".".join(filter(None, (getattr(x, "__module__", None),
                                          getattr(owner, "__qualname__", None),
                                          getattr(x, "__qualname__", None) or repr(x))))
        return repr(x)

    return "None" if constants is None else text(constants)


def spec_of(key: str) -> CallSpec:
    spec = _calls.get(key)
    if spec is None:
        raise RuntimeError(f"flexcore: no recorded call under the key {key!r}. Keys are made while "
                           "torch.compile traces flex_attention in this process; a graph loaded "
                           "from a cache needs the model traced again (call the compiled model).")
    return spec


# ----------------------------------------------------------------------------------------------
# The BlockMask a call's tables belong to
# ----------------------------------------------------------------------------------------------

_MASKS_PER_TABLE = 4


def block_mask_of(spec: CallSpec, lowered: Lowered, tables, block, mask_caps, numbers,
                  query: Tensor, key: Tensor):
    """The flexcore BlockMask of the op's tables: the all-full mask without tables, else one
    rebuilt around them. The rebuilt mask is kept on its kv_num_blocks table (it leaves with the
    table), so that a repeated call finds the same object and flexcore's per-mask caches (views,
    launch orders, transposed and finer tables, plans) apply as in eager calls."""
    from flexcore import attention

    if tables[0] is None:
        return attention.full_block_mask(query.shape[2], key.shape[2], query.device)
    holder = tables[0]
    block = tuple(block)
    # The record of the user's mask: a mask built anew over refilled tables gets a new one, and
    # the per-mask caches of the old contents (schedules, statistics) are not reused.
    ident = (lowered.mask.key, block, numbers[2:], tuple(map(id, tables)), tuple(map(id, mask_caps)),
             recorded_versions(tuple(tables)))
    kept = holder.__dict__.get("_flexcore_masks")
    if kept is not None:
        mask = kept.get(ident)
        if mask is not None:
            return mask._within(query.shape[2], key.shape[2])
    else:
        kept = holder.__dict__["_flexcore_masks"] = {}
    from flexcore.blockmask import BlockMask

    program, _, name = spec.mask
    # The tables are the user's mask's own (or copies of them in a CUDA graph's static inputs):
    # checked when that mask was built, so their contents are not read again.
    mask = BlockMask._trusted(record="no", seq_lengths=block[2:], BLOCK_SIZE=block[:2],
                              mask_mod=replay(program, name, list(mask_caps), *numbers[2:]),
                              **dict(zip(_TABLES, tables)))
    if len(kept) >= _MASKS_PER_TABLE:
        kept.pop(next(iter(kept)))
    kept[ident] = mask
    return mask._within(query.shape[2], key.shape[2])


class _Prepared:
    """An op call's host work for one set of inputs: what :func:`_prepare` returns, and the
    tensors it was made for (held, so that their ids in the key stay theirs; the table that
    keeps the entry is not held by it)."""

    __slots__ = ("result", "held", "checked")

    def __init__(self, result: tuple, held: tuple, checked: bool):
        self.result, self.held, self.checked = result, held, checked


_prepared_calls: dict = {}  # calls without tables (no mask)
_CALLS_LIMIT = 64
_PREPARED_PER_HOLDER = 8


def _prepare(call, tables, block, score_caps, mask_caps, numbers, query, key):
    """(spec, lowered, BlockMask, score LoweredMod, mask LoweredMod) of an op call.

    A training step calls the op with the same key, numbers, BlockMask tables, captured tensors
    and shapes every time: that call's result is kept (on the kv_num_blocks table, so it leaves
    with the mask, or in a small module cache without one) and found with one dict lookup. Index
    checks that read captured values still run at every call where they apply."""
    holder = tables[0]
    # Tables edited in place since the user's mask was built are refused, as in eager calls.
    recorded = None if holder is None else recorded_versions(tuple(tables))
    if recorded is not None:
        check_recorded(tables, recorded)
    if holder is not None:  # as an eager call's check_unmodified runs them
        check_guards(tables[1])
    ident = (call, numbers, *block, *map(id, tables), *map(id, score_caps), *map(id, mask_caps),
             *query.shape, *key.shape, recorded)
    kept = _prepared_calls if holder is None else holder.__dict__.get("_flexcore_prepared")
    entry = None if kept is None else kept.get(ident)
    if entry is None:
        entry = _prepare_new(call, tables, block, score_caps, mask_caps, numbers, query, key)
        if kept is None:
            kept = holder.__dict__["_flexcore_prepared"] = {}
        if len(kept) >= (_CALLS_LIMIT if holder is None else _PREPARED_PER_HOLDER):
            kept.pop(next(iter(kept)))
        kept[ident] = entry
    elif not entry.checked:
        spec, _, _, score, mask = entry.result
        _check_indices(spec, score, mask, query, key)
    return entry.result


def _check_indices(spec: CallSpec, score, mask, query: Tensor, key: Tensor) -> None:
    """attention.check_indices of bound mods on the call's grid, with the compiled call's error
    text (:func:`_without_lines`)."""
    from flexcore import attention

    with _without_lines():
        attention.check_indices(score, mask, query.shape[0], query.shape[1], query.shape[2],
                                key.shape[2], spec.opts)


def _prepare_new(call, tables, block, score_caps, mask_caps, numbers, query, key) -> _Prepared:
    from flexcore import attention
    from flexcore._runtime import use_interpreter

    attention.ready()
    spec = spec_of(call)
    lowered = spec.lowered(numbers)
    block_mask = block_mask_of(spec, lowered, tables, block, mask_caps, numbers, query, key)
    score, mask = spec.bind(lowered, score_caps, mask_caps)
    attention.check_captured_values(query.device, score, mask)
    _check_indices(spec, score, mask, query, key)
    # Checks that read captured values run at every call (the interpreter, check_indices=True);
    # the rest depend only on what the key fixes, so they are done.
    checked = not (use_interpreter() or spec.opts.check_indices)
    return _Prepared((spec, lowered, block_mask, score, mask),
                     (tuple(tables[1:]), tuple(score_caps), tuple(mask_caps)), checked)


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------

_INPUTS = (", ".join(f"Tensor? {name}" for name in _TABLES)
           + ", Tensor[] score_captured, Tensor[] mask_captured, SymInt[] score_ints, "
             "float[] score_floats, SymInt[] mask_ints, float[] mask_floats, SymInt[] block, "
             "str call, float scale")
_N_AFTER_TABLES = len(_INPUTS.split(",")) - len(_TABLES)  # the inputs after the tables in _INPUTS


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Under mode="reduce-overhead" the ops run between the CUDA graphs, not inside them: their first
# call per mask reads table statistics back to the host and builds tables (finer tables, launch
# orders, union lists) that are cached beyond the call, which a graph's memory pool cannot hold.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


# The ops are defined with torch.library directly, not with torch.library.custom_op: its wrappers
# (an aliasing check over every input and output, a dynamo-disable frame) cost more host time per
# call than a small attention call's kernels take, and the outputs here are always fresh tensors.
_lib = torch.library.Library("flexcore", "DEF")
# ``sinks``: (Hq,) learnable sinks or None (flexcore.sinks); out, lse and row_stats include them.
_lib.define(f"flex_attention_forward(Tensor query, Tensor key, Tensor value, {_INPUTS}, "
            f"Tensor? sinks=None) -> (Tensor, Tensor, Tensor)", tags=_TAGS)
# With ``sinks`` (and the forward's ``lse``, which includes them) the last output is [dL/dsinks],
# else [].
_lib.define(f"flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, "
            f"Tensor row_stats, Tensor grad_out, Tensor? grad_lse, {_INPUTS}, Tensor? lse=None, "
            f"Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor[], Tensor[])", tags=_TAGS)
_lib.define(f"flex_attention_sink_backward(Tensor query, Tensor key, Tensor value, Tensor out, "
            f"Tensor row_stats, Tensor grad_out, Tensor? grad_lse, {_INPUTS}, Tensor lse, "
            f"Tensor sinks) -> Tensor", tags=_TAGS)
_SINKS_INPUT = 3 + len(_TABLES) + _N_AFTER_TABLES  # the forward op's ``sinks``


def flex_attention_forward(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks,
                           full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks,
                           full_q_indices, score_captured, mask_captured, score_ints, score_floats,
                           mask_ints, mask_floats, block, call, scale, sinks=None):
    """(out, lse, row_stats) of a registered call (flexcore.kernels.forward.forward's contract;
    the decoding kernel's row_stats are derived from its lse and row max). ``sinks`` are taken
    in by the forward kernel's epilogue; the decode kernel takes none, so its (out, lse) get them
    here (flexcore.sinks.apply_sinks) before its row_stats are derived: either way the row
    statistics include the sink, which the backward kernels need (the sink column has no value)."""
    from flexcore import attention

    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks,
              q_indices, full_q_num_blocks, full_q_indices)
    numbers = (tuple(score_ints), tuple(score_floats), tuple(mask_ints), tuple(mask_floats))
    attention.check_scale_value(scale)
    spec, _, block_mask, score, mask = _prepare(call, tables, block, score_captured, mask_captured,
                                                numbers, query, key)
    B, Hq = query.shape[:2]
    if sinks is not None and sinks.device.type == "cpu":  # free here, as in an eager call
        from flexcore.sinks import check_finite_sinks

        check_finite_sinks(sinks)
    in_kernel = sinks is not None and attention.sinks_in_kernel(query, spec.opts)
    out, lse, row_stats, max_scores = attention.forward_kernels(
        query, key, value, score, mask, attention.kv_blocks(block_mask, B, Hq), scale, spec.opts,
        spec.want_max, sinks=sinks if in_kernel else None)
    if sinks is not None and not in_kernel:  # the decode kernel: before its row statistics
        from flexcore.sinks import apply_sinks

        out, lse = apply_sinks(out, lse, sinks)
    if row_stats is None:
        row_stats = attention.decode_row_stats(lse, max_scores)
    return out, lse, row_stats


_lib.impl("flex_attention_forward", flex_attention_forward, "CompositeExplicitAutograd")


@torch.library.register_fake("flexcore::flex_attention_forward", lib=_lib)
def _forward_fake(query, key, value, *rest):
    from flexcore import attention

    attention.ready()
    from flexcore.kernels.forward import output_strides

    B, Hq, L = query.shape[:3]
    shape = (B, Hq, L, value.shape[-1])
    # The kernels' own layout rule (the query's stride order); its cache cannot key symbolic sizes.
    strides = getattr(output_strides, "__wrapped__", output_strides)(shape, tuple(query.stride()))
    acc = _acc_dtype(query.dtype)
    return (query.new_empty_strided(shape, strides), query.new_empty((B, Hq, L), dtype=acc),
            query.new_empty((2, B, Hq, L), dtype=acc))


def flex_attention_backward(query, key, value, out, row_stats, grad_out, grad_lse, kv_num_blocks,
                            kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
                            full_q_num_blocks, full_q_indices, score_captured, mask_captured,
                            score_ints, score_floats, mask_ints, mask_floats, block, call, scale,
                            lse=None, sinks=None):
    """(dq, dk, dv, gradients of the score_mod's tensors that get one, in
    ``CallSpec.score_grads`` order, [dL/dsinks] or []). With ``sinks`` (``lse``: the forward's,
    which includes them) the kernels also return the rows' delta, from which
    flexcore.sinks.sink_gradient gives the sinks' gradient, as in an eager call."""
    from flexcore import attention
    from flexcore.sinks import sink_gradient

    spec, lowered, bound = _backward_bound(
        query, key, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
                     full_q_num_blocks, full_q_indices),
        block, score_captured, mask_captured, (score_ints, score_floats, mask_ints, mask_floats), call)
    dq, dk, dv, grads, *delta = attention.backward_kernels(
        query, key, value, out, row_stats, grad_out, grad_lse, *bound, scale, spec.opts,
        return_delta=sinks is not None)
    sink_grads = [] if sinks is None else [sink_gradient(lse, sinks, delta[0])]
    return dq, dk, dv, _captured_grads_in_call_order(spec, lowered, score_captured, grads), sink_grads


_lib.impl("flex_attention_backward", flex_attention_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("flexcore::flex_attention_backward", lib=_lib)
def _backward_fake(query, key, value, out, row_stats, grad_out, grad_lse, *rest):
    score_captured, call = rest[len(_TABLES)], rest[len(_TABLES) + _N_AFTER_TABLES - 2]
    sinks = rest[-1] if len(rest) > len(_TABLES) + _N_AFTER_TABLES else None
    spec = spec_of(call)
    contiguous = torch.contiguous_format
    return (torch.empty_like(query, memory_format=contiguous),
            torch.empty_like(key, memory_format=contiguous),
            torch.empty_like(value, memory_format=contiguous),
            [torch.empty_like(score_captured[i], memory_format=contiguous) for i in spec.score_grads],
            [] if sinks is None else [torch.empty_like(sinks, memory_format=contiguous)])


def flex_attention_sink_backward(query, key, value, out, row_stats, grad_out, grad_lse,
                                 kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                 q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                                 score_captured, mask_captured, score_ints, score_floats, mask_ints,
                                 mask_floats, block, call, scale, lse, sinks):
    """dL/dsinks alone, for a backward where only the sinks learn: the rows' delta without a
    gradient kernel (flexcore.kernels.backward.row_deltas), then flexcore.sinks.sink_gradient."""
    from flexcore import attention
    from flexcore.sinks import sink_gradient

    spec, _, bound = _backward_bound(
        query, key, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
                     full_q_num_blocks, full_q_indices),
        block, score_captured, mask_captured, (score_ints, score_floats, mask_ints, mask_floats), call)
    delta = attention.row_delta_kernels(query, key, value, out, row_stats, grad_out, grad_lse, *bound, scale,
                                        spec.opts)
    return sink_gradient(lse, sinks, delta)


def _backward_bound(query, key, tables, block, score_captured, mask_captured, number_lists, call):
    """(spec, lowered, (score, score's backward, mask, BlockMask, kv BlockTensors)) of a backward
    op call: the mods bound to its tensors, as the backward kernels take them."""
    from flexcore import attention

    numbers = tuple(tuple(x) for x in number_lists)
    spec, lowered, block_mask, score, mask = _prepare(call, tables, block, score_captured,
                                                      mask_captured, numbers, query, key)
    B, Hq = query.shape[:2]
    return spec, lowered, (score, spec.score_backward(lowered), mask, block_mask,
                           attention.kv_blocks(block_mask, B, Hq))


_lib.impl("flex_attention_sink_backward", flex_attention_sink_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("flexcore::flex_attention_sink_backward", lib=_lib)
def _sink_backward_fake(*args):
    return torch.empty_like(args[-1], memory_format=torch.contiguous_format)


def _grad_of_list(values):
    """The gradient of a list input that has none: torch.library takes a list of tensors (an
    empty list is one) to have a list gradient, and a list of numbers a None."""
    return [None] * len(values) if all(isinstance(v, Tensor) for v in values) else None


def _setup_context(ctx, inputs, output):
    query, key, value = inputs[:3]
    tables = inputs[3:3 + len(_TABLES)]
    rest = inputs[3 + len(_TABLES):]
    score_captured, mask_captured = rest[0], rest[1]
    # flexcore's forward op has ``sinks`` after the inputs that it shares with the inline op.
    sinks = rest[_N_AFTER_TABLES] if len(rest) > _N_AFTER_TABLES else None
    out, lse, row_stats = output
    ctx.mark_non_differentiable(row_stats)
    # An output without a gradient reaches the backward as None, not as zeros: under torch.compile a
    # materialised zero gradient is one more kernel launch per step.
    ctx.set_materialize_grads(False)
    # The sinks' gradient reads the forward's lse (p_sink = exp(sink - lse)).
    ctx.save_for_backward(query, key, value, out, row_stats, *[t for t in tables if t is not None],
                          *score_captured, *mask_captured, *(() if sinks is None else (lse, sinks)))
    ctx.present = tuple(t is not None for t in tables)
    ctx.counts = (len(score_captured), len(mask_captured))
    ctx.has_sinks = sinks is not None
    ctx.rest = rest[2:_N_AFTER_TABLES]  # numbers, block, call, scale


def _backward(ctx, grad_out, grad_lse, _grad_row_stats, op=None):
    """The forward ops' registered backward: ``op`` (default flexcore's backward op) on the saved
    inputs; where only the sinks learn, flexcore's sink backward op instead."""
    saved = list(ctx.saved_tensors)
    query, key, value, out, row_stats = saved[:5]
    it = iter(saved[5:])
    tables = [next(it) if present else None for present in ctx.present]
    n_score, n_mask = ctx.counts
    score_captured = [next(it) for _ in range(n_score)]
    mask_captured = [next(it) for _ in range(n_mask)]
    lse, sinks = (next(it), next(it)) if ctx.has_sinks else (None, None)
    no_grads = tuple(_grad_of_list(v) if isinstance(v, list) else None for v in ctx.rest)
    # The inputs but ``sinks`` that get no gradient: q, k, v, the tables, the captured tensors.
    frozen = (None,) * (3 + len(_TABLES)) + ([None] * n_score, [None] * n_mask) + no_grads
    # One gradient per input the op was called with: ``sinks`` (a default) may not have been.
    n_inputs = len(ctx.needs_input_grad)
    if grad_out is None and grad_lse is None:
        return (frozen + (None,))[:n_inputs]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    call = ctx.rest[-2]
    needs = ctx.needs_input_grad
    want_sinks = ctx.has_sinks and bool(needs[_SINKS_INPUT])
    args = (query, key, value, out, row_stats, grad_out, grad_lse, *tables, score_captured,
            mask_captured, *ctx.rest)
    if want_sinks and not (any(needs[:3]) or any(needs[3 + len(_TABLES)])):
        # Only the sinks learn: the rows' delta alone, no gradient kernel.
        grad_sinks = torch.ops.flexcore.flex_attention_sink_backward.default(*args, lse, sinks)
        return frozen + (grad_sinks,)
    if op is None:
        dq, dk, dv, cap_grads, sink_grads = torch.ops.flexcore.flex_attention_backward.default(
            *args, *((lse, sinks) if want_sinks else ()))
    else:  # the inline op's backward (its forward takes no sinks)
        dq, dk, dv, cap_grads = op(*args)
        sink_grads = []
    grads = [None] * n_score
    for i, g in zip(spec_of(call).score_grads, cap_grads):
        grads[i] = g
    return ((dq, dk, dv, *[None] * len(_TABLES), grads, [None] * n_mask) + no_grads
            + (sink_grads[0] if want_sinks else None,))[:n_inputs]


torch.library.register_autograd("flexcore::flex_attention_forward", _backward,
                                setup_context=_setup_context, lib=_lib)


# ----------------------------------------------------------------------------------------------
# The inline forward: an op whose kernel Inductor launches from its own code
# ----------------------------------------------------------------------------------------------

# A compiled call pays torch's compiled-function wrappers plus, for an op that runs Python, the
# op's dispatch and body; at small shapes that host time exceeds the kernel's. A ``triton_op`` is
# traced into the graph instead, and Inductor launches its kernel directly
# (docs/decisions.md#compiled-host-path). Calls it does not suit (see inline_forward) trace into
# flexcore's forward op from its body.
@torch.library.triton_op("flexcore::flex_attention_forward_inline", mutates_args={})
def flex_attention_forward_inline(
        query: Tensor, key: Tensor, value: Tensor, kv_num_blocks: Optional[Tensor],
        kv_indices: Optional[Tensor], full_kv_num_blocks: Optional[Tensor],
        full_kv_indices: Optional[Tensor], q_num_blocks: Optional[Tensor], q_indices: Optional[Tensor],
        full_q_num_blocks: Optional[Tensor], full_q_indices: Optional[Tensor],
        score_captured: list[Tensor], mask_captured: list[Tensor], score_ints: list[int],
        score_floats: list[float], mask_ints: list[int], mask_floats: list[float], block: list[int],
        call: str, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """flex_attention_forward's contract. Where :func:`inline_call` allows, through
    flexcore.kernels.forward.forward_inline: the Triton template with decisions from shapes alone,
    so that it traces with fake tensors."""
    from flexcore import attention
    from flexcore.kernels.forward import forward_inline
    from flexcore.kernels.tables import BlockTensors

    args = (query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
            q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, score_captured,
            mask_captured, score_ints, score_floats, mask_ints, mask_floats, block, call, scale)
    found = inline_call(args)
    if found is None:
        return torch.ops.flexcore.flex_attention_forward.default(*args)
    spec, _, score, mask, grid = found
    B, Hq = grid[:2]
    attention.check_scale_value(scale)
    _check_indices(spec, score, mask, query, key)
    blocks = None if kv_num_blocks is None else BlockTensors.broadcast(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, tuple(block[:2]))
    if key.shape[0] != B:  # a shared (batch 1) cache is read through stride-0 views
        key, value = key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1)
    return forward_inline(query, key, value, score, mask, blocks, scale, spec.opts)


torch.library.register_autograd(
    "flexcore::flex_attention_forward_inline",
    lambda ctx, *grads: _backward(ctx, *grads, op=torch.ops.flexcore.flex_attention_backward_inline.default),
    setup_context=_setup_context)


@torch.library.triton_op("flexcore::flex_attention_backward_inline", mutates_args={})
def flex_attention_backward_inline(
        query: Tensor, key: Tensor, value: Tensor, out: Tensor, row_stats: Tensor, grad_out: Tensor,
        grad_lse: Optional[Tensor], kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
        full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
        q_num_blocks: Optional[Tensor], q_indices: Optional[Tensor], full_q_num_blocks: Optional[Tensor],
        full_q_indices: Optional[Tensor], score_captured: list[Tensor], mask_captured: list[Tensor],
        score_ints: list[int], score_floats: list[float], mask_ints: list[int], mask_floats: list[float],
        block: list[int], call: str, scale: float) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """flex_attention_backward's contract. Where :func:`inline_backward_call` allows, through
    flexcore.kernels.backward.backward_inline (decisions from shapes alone); else flexcore's
    backward op."""
    from flexcore.kernels.backward import backward_inline
    from flexcore.kernels.tables import BlockTensors

    tables = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
              full_q_num_blocks, full_q_indices)
    rest = (score_captured, mask_captured, score_ints, score_floats, mask_ints, mask_floats, block, call,
            scale)
    found = inline_backward_call((query, key, value, *tables, *rest))
    if found is None:
        return torch.ops.flexcore.flex_attention_backward.default(
            query, key, value, out, row_stats, grad_out, grad_lse, *tables, *rest)[:4]
    spec, lowered, score, mask, (B, Hq, _, _) = found
    kv_blocks = q_blocks = None
    if kv_num_blocks is not None:
        bq, bkv = block[:2]
        kv_blocks = BlockTensors.broadcast(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                           (bq, bkv))
        q_blocks = BlockTensors.broadcast(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, (bkv, bq))
    shared = key.shape[0] != B  # a shared (batch 1) cache: read through stride-0 views, summed after
    dq, dk, dv, grads = backward_inline(
        query, key.expand(B, -1, -1, -1) if shared else key, value.expand(B, -1, -1, -1) if shared else value,
        out, row_stats, grad_out, grad_lse, score, spec.score_backward(lowered), mask, kv_blocks, q_blocks,
        scale, spec.opts)
    if shared:
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return dq, dk, dv, _captured_grads_in_call_order(spec, lowered, score_captured, grads)


def _captured_grads_in_call_order(spec: CallSpec, lowered: Lowered, score_captured, grads) -> list:
    """The gradients of the score_mod's tensors that get one (``spec.score_grads`` order) from the
    kernels' (``lowered.score_order``); zeros for a tensor whose value the lowering dropped."""
    by_recorded = {lowered.score_order[j]: g for j, g in enumerate(grads) if g is not None}
    return [by_recorded[i] if i in by_recorded
            else torch.zeros_like(score_captured[i], memory_format=torch.contiguous_format)
            for i in spec.score_grads]


def inline_call(args: tuple, switch: str | None = None):
    """(spec, lowered, score, mask, (B, Hq, L, S)) of a call of the inline op's ``args`` that the
    inline forward serves (:func:`inline_forward` under ``switch``, and index checks that read no
    tensor), else None."""
    from flexcore import attention

    query, key, value = args[:3]
    score_captured, mask_captured, score_ints, score_floats, mask_ints, mask_floats, block, call, \
        scale = args[3 + len(_TABLES):]
    spec = spec_of(call)
    numbers = (tuple(score_ints), tuple(score_floats), tuple(mask_ints), tuple(mask_floats))
    if not inline_forward(spec, query, key, value, (*block, *(x for n in numbers for x in n), scale), switch):
        return None
    kv_indices = args[4]
    if kv_indices is not None and (kv_indices.shape[-2] * block[0] >= query.shape[2] + block[0]
                                   or kv_indices.shape[-1] * block[1] >= key.shape[2] + block[1]):
        return None  # tables past the lengths: flexcore's op serves it (BlockMask._within)
    attention.ready()
    lowered = spec.lowered(numbers)
    score, mask = spec.bind(lowered, score_captured, mask_captured)
    attention.check_captured_values(query.device, score, mask)
    grid = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    # An index check that evaluates index expressions reads tensors, which are fake while Inductor
    # traces the op: such calls take flexcore's op, which checks on the call's own tensors.
    if not (decided_without_evaluation(score, *grid) and decided_without_evaluation(mask, *grid)):
        return None
    return spec, lowered, score, mask, grid


def inline_backward_call(args: tuple):
    """As :func:`inline_call`, for the backward of a call with the inline forward op's ``args``:
    by the launch policy's ``inline_backward`` rule, only with the mask's transposed tables (a
    mask without them has them computed from its tables' values), and without a mask only where
    the policy allows the dense path (the inline backward runs it there)."""
    dispatch = spec_of(args[-2]).opts.dispatch
    rule = dispatch.launch
    tables = args[3:3 + len(_TABLES)]
    if (rule.inline_backward == "off" or dispatch.gluon.backward == "on"
            or (tables[0] is not None and tables[5] is None)
            or (tables[0] is None and dispatch.backward.dense == "off")):  # no mask: the dense path
        return None
    return inline_call(args, switch=rule.inline if rule.inline_backward == "auto" else "on")


def inline_forward(spec: CallSpec, query: Tensor, key: Tensor, value: Tensor, numbers: tuple,
                   switch: str | None = None) -> bool:
    """Whether the inline forward serves a call: on CUDA, 16-bit or float32 inputs at head dims up
    to 128 with static shapes and numbers (Python ints and floats: ``numbers``), that the
    forward kernel (not the decode kernel) serves without run-time index checks and that no
    option sends to the Gluon kernels; then by the launch policy's ``inline`` rule (or ``switch``):
    "auto" 16-bit inputs up to inline_max_flops, "on" all of them."""
    from flexcore._runtime import use_interpreter
    from flexcore.kernels import decode
    from flexcore.kernels.forward import pad_head_dim

    opts = spec.opts
    rule = opts.dispatch.launch
    switch = rule.inline if switch is None else switch
    gluon = opts.dispatch.gluon
    shapes = (*query.shape, *key.shape, *value.shape)
    # Under the interpreter only where asked for ("on"): Inductor cannot trace its launches.
    on_device = query.device.type == "cuda" or (use_interpreter() and switch == "on")
    if (switch == "off" or not on_device or opts.check_indices
            or query.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or max(pad_head_dim(query.shape[-1]), pad_head_dim(value.shape[-1])) > 128
            or opts.backend == "gluon" or "on" in (gluon.dense, gluon.masked)
            or not all(type(x) in (int, float) for x in (*shapes, *numbers))
            or decode.use_decode_kernel(query.shape[2], opts)):
        return False
    B, Hq, L, D = query.shape
    flops = 4.0 * B * Hq * L * key.shape[2] * max(D, value.shape[-1])
    return switch == "on" or (query.dtype in (torch.float16, torch.bfloat16)
                              and flops <= rule.inline_max_flops)


# ----------------------------------------------------------------------------------------------
# The call Dynamo traces
# ----------------------------------------------------------------------------------------------

def compiled_flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                            kernel_options, want_max: bool, sinks: Tensor | None = None):
    """flex_attention's body under torch.compile: (out, lse, max_scores or None), with ``sinks``
    (checked by the caller) in out and lse as in an eager call."""
    from flexcore.attention import check_call

    check_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    # Head counts and head dims are static, as torch's flex_attention makes them: the kernels
    # specialise on them.
    for t in (query, key, value):
        torch._dynamo.mark_static(t, -3)
        torch._dynamo.mark_static(t, -1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    score_dtype = _score_dtype_of(query.dtype)
    device = query.device
    score = None if score_mod is None else record(score_mod, "score", score_dtype, device)
    if block_mask is None:
        mask, block, tables = None, [], (None,) * len(_TABLES)
    else:
        mask = record(block_mask.mask_mod, "mask", score_dtype, device)
        block = [*block_mask.BLOCK_SIZE, *block_mask.seq_lengths]
        tables = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                  block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
                  block_mask.full_q_num_blocks, block_mask.full_q_indices)
    kernel_options = _plain(kernel_options)
    call = register_call(None if score is None else score.constants,
                         None if mask is None else mask.constants, query.dtype, device.type,
                         kernel_options, want_max)
    args = (query, key, value, *tables, [] if score is None else score.captured,
            [] if mask is None else mask.captured, [] if score is None else score.ints,
            [] if score is None else score.floats, [] if mask is None else mask.ints,
            [] if mask is None else mask.floats, block, call, scale)
    # On CUDA the inline op decides, with the shapes it is traced with, whether to launch the
    # kernel itself or to call flexcore's forward op. It takes no sinks: calls with them go to
    # flexcore's forward op, whose kernels take them in and whose backward gives their gradient.
    if sinks is not None:
        out, lse, row_stats = torch.ops.flexcore.flex_attention_forward.default(*args, sinks)
    elif device.type == "cuda":
        out, lse, row_stats = torch.ops.flexcore.flex_attention_forward_inline.default(*args)
    else:
        out, lse, row_stats = torch.ops.flexcore.flex_attention_forward.default(*args)
    return out, lse, (row_stats[0] * _LN2 if want_max else None)
