"""Variant specs: from a grid's text (``"alibi+causal"``, ``"mods.py"``) to a score_mod and a mask_mod.

Grammar: terms joined by ``+``; a term is

- a registry name with optional parameters: ``sliding_window(window=1024)``, ``prefix_lm(prefix=S//4)``;
  values are numbers, strings, booleans or arithmetic on ``S`` (= KV_LEN), ``Q_LEN``, ``KV_LEN``,
  ``B``, ``H`` (query heads), ``D``;
- ``noop``: no mod;
- a Python file (``path/mods.py`` or ``path/mods.py:name``) defining ``score_mod`` and/or
  ``mask_mod``, or a ``make(...)`` factory (or the object ``name``) returning them.

Score mods of several terms compose left to right; mask mods combine with ``and_masks``. A spec
resolves to :class:`variants.core.Mods` (the type the gallery and the workbench use too); bench
also takes Mods in memory, without a spec (:func:`bench.runner.run_grid`).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import variants
from variants.core import Mods, Shape, VariantError


@dataclass(frozen=True)
class Term:
    name: str
    params: tuple[tuple[str, str], ...] = ()  # (key, expression text)

    @property
    def is_file(self) -> bool:
        path = self.name.split(":", 1)[0]
        return path.endswith(".py") or "/" in path


def split_terms(spec: str) -> list[Term]:
    """Parse ``"a(x=1)+b"`` into terms; '+' inside parentheses does not split."""
    spec = spec.strip()
    if not spec:
        raise VariantError("empty variant spec; give a registry name, 'noop' or a .py file")
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise VariantError(f"unbalanced ')' in variant spec {spec!r}")
        elif ch == "+" and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise VariantError(f"unbalanced '(' in variant spec {spec!r}")
    parts.append(spec[start:])
    terms = []
    for part in parts:
        part = part.strip()
        m = re.fullmatch(r"([^()]+?)\s*(?:\((.*)\))?", part, flags=re.S)
        if not part or not m:
            raise VariantError(f"cannot parse term {part!r} of variant spec {spec!r}; expected "
                               "name, name(key=value, ...) or path/to/mods.py")
        name, args = m.group(1).strip(), m.group(2)
        params = []
        if args and args.strip():
            try:
                call = ast.parse(f"f({args})", mode="eval").body
            except SyntaxError as exc:
                raise VariantError(f"parameters {args!r} of {name!r} in {spec!r}: {exc.msg}") from exc
            if call.args:
                raise VariantError(f"parameters of {name!r} in {spec!r} must be key=value, got "
                                   f"positional {ast.unparse(call.args[0])!r}")
            params = [(kw.arg, ast.unparse(kw.value)) for kw in call.keywords]
        terms.append(Term(name, tuple(params)))
    return terms


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}


def eval_param(text: str, context: dict[str, int]) -> Any:
    """Evaluate a parameter value: a literal, or arithmetic on the names in ``context``."""

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in context:
                return context[node.id]
            if node.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.id]
            raise VariantError(f"unknown name {node.id!r} in parameter {text!r}; known: "
                               f"{sorted(context)}")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        raise VariantError(f"parameter {text!r}: only literals and arithmetic on "
                           f"{sorted(context)} are allowed")

    try:
        return ev(ast.parse(text, mode="eval").body)
    except VariantError:
        raise
    except (SyntaxError, ArithmeticError, TypeError, ValueError) as exc:
        raise VariantError(f"parameter {text!r}: {type(exc).__name__}: {exc}") from None


def shape_context(B: int, H: int, KV_HEADS: int, Q_LEN: int, KV_LEN: int, D: int) -> dict[str, int]:
    return {"B": B, "H": H, "HKV": KV_HEADS, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "S": KV_LEN, "D": D}


# Names a variant factory may take, filled from the case (only those in its signature are passed).
_FACTORY_ARGS = {
    "B": "B", "batch": "B", "H": "H", "num_heads": "H", "heads": "H", "n_heads": "H",
    "Q_LEN": "Q_LEN", "q_len": "Q_LEN", "KV_LEN": "KV_LEN", "kv_len": "KV_LEN", "S": "S",
    "seq_len": "S", "D": "D", "head_dim": "D",
}


def _call_factory(factory: Callable, params: dict, context: dict, device, dtype, what: str):
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory(**params)
    accepted = sig.parameters
    kwargs = dict(params)
    for arg, key in _FACTORY_ARGS.items():
        if arg in accepted and arg not in kwargs:
            kwargs[arg] = context[key]
    if "device" in accepted and "device" not in kwargs:
        kwargs["device"] = device
    if "dtype" in accepted and "dtype" not in kwargs:
        kwargs["dtype"] = dtype
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        unknown = set(params) - set(accepted)
        if unknown:
            raise VariantError(f"{what} takes no parameter(s) {sorted(unknown)}; its parameters: "
                               f"{list(accepted)}")
    return factory(**kwargs)


def _nargs(fn) -> int | None:
    try:
        return len([p for p in inspect.signature(fn).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    except (TypeError, ValueError):
        return None


def _as_mods(obj, what: str) -> tuple[Callable | None, Callable | None, list | None, object]:
    """Read (score_mod, mask_mod, captured tensors or None, sinks or None) out of what a variant
    factory returned.

    Registry variants return :class:`Mods` (with ``captured``); mod files may return a Mods, a
    pair, a dict or a single mod function.
    """
    if obj is None:
        return None, None, None, None
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return obj[0], obj[1], None, None
    if isinstance(obj, dict) and ({"score_mod", "mask_mod"} & set(obj)):
        return (obj.get("score_mod"), obj.get("mask_mod"), _captured_list(obj.get("captured")),
                obj.get("sinks"))
    if hasattr(obj, "score_mod") or hasattr(obj, "mask_mod"):
        return (getattr(obj, "score_mod", None), getattr(obj, "mask_mod", None),
                _captured_list(getattr(obj, "captured", None)), getattr(obj, "sinks", None))
    if callable(obj):
        n = _nargs(obj)
        if n == 5:
            return obj, None, None, None
        if n == 4:
            return None, obj, None, None
    raise VariantError(f"{what} returned {type(obj).__name__}; expected (score_mod, mask_mod), an "
                       "object with .score_mod/.mask_mod, or a mod function")


def _captured_list(captured) -> list | None:
    """[(name, tensor)] of a ``captured`` mapping (or sequence): its floating-point tensors, the
    ones whose gradients bench can compare."""
    if captured is None:
        return None
    items = captured.items() if hasattr(captured, "items") else enumerate(captured)
    return [(str(k), t) for k, t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


_FILE_CACHE: dict[tuple[str, float], Any] = {}


def _load_file(path_text: str):
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise VariantError(f"mod file {path_text!r} does not exist")
    key = (str(path), path.stat().st_mtime)
    if key not in _FILE_CACHE:
        name = "bench_user_mods_" + re.sub(r"\W", "_", path.stem) + f"_{abs(hash(key)) % 10**8}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise VariantError(f"importing mod file {path_text!r} failed: {type(exc).__name__}: {exc}") from exc
        _FILE_CACHE[key] = module
    return _FILE_CACHE[key]


def _resolve_term(term: Term, context: dict, device, dtype):
    params = {k: eval_param(v, context) for k, v in term.params}
    if term.name == "noop" and not params:
        return None, None, None, None
    if term.is_file:
        path, _, attr = term.name.partition(":")
        module = _load_file(path)
        obj = getattr(module, attr) if attr else module
        if attr and obj is None:
            raise VariantError(f"mod file {path!r} has no {attr!r}")
        factory = getattr(obj, "make", None) if not callable(obj) or inspect.ismodule(obj) else obj
        if factory is not None and callable(factory) and _nargs(factory) not in (4, 5):
            return _as_mods(_call_factory(factory, params, context, device, dtype, term.name), term.name)
        if params:
            raise VariantError(f"mod file term {term.name!r} got parameters but defines no make(...)")
        if inspect.ismodule(obj):
            score, mask = getattr(obj, "score_mod", None), getattr(obj, "mask_mod", None)
            if score is None and mask is None:
                raise VariantError(f"mod file {path!r} defines neither score_mod, mask_mod nor make()")
            return score, mask, None, None
        return _as_mods(obj, term.name)
    variant = _registry_variant(term.name)
    make = getattr(variant, "make", None)
    if make is None:
        return _as_mods(variant, term.name)
    return _as_mods(_call_factory(make, params, context, device, dtype, f"variant {term.name!r}"),
                    f"variant {term.name!r}")


def _registry_variant(name: str):
    """The registry's variant ``name``; raises VariantError listing the known names."""
    try:
        return variants.get(name)
    except VariantError:
        raise VariantError(f"unknown variant {name!r}; known: {', '.join(variants.names())} "
                           "(or give a mod file path/to/mods.py)") from None


