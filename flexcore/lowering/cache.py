"""Guard keys for cached traces: what a mod's result can depend on, cheaply.

A key covers the function's code and everything it can reach by name: closure cells and
referenced globals, recursively into captured functions (``and_masks`` builds closures over
mods). Tensors count by identity (plus shape and dtype), so mutating a tensor in place keeps
the key while rebinding a name to another tensor changes it. Python scalars and strings count by
value; anything else by identity.
"""
from __future__ import annotations

import builtins
import functools
import threading
import types
from collections import OrderedDict

import torch

_MAX_DEPTH = 8
_code_names: dict[types.CodeType, tuple[str, ...]] = {}


def _names(code: types.CodeType) -> tuple[str, ...]:
    """Global names a code object (and the code nested in it) may look up."""
    names = _code_names.get(code)
    if names is None:
        found = list(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found.extend(_names(const))
        names = tuple(dict.fromkeys(found))
        _code_names[code] = names
    return names


class _Guard:
    def __init__(self):
        self.pins: list = []  # objects keyed by id stay alive as long as the cache entry
        self.seen: set[int] = set()

    def key(self, obj, depth: int = 0):
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return (type(obj).__name__, obj)
        if isinstance(obj, torch.Tensor):
            self.pins.append(obj)
            return ("tensor", id(obj), obj.dtype, tuple(obj.shape), obj.device)
        if isinstance(obj, (torch.dtype, torch.device)):
            return ("torch", obj)
        if depth > _MAX_DEPTH or id(obj) in self.seen:
            self.pins.append(obj)
            return ("id", id(obj))
        if isinstance(obj, types.FunctionType):
            self.seen.add(id(obj))
            return self._function(obj, depth)
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__, id(obj))
        if isinstance(obj, (tuple, list)):
            self.seen.add(id(obj))
            return (type(obj).__name__, tuple(self.key(x, depth + 1) for x in obj))
        if isinstance(obj, dict):
            self.seen.add(id(obj))
            return ("dict", tuple((self.key(k, depth + 1), self.key(v, depth + 1))
                                  for k, v in obj.items()))
        if isinstance(obj, functools.partial):
            self.seen.add(id(obj))
            return ("partial", self.key(obj.func, depth + 1), self.key(obj.args, depth + 1),
                    self.key(obj.keywords, depth + 1))
        if isinstance(obj, types.MethodType):
            self.seen.add(id(obj))
            return ("method", self.key(obj.__func__, depth + 1), self.key(obj.__self__, depth + 1))
        self.pins.append(obj)
        if callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
            # A callable object: its attributes may hold the tensors it reads.
            self.seen.add(id(obj))
            return ("object", id(obj), self.key(type(obj).__call__, depth + 1),
                    self.key(vars(obj), depth + 1))
        return ("id", id(obj))

    def _function(self, fn: types.FunctionType, depth: int):
        code = fn.__code__
        closure = ()
        if fn.__closure__:
            cells = []
            for cell in fn.__closure__:
                try:
                    cells.append(self.key(cell.cell_contents, depth + 1))
                except ValueError:  # an empty cell
                    cells.append(("empty",))
            closure = tuple(cells)
        glob = fn.__globals__
        referenced = []
        for name in _names(code):
            if name in glob:
                referenced.append((name, self.key(glob[name], depth + 1)))
            elif not hasattr(builtins, name):
                referenced.append((name, ("missing",)))
        defaults = self.key(fn.__defaults__, depth + 1) if fn.__defaults__ else None
        kwdefaults = self.key(fn.__kwdefaults__, depth + 1) if fn.__kwdefaults__ else None
        return ("function", code, closure, tuple(referenced), defaults, kwdefaults)


def guard_key(fn) -> tuple[object, list] | None:
    """(hashable key, objects to keep alive) for ``fn``, or None when no key can be built."""
    guard = _Guard()
    try:
        key = guard.key(fn)
        hash(key)
    except Exception:  # noqa: BLE001 - an odd object only disables caching
        return None
    return key, guard.pins


class LRUCache:
    """A small thread-safe LRU map."""

    def __init__(self, maxsize: int = 256):
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                self._data.move_to_end(key)
            return entry

    def put(self, key, value) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
