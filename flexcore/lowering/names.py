"""The user's own names for the tensors a mod captures, for error messages."""
from __future__ import annotations

import functools
import types

from flexcore.lowering.cache import global_names

_MAX_DEPTH = 4
_MAX_ITEMS = 32


def capture_names(fn, tensors) -> tuple:
    """For each tensor, the first name under which ``fn`` reaches it: a closure variable or global
    (``bias``), an item of one (``tables[0]``), an attribute of a callable object (``self.bias``),
    looking into the functions it calls (``and_masks`` closures); None where there is none."""
    want = {id(t): i for i, t in enumerate(tensors)}
    names: list = [None] * len(tensors)
    seen: set[int] = set()

    def note(value, name: str) -> None:
        i = want.get(id(value))
        if i is not None and names[i] is None:
            names[i] = name
        if isinstance(value, (list, tuple)):
            for j, x in enumerate(value[:_MAX_ITEMS]):
                note_item(x, f"{name}[{j}]")
        elif isinstance(value, dict):
            for k, x in list(value.items())[:_MAX_ITEMS]:
                note_item(x, f"{name}[{k!r}]")

    def note_item(value, name: str) -> None:
        i = want.get(id(value))
        if i is not None and names[i] is None:
            names[i] = name

    def visit(obj, depth: int) -> None:
        if depth > _MAX_DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            for j, a in enumerate(obj.args):
                note(a, f"args[{j}]")
            return
        if isinstance(obj, types.MethodType):
            visit(obj.__func__, depth + 1)
            attrs = getattr(obj.__self__, "__dict__", {})
            for k, v in list(attrs.items())[:_MAX_ITEMS]:
                note(v, f"self.{k}")
            return
        if isinstance(obj, types.FunctionType):
            code = obj.__code__
            for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                note(value, name)
                if callable(value):
                    visit(value, depth + 1)
            for name in global_names(code):
                value = obj.__globals__.get(name)
                if value is None:
                    continue
                note(value, name)
                if isinstance(value, (types.FunctionType, functools.partial)):
                    visit(value, depth + 1)
            return
        if callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for k, v in list(vars(obj).items())[:_MAX_ITEMS]:
                note(v, f"self.{k}")
            visit(getattr(type(obj), "__call__", None), depth + 1)

    visit(fn, 0)
    return tuple(names)