def check_spec(spec: str, context: dict) -> None:
    """Check a variant spec at one case shape without building its mods: the grammar, parameter
    values, registry names and parameters (types and ranges), and mod files (they are imported).

    Raises:
        VariantError: naming the spec and what is wrong, on one line.
    """
    try:
        for term in split_terms(spec):
            params = {k: eval_param(v, context) for k, v in term.params}
            if term.name == "noop" and not params:
                continue
            if term.is_file:
                _check_file_term(term, params)
                continue
            variant = _registry_variant(term.name)
            resolve_params = getattr(variant, "resolve_params", None)
            if resolve_params is not None:
                try:
                    resolve_params(**params)
                except (ValueError, TypeError) as exc:
                    raise VariantError(str(exc)) from None
    except VariantError as exc:
        text = " ".join(str(exc).split())
        raise VariantError(text if spec in text else f"variant {spec!r}: {text}") from None


def _check_file_term(term: Term, params: dict) -> None:
    path, _, attr = term.name.partition(":")
    module = _load_file(path)
    obj = getattr(module, attr, None) if attr else module
    if attr and obj is None:
        raise VariantError(f"mod file {path!r} has no {attr!r}")
    factory = getattr(obj, "make", None) if inspect.ismodule(obj) else obj
    if inspect.ismodule(obj) and factory is None:
        if not (hasattr(obj, "score_mod") or hasattr(obj, "mask_mod")):
            raise VariantError(f"mod file {path!r} defines neither score_mod, mask_mod nor make()")
        if params:
            raise VariantError(f"mod file term {term.name!r} got parameters but defines no make(...)")
        return
    if params and callable(factory):
        try:
            accepted = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            return
        if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            unknown = set(params) - set(accepted)
            if unknown:
                raise VariantError(f"{term.name} takes no parameter(s) {sorted(unknown)}; its "
                                   f"parameters: {list(accepted)}")


