"""Guard keys for cached traces: what a mod's result can depend on, cheaply.

A key covers the function's code and everything it can reach by name: closure cells and
referenced globals, recursively into captured functions (``and_masks`` builds closures over
mods). Tensors count by identity (plus shape and dtype), so mutating a tensor in place keeps
the key while rebinding a name to another tensor changes it. Python scalars and strings count by
value; anything else by identity.
"""
from __future__ import annotations

import builtins
import dis
import functools
import threading
import types
import weakref
from collections import OrderedDict

import torch

_MAX_DEPTH = 8
_code_names: dict[types.CodeType, tuple[str, ...]] = {}


def global_names(code: types.CodeType) -> tuple[str, ...]:
    """Global names a code object (and the code nested in it) may look up: the arguments of its
    LOAD_GLOBAL / LOAD_NAME instructions (attribute names such as ``where`` in ``torch.where``
    are not global lookups)."""
    names = _code_names.get(code)
    if names is None:
        found = [ins.argval for ins in dis.get_instructions(code)
                 if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str)]
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found.extend(global_names(const))
        names = tuple(dict.fromkeys(found))
        _code_names[code] = names
    return names


_EMPTY, _MISSING = object(), object()


class _Guard:
    def __init__(self):
        self.pins: list = []  # objects keyed by id stay alive as long as the cache entry
        self.seen: set[int] = set()
        # Where each name, cell and attribute the key read came from, with the object found there,
        # by kind: (cells, globals, attributes, tensors). While every one still holds the same
        # object (and tensors the same metadata), the key is the same and need not be rebuilt.
        # None when the key read a mutable container (list, dict, an object's attributes), whose
        # contents can change in place.
        self.watch: tuple[list, list, list, list] | None = ([], [], [], [])
        self._watched: set = set()

    def _unwatchable(self) -> None:
        self.watch = None

    def _read(self, kind: int, *entry) -> None:
        """Record one read (kind 0: cell, 1: global, 2: attribute, 3: tensor), once."""
        if self.watch is None:
            return
        # A cell or tensor by identity; a global or attribute by its owner and name.
        ident = (kind, id(entry[0]), entry[1] if kind in (1, 2) else None)
        if ident not in self._watched:
            self._watched.add(ident)
            self.watch[kind].append(entry)

    def key(self, obj, depth: int = 0):
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return (type(obj).__name__, obj)
        if isinstance(obj, torch.Tensor):
            self.pins.append(obj)
            self._read(3, obj, obj.dtype, obj.shape, obj.device)
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
            if isinstance(obj, list):
                self._unwatchable()
            return (type(obj).__name__, tuple(self.key(x, depth + 1) for x in obj))
        if isinstance(obj, dict):
            self.seen.add(id(obj))
            self._unwatchable()
            return ("dict", tuple((self.key(k, depth + 1), self.key(v, depth + 1))
                                  for k, v in obj.items()))
        if isinstance(obj, functools.partial):
            self.seen.add(id(obj))
            if obj.keywords:
                self._unwatchable()
            return ("partial", self.key(obj.func, depth + 1), self.key(obj.args, depth + 1),
                    self.key(obj.keywords, depth + 1))
        if isinstance(obj, types.MethodType):
            self.seen.add(id(obj))
            return ("method", self.key(obj.__func__, depth + 1), self.key(obj.__self__, depth + 1))
        self.pins.append(obj)
        if callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
            # A callable object: its attributes may hold the tensors it reads.
            self.seen.add(id(obj))
            self._unwatchable()
            return ("object", id(obj), self.key(type(obj).__call__, depth + 1),
                    self.key(vars(obj), depth + 1))
        return ("id", id(obj))

    def _function(self, fn: types.FunctionType, depth: int):
        code = fn.__code__
        self._read(2, fn, "__code__", code)
        self._read(2, fn, "__defaults__", fn.__defaults__)
        self._read(2, fn, "__kwdefaults__", fn.__kwdefaults__)
        closure = ()
        if fn.__closure__:
            cells = []
            for cell in fn.__closure__:
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    self._read(0, cell, _EMPTY)
                    cells.append(("empty",))
                    continue
                self._read(0, cell, contents)
                cells.append(self.key(contents, depth + 1))
            closure = tuple(cells)
        glob = fn.__globals__
        referenced = []
        for name in global_names(code):
            value = glob.get(name, _MISSING)
            self._read(1, glob, name, value)
            if value is not _MISSING:
                referenced.append((name, self.key(value, depth + 1)))
            elif not hasattr(builtins, name):
                referenced.append((name, ("missing",)))
        defaults = self.key(fn.__defaults__, depth + 1) if fn.__defaults__ else None
        kwdefaults = self.key(fn.__kwdefaults__, depth + 1) if fn.__kwdefaults__ else None
        return ("function", code, closure, tuple(referenced), defaults, kwdefaults)


def guard_key(fn) -> tuple[object, list, tuple | None] | None:
    """(hashable key, objects to keep alive, watch lists) for ``fn``, or None when no key can be
    built. While :func:`unchanged` holds for the watch lists (when not None), the key is the same."""
    guard = _Guard()
    try:
        key = guard.key(fn)
        hash(key)
    except Exception:  # noqa: BLE001 - an odd object only disables caching
        return None
    return key, guard.pins, guard.watch


def unchanged(watch: tuple[list, list, list, list]) -> bool:
    """Whether every name, cell and attribute a key read still holds the same object (and every
    tensor the same dtype, shape and device): a check by identity, much cheaper than the key.
    ``watch`` is the third item of :func:`guard_key`'s result."""
    cells, globs, attrs, tensors = watch
    for cell, obj in cells:
        try:
            if cell.cell_contents is not obj:
                return False
        except ValueError:
            if obj is not _EMPTY:
                return False
    for namespace, name, obj in globs:
        if namespace.get(name, _MISSING) is not obj:
            return False
    for owner, attr, obj in attrs:
        if getattr(owner, attr, _MISSING) is not obj:
            return False
    for t, dtype, shape, device in tensors:
        if t.dtype != dtype or t.shape != shape or t.device != device:
            return False
    return True


class FastGuard:
    """Results per function object, reused while :func:`unchanged` holds for their watch lists.

    ``get(fn, extra)`` returns the remembered value or None; ``put(fn, extra, guard, value)``
    remembers it when the guard has a watch list. Entries hold the function weakly.
    """

    def __init__(self, maxsize: int = 256):
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()

    def get(self, fn, extra):
        entry = self._data.get((id(fn), extra))
        if entry is None or entry[0]() is not fn or not unchanged(entry[1]):
            return None
        return entry[2]

    def put(self, fn, extra, guard, value) -> None:
        if guard is None or guard[2] is None:
            return
        try:
            ref = weakref.ref(fn)
        except TypeError:
            return
        self._data[(id(fn), extra)] = (ref, guard[2], value)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()


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
