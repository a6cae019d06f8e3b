"""Errors raised for user mods and user inputs.

Every error says what happened, names the user's own input (the mod and its line, or the
argument and its shape) and what to do next.
"""
from __future__ import annotations


class FlexError(Exception):
    """Base class of flexcore's own errors."""


class ModError(FlexError, RuntimeError):
    """A score_mod or mask_mod cannot be lowered. A RuntimeError, as torch raises for a mod it
    cannot trace; a mod with the wrong signature is also a TypeError, an index out of range
    also an IndexError.

    Attributes:
        mod_name: ``__name__`` of the user's function.
        filename: source file of the offending line, or None.
        lineno: line number in that file, or None when it cannot be located.
        op: the operation at fault (e.g. ``"aten.sin"``), or None.
    """

    def __init__(self, message: str, *, mod_name: str | None = None, filename: str | None = None,
                 lineno: int | None = None, op: str | None = None):
        self.mod_name = mod_name
        self.filename = filename
        self.lineno = lineno
        self.op = op
        self.message = message
        where = ""
        if mod_name or lineno is not None:
            loc = f"{filename}:{lineno}" if filename and lineno is not None else (
                f"line {lineno}" if lineno is not None else "")
            where = f"in {mod_name or 'mod'}" + (f" ({loc})" if loc else "") + ": "
        super().__init__(where + message)


class UnsupportedOpError(ModError):
    """The mod uses an operation that has no Triton lowering."""


class ModIndexError(ModError, IndexError):
    """A mod indexes a captured tensor out of range (torch's eager evaluation raises IndexError).

    Attributes (besides ModError's): ``tensor`` (the user's name for it, or a description),
    ``size`` (the indexed dimension's size), ``dim``, ``expression`` (the index, as written in
    the traced graph), ``position`` (a dict of the b/h/q_idx/kv_idx values of one offending
    position, the indices the expression does not depend on left out) and ``value`` (the
    index there); each may be None where unknown.
    """

    def __init__(self, message: str, *, tensor: str | None = None, size: int | None = None,
                 dim: int | None = None, expression: str | None = None,
                 position: dict | None = None, value: int | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.tensor = tensor
        self.size = size
        self.dim = dim
        self.expression = expression
        self.position = position
        self.value = value


class ControlFlowError(ModError):
    """The mod branches in Python on a tensor value (``if q_idx > 5:``)."""


class ModSignatureError(ModError, TypeError):
    """The mod takes the wrong number of arguments."""


class ModReturnError(ModError):
    """The mod returns the wrong kind of value (e.g. a mask_mod returning floats)."""


class InputError(FlexError, ValueError):
    """An argument to a public function has the wrong shape, dtype or device."""


class KernelFallbackWarning(UserWarning):
    """A faster kernel failed to build or launch for a call, and a slower one serves it (and the
    calls like it in this process). Correct results, lost speed: the message names the kernel and
    the error. ``warnings.simplefilter("error", KernelFallbackWarning)`` turns it into an error."""


class RelowerWarning(UserWarning):
    """One mod has been lowered to many different kernels: a value it reads (a Python number in a
    closure, a global, a default argument) changes between calls, and each value is a constant of
    its generated code, so each new value costs a trace and a Triton compile. Issued once per mod;
    reading the changing value from a captured tensor (torch.tensor(pos), or
    flexcore.decoding.offset_score_mod / offset_mask_mod) makes it an argument of one kernel."""