def resolve(spec: str, *, B: int, H: int, KV_HEADS: int, Q_LEN: int, KV_LEN: int, D: int,
            device: torch.device | str, dtype: torch.dtype = torch.float32) -> Mods:
    """Resolve a variant spec for one case's shape into its mods.

    ``captured`` holds the floating-point tensors the mods read, each once (by identity), under
    the name its variant gives it (or ``cap<i>`` for tensors found in a mod's closure).
    """
    from flexcore.masks import and_masks

    context = shape_context(B, H, KV_HEADS, Q_LEN, KV_LEN, D)
    scores, masks, captured, sinks = [], [], [], None
    for term in split_terms(spec):
        score, mask, cap, term_sinks = _resolve_term(term, context, device, dtype)
        if term_sinks is not None:
            if sinks is not None:
                raise VariantError(f"only one term of a spec may set sinks; {term.name!r} sets them again")
            sinks = term_sinks
        if cap is None:
            cap = [(f"cap{i}", t) for i, t in enumerate(captured_tensors(score, mask))]
        captured += cap
        for fn, kind in ((score, "score_mod"), (mask, "mask_mod")):
            if fn is not None and not callable(fn):
                raise VariantError(f"{term.name!r} gave a {kind} of type {type(fn).__name__}, not a function")
        if score is not None:
            scores.append(score)
        if mask is not None and getattr(mask, "__name__", "") != "noop_mask":
            masks.append(mask)
    score_mod = scores[0] if len(scores) == 1 else (_compose(scores) if scores else None)
    mask_mod = masks[0] if len(masks) == 1 else (and_masks(*masks) if masks else None)
    unique: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in captured:
        if id(t) in seen:
            continue
        seen.add(id(t))
        while name in unique:
            name += "_"
        unique[name] = t
    return Mods(score_mod, mask_mod, unique, Shape(B, H, Q_LEN, KV_LEN, torch.device(device)),
                sinks=sinks)


def _compose(score_mods: list[Callable]) -> Callable:
    def composed_score(score, b, h, q_idx, kv_idx):
        for fn in score_mods:
            score = fn(score, b, h, q_idx, kv_idx)
        return score

    composed_score.__name__ = "_then_".join(getattr(f, "__name__", "score") for f in score_mods)
    return composed_score


def offset_indices(mods: Mods, *, b0: int = 0, h0: int = 0, q0: int = 0) -> Mods:
    """Mods that see ``b + b0``, ``h + h0``, ``q_idx + q0``: for slices of a problem, and for decoding.

    Decoding puts the query at the end of the KV sequence (q0 = KV_LEN - Q_LEN), so that causal
    and window masks keep the recent keys, as in a real decoding step.
    """
    if not (b0 or h0 or q0):
        return mods
    score, mask = mods.score_mod, mods.mask_mod
    new_score = new_mask = None
    if score is not None:
        def new_score(s, b, h, q_idx, kv_idx):
            return score(s, b + b0, h + h0, q_idx + q0, kv_idx)

        new_score.__name__ = getattr(score, "__name__", "score_mod")
    if mask is not None:
        def new_mask(b, h, q_idx, kv_idx):
            return mask(b + b0, h + h0, q_idx + q0, kv_idx)

        new_mask.__name__ = getattr(mask, "__name__", "mask_mod")
    return dataclasses.replace(mods, score_mod=new_score, mask_mod=new_mask)


def captured_tensors(*fns) -> list[torch.Tensor]:
    """Floating-point tensors a mod captures (closures, defaults, globals it names), deduplicated.

    These are the tensors whose gradients the benchmark compares on backward passes.
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj, depth=0):
        if depth > 8 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point():
                found.setdefault(id(obj), obj)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                visit(item, depth + 1)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
            return
        if inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # empty cell
                    pass
            for item in obj.__defaults__ or ():
                visit(item, depth + 1)
            names = obj.__code__.co_names
            for name in names:
                if name in obj.__globals__:
                    value = obj.__globals__[name]
                    if isinstance(value, torch.Tensor) or inspect.isfunction(value):
                        visit(value, depth + 1)
            return
        if hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(getattr(obj, "keywords", {}), depth + 1)
            return
        if callable(obj) and hasattr(obj, "__dict__") and not inspect.isclass(obj) \
                and not inspect.ismodule(obj) and not inspect.isbuiltin(obj):
            visit(vars(obj), depth + 1)

    for fn in fns:
        if fn is not None:
            visit(fn)
    return list(found.values())
