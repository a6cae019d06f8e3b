"""Where kernels run: a CUDA GPU, or Triton's interpreter on machines without one."""
from __future__ import annotations

import functools
import math
import os
import sys

import torch


@functools.lru_cache(maxsize=None)
def use_interpreter() -> bool:
    """True when flexcore's Triton kernels run under Triton's interpreter (no CUDA GPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return not torch.cuda.is_available()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph: no timing and no read-back of
    device values may happen then (False on machines without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def prepare_triton() -> None:
    """Select the interpreter before any flexcore kernel module is decorated.

    ``TRITON_INTERPRET`` is read when ``@triton.jit`` runs, so every kernel module is imported
    lazily, after this call.
    """
    if use_interpreter():
        os.environ["TRITON_INTERPRET"] = "1"
        _interpret_imported_triton_language()
        _lighten_interpreter()


@functools.lru_cache(maxsize=None)
def _interpret_imported_triton_language() -> None:
    """Make triton.language usable by interpreted kernels when it was imported first (once: a
    later import of triton.language already sees TRITON_INTERPRET).

    triton.language's own ``@triton.jit`` helpers (``tl.zeros``, ``tl.cdiv``, ``tl.sum``, ...) are
    decorated when it is imported. A program that imported triton before flexcore chose the
    interpreter (``import triton`` at the top of a script, say) holds compiled-kernel versions of
    them, which interpreted kernels cannot call ("Cannot call @triton.jit'd outside of the scope of
    a kernel"). They are re-wrapped for the interpreter here, once.
    """
    if "triton.language" not in sys.modules:
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attr, InterpretedFunction(value.fn))


@functools.lru_cache(maxsize=None)
def _lighten_interpreter() -> None:
    """Drop three costs of Triton's interpreter that compiled kernels do not have
    (docs/decisions.md#interpreter-speed has their measured share).

    - Its int32 overflow check of every integer add, sub and mul, which compiled kernels make only
      when built with ``debug``: off, as on the GPU.
    - The re-patching of triton.language on every call of a ``@triton.jit`` helper inside a
      launch, where the launch has already patched the same modules: skipped.
    - The types rebuilt at every operation (:func:`_memoize_types`): made once per type.

    ``FLEXLAB_INTERPRETER_AS_IS=1`` leaves the interpreter as Triton ships it (to debug a kernel
    with its overflow checks), as are Triton versions whose interpreter is laid out otherwise.
    """
    if os.environ.get("FLEXLAB_INTERPRETER_AS_IS") == "1":
        return
    import dataclasses
    import inspect
    import threading

    try:
        from triton.runtime import interpreter
        import triton.language as tl

        builder, patch_lang, grid_call = (interpreter.interpreter_builder, interpreter._patch_lang,
                                          interpreter.GridExecutor.__call__)
        options = builder.options
    except (ImportError, AttributeError):
        return
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)

    state = threading.local()
    langs_of: dict = {}

    def langs(fn) -> frozenset:
        found = langs_of.get(fn)
        if found is None:
            found = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        return found

    class _Kept:  # the scope of a skipped patch: nothing to restore
        def restore(self):
            pass

    def patch_once(fn):
        patched = getattr(state, "patched", None)  # None outside a launch; empty before its own patch
        need = langs(fn)
        if patched and need <= patched:
            return _Kept()
        scope = patch_lang(fn)
        if patched is not None:
            patched |= need
        return scope

    def launch(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set()  # filled by the launch's own patch, which always runs
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch
    _memoize_types(interpreter, tl)


def _memoize_types(interpreter, tl) -> None:
    """Make once what the interpreter rebuilds from a type at every operation: numpy's dtype for a
    triton type, a block type's checked shape, size and name, and a tensor's constexpr shape and
    size (each a pure function of the type; docs/decisions.md#interpreter-speed)."""
    core = tl.core
    np_dtype, block_init = interpreter._get_np_dtype, core.block_type.__init__
    tensor_init_before = core.tensor.__init__
    if getattr(np_dtype, "__wrapped__", None) is not None:  # done
        return
    dtypes: dict = {}
    blocks: dict = {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, core.block_type) else tt_dtype
        try:
            return dtypes[scalar]
        except KeyError:
            found = dtypes[scalar] = np_dtype(scalar)
            return found
        except TypeError:  # an unhashable type: as triton does
            return np_dtype(tt_dtype)

    def init(self, element_ty, shape):
        try:
            key = (element_ty, tuple(shape))
            kept = blocks.get(key)
        except TypeError:
            key = kept = None
        if kept is None:
            block_init(self, element_ty, shape)
            kept = (self.shape, self.numel, self.name,
                    (tuple(core.constexpr(n) for n in self.shape), core.constexpr(math.prod(self.shape))))
            if key is not None:
                blocks[key] = kept
        self.element_ty = element_ty
        self.shape, self.numel, self.name, self._flexcore_sizes = kept

    scalar_sizes = ((), core.constexpr(1))

    def tensor_init(self, handle, type):
        # tl.tensor's own fields, with the block type's constexpr shape and size made once.
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = (getattr(type, "_flexcore_sizes", None) if type.is_block()
                                  else scalar_sizes) or _sizes(type)

    def _sizes(type):
        return tuple(core.constexpr(n) for n in type.shape), core.constexpr(math.prod(type.shape))

    get_np_dtype.__wrapped__ = np_dtype
    interpreter._get_np_dtype = get_np_dtype
    # The replacements set the fields triton's own constructors set (checked here on one value,
    # so that a triton whose constructors set others keeps them).
    ours, theirs = object.__new__(core.block_type), object.__new__(core.block_type)
    init(ours, core.float32, [2, 4])
    block_init(theirs, core.float32, [2, 4])
    if set(vars(ours)) - {"_flexcore_sizes"} != set(vars(theirs)):
        return
    core.block_type.__init__ = init
    ours, theirs = object.__new__(core.tensor), object.__new__(core.tensor)
    tensor_init(ours, None, core.block_type(core.float32, [2, 4]))
    tensor_init_before(theirs, None, core.block_type(core.float32, [2, 4]))
    if vars(ours).keys() == vars(theirs).keys() and ours.shape == theirs.shape:
        core.tensor.__init__ = tensor_init


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device) -> torch.device:
    """``device`` (or the default device when None) with the current CUDA index filled in, so that
    "cuda" compares equal to the "cuda:0" that tensors report."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
