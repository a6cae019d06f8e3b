"""The one place where flexcore reaches into triton's internals (private modules, launch protocol).

Everything here is imported lazily, after ``flexcore._runtime.prepare_triton`` has chosen the
interpreter. The supported triton is checked once (:func:`check_version`); an internal that moved
raises :class:`TritonCompatError` naming it, or degrades where flexcore has a slower public path
(asynchronous compilation, direct launches).
"""
from __future__ import annotations

import functools
import inspect

#: The oldest triton whose internals this module mirrors (pyproject.toml's pin).
MIN_VERSION = (3, 6)


class TritonCompatError(RuntimeError):
    """This triton lacks an internal that flexcore's kernels need."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def check_version() -> tuple[int, ...]:
    """triton's version as a tuple; TritonCompatError where it is older than MIN_VERSION."""
    import triton

    version = _version_tuple(getattr(triton, "__version__", "0"))
    if version < MIN_VERSION:
        raise TritonCompatError(
            f"flexcore's kernels need triton >= {'.'.join(map(str, MIN_VERSION))}; this is triton "
            f"{triton.__version__}. Upgrade it with `pip install -U 'triton>={MIN_VERSION[0]}.{MIN_VERSION[1]}'`")
    return version


def _missing(what: str, error: Exception) -> TritonCompatError:
    import triton

    return TritonCompatError(f"triton {getattr(triton, '__version__', '?')} has no {what}, which flexcore's "
                             f"kernels use ({type(error).__name__}: {error}); install a triton "
                             f">= {'.'.join(map(str, MIN_VERSION))} that has it")


def knobs():
    """``triton.knobs`` (debug, instrumentation and launch hooks)."""
    check_version()
    try:
        from triton import knobs as found
    except ImportError as e:
        raise _missing("triton.knobs", e) from None
    return found


def current_stream_getter():
    """triton's ``driver.active.get_current_stream`` (device index -> stream handle)."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream


@functools.lru_cache(maxsize=None)
def launches_like_jit_run() -> bool:
    """Whether this triton's ``JITFunction.run`` launches a compiled kernel with the argument order
    that flexcore's direct launches mirror (read once from its source). False also on ROCm builds of
    torch, whose specialisation reads more than the launch mirrors."""
    import torch

    if torch.version.hip is not None:
        return False
    try:
        from triton.runtime.jit import JITFunction

        source = " ".join(inspect.getsource(JITFunction.run).split())
    except (ImportError, OSError, TypeError):
        return False
    return ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
            "kernel.packed_metadata, launch_metadata, knobs.runtime.launch_enter_hook, "
            "knobs.runtime.launch_exit_hook, *bound_args.values())") in source


def async_compile():
    """(AsyncCompileMode, active_mode) of triton's asynchronous compilation, or None where this
    triton has none (the caller then compiles one configuration at a time)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:
        return None
    return AsyncCompileMode, active_mode


def ensure_allocator(allocate) -> None:
    """Set ``allocate`` as triton's scratch allocator in this thread where none is set (device-side
    tensor descriptors live in global scratch; the setting is a context variable)."""
    import triton

    try:
        from triton.runtime import _allocation

        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError) as e:
        raise _missing("triton.runtime._allocation's allocator", e) from None
    if unset:
        triton.set_allocator(allocate)


def host_tensor_descriptor():
    """triton's host-side ``TensorDescriptor`` class."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError as e:
        raise _missing("triton.tools.tensor_descriptor.TensorDescriptor", e) from None
    return TensorDescriptor
