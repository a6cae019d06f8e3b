"""Errors raised for user mods and user inputs.

Every error says what happened, names the user's own input (the mod and its line, or the
argument and its shape) and what to do next.
"""
from __future__ import annotations


class FlexError(Exception):
    """Base class of flexcore's own errors."""


class ModError(FlexError):
    """A score_mod or mask_mod cannot be lowered.

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


class ControlFlowError(ModError):
    """The mod branches in Python on a tensor value (``if q_idx > 5:``)."""


class ModSignatureError(ModError):
    """The mod takes the wrong number of arguments."""


class ModReturnError(ModError):
    """The mod returns the wrong kind of value (e.g. a mask_mod returning floats)."""


class InputError(FlexError, ValueError):
    """An argument to a public function has the wrong shape, dtype or device."""
