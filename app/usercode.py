"""The Playground's user code: compile it, run it, find its mods (:class:`variants.core.Mods`), and
locate its errors.

The code is compiled under the filename ``<playground>`` and registered in ``linecache`` so that
tracebacks and flexcore's ``ModError`` point at the user's own line.
"""
from __future__ import annotations

import collections
import itertools
import linecache
import sys
import traceback
import types
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from variants.core import Mods, Shape

FILENAME = "<playground>"

#: Names the Playground defines before running the code, from the shape controls.
SHAPE_NAMES = ("B", "H", "HKV", "Q_LEN", "KV_LEN", "D", "device")


@dataclass(frozen=True)
class CodeProblem:
    """What went wrong with the user's code, located at their line where possible.

    Attributes:
        kind: ``syntax``, ``exception``, ``unsupported_op``, ``control_flow``, ``signature``,
            ``return``, ``mod``, ``missing``, ``timeout``, ``shape`` or ``internal``.
        title: one short line for the error box.
        message: what happened and what to do next.
        lineno: line in the editor (1-based), or None.
        line: that line's text, or None.
        op: the operation at fault (``torch.sin``), or None.
    """

    kind: str
    title: str
    message: str
    lineno: int | None = None
    line: str | None = None
    op: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CodeProblem":
        return cls(**{k: data.get(k) for k in ("kind", "title", "message", "lineno", "line", "op")})

    def where(self) -> str:
        """``line 7: return score * bias[h]`` or ''."""
        if self.lineno is None:
            return ""
        text = f"line {self.lineno}"
        return f"{text}: {self.line.strip()}" if self.line else text


class UserCodeError(Exception):
    """Carries a CodeProblem."""

    def __init__(self, problem: CodeProblem):
        super().__init__(f"{problem.title}: {problem.message}")
        self.problem = problem


def source_line(code: str, lineno: int | None) -> str | None:
    if lineno is None:
        return None
    lines = code.splitlines()
    return lines[lineno - 1] if 1 <= lineno <= len(lines) else None


def register(code: str) -> None:
    """Make ``<playground>`` lines visible to ``linecache`` (tracebacks, inspect, flexcore)."""
    lines = [line + "\n" for line in code.splitlines()]
    linecache.cache[FILENAME] = (len(code), None, lines, FILENAME)


def compile_code(code: str):
    """Compile the editor's text, raising UserCodeError with the line of a syntax error."""
    register(code)
    try:
        return compile(code, FILENAME, "exec")
    except SyntaxError as e:
        lineno = e.lineno
        detail = e.msg
        if isinstance(e, IndentationError):
            detail = f"{e.msg} (check the indentation)"
        raise UserCodeError(CodeProblem(
            "syntax", "Syntax error", f"{detail}. Fix the line and run again.", lineno,
            e.text.rstrip("\n") if e.text else source_line(code, lineno))) from None


def user_lineno(tb) -> int | None:
    """The innermost line of ``<playground>`` in a traceback."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == FILENAME:
            found = lineno
    return found


def problem_from_exception(exc: BaseException, code: str, stage: str) -> CodeProblem:
    """A CodeProblem for any exception raised while running or lowering the user's code.

    flexcore's ModError carries its own location and kind; other exceptions are located by the
    innermost ``<playground>`` frame of their traceback.
    """
    from flexcore import errors

    if isinstance(exc, UserCodeError):
        return exc.problem
    if isinstance(exc, errors.ModError):
        kinds = [(errors.UnsupportedOpError, "unsupported_op", "Unsupported operation"),
                 (errors.ControlFlowError, "control_flow", "Python control flow on a tensor"),
                 (errors.ModSignatureError, "signature", "Wrong mod signature"),
                 (errors.ModReturnError, "return", "Wrong return value")]
        kind, title = "mod", "Error"
        for cls, k, t in kinds:
            if isinstance(exc, cls):
                kind, title = k, t
                break
        message = getattr(exc, "message", None) or str(exc)
        if kind == "mod" and "IndexError" in message:
            kind, title = "shape", "Captured tensor indexed out of range"
            message += (" Size captured tensors from the shape names (B, H, HKV, Q_LEN, KV_LEN), or "
                        "change the shape controls.")
        lineno = exc.lineno if exc.filename == FILENAME else user_lineno(exc.__traceback__)
        if exc.mod_name:
            title = f"{title} in {exc.mod_name}"
        return CodeProblem(kind, title, message, lineno, source_line(code, lineno), exc.op)
    if isinstance(exc, errors.InputError):
        lineno = user_lineno(exc.__traceback__)
        return CodeProblem("shape", "Impossible shape or input", str(exc), lineno,
                           source_line(code, lineno))
    lineno = user_lineno(exc.__traceback__)
    kind = "shape" if isinstance(exc, IndexError) else "exception"
    title = f"{type(exc).__name__} {stage}"
    message = str(exc) or type(exc).__name__
    if isinstance(exc, IndexError):
        message += (". A captured tensor is indexed outside its size: size it from the shape names "
                    "(B, H, Q_LEN, KV_LEN), or change the shape controls.")
    return CodeProblem(kind, title, message, lineno, source_line(code, lineno))


_MODULES: collections.OrderedDict = collections.OrderedDict()
_MODULES_KEPT = 16
_RUNS = itertools.count()


def _code_module() -> types.ModuleType:
    """A module for one run of the code's globals, registered in ``sys.modules``: torch.compile (the
    torch flex provider) imports the module that a function's ``__module__`` names. Only the last
    few runs stay registered (their functions keep their globals either way)."""
    name = f"flexlab_playground_{next(_RUNS)}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    _MODULES[name] = module
    _MODULES.move_to_end(name)
    while len(_MODULES) > _MODULES_KEPT:
        old, _ = _MODULES.popitem(last=False)
        sys.modules.pop(old, None)
    return module


def shape_namespace(shape: dict) -> dict[str, Any]:
    """The names the code may read: torch, and the shape controls' values."""
    import torch

    ns: dict[str, Any] = _code_module().__dict__
    ns.update({"__builtins__": __builtins__, "torch": torch})
    ns.update({"B": shape["B"], "H": shape["Hq"], "HKV": shape["Hkv"], "Q_LEN": shape["Q_LEN"],
               "KV_LEN": shape["KV_LEN"], "D": shape["D"],
               "device": torch.device(shape.get("device", "cpu"))})
    return ns


def execute(code: str, shape: dict) -> dict[str, Any]:
    """Run the code in a fresh module and return its namespace (globals).

    Raises:
        UserCodeError: saying what is wrong and where.
    """
    compiled = compile_code(code)
    ns = shape_namespace(shape)
    try:
        # Tensors the code creates land on the workbench's device unless it names another one:
        # the same code runs in CPU mode and on a GPU.
        with ns["device"]:
            exec(compiled, ns)
    except SystemExit as e:
        lineno = user_lineno(e.__traceback__)
        raise UserCodeError(CodeProblem(
            "exception", "The code called exit()",
            "exit() / sys.exit() would stop the workbench's process; remove the call.", lineno,
            source_line(code, lineno))) from None
    except Exception as e:  # noqa: BLE001 - anything the user's code raises is reported as theirs
        raise UserCodeError(problem_from_exception(e, code, "while running the code")) from None
    return ns


def mods_of(namespace: Mapping[str, Any], shape: dict) -> Mods:
    """The mods a run of the code defined: its ``score_mod`` / ``mask_mod``, with its top-level
    tensors as the captured tensors, and its optional ``sinks`` ((H,) attention-sink logits) as
    ``Mods.sinks``.

    Raises:
        UserCodeError: neither mod is defined, one is not a function, or ``sinks`` is not an (H,)
            floating-point tensor.
    """
    import torch

    score_mod, mask_mod = namespace.get("score_mod"), namespace.get("mask_mod")
    if score_mod is None and mask_mod is None:
        raise UserCodeError(CodeProblem(
            "missing", "No mod defined",
            "Define a function named score_mod(score, b, h, q_idx, kv_idx) and/or "
            "mask_mod(b, h, q_idx, kv_idx) at the top level of the code."))
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise UserCodeError(CodeProblem(
                "signature", f"{name} is not a function",
                f"{name} is a {type(fn).__name__}; define it with def {name}(...) or assign a "
                "callable to it."))
    sinks = _sinks_of(namespace.get("sinks"), shape)
    # sinks is flex_attention's own argument, not a tensor the mods read.
    captured = {k: v for k, v in namespace.items()
                if isinstance(v, torch.Tensor) and not k.startswith("_") and k != "sinks"}
    return Mods(score_mod, mask_mod, captured,
                Shape(shape["B"], shape["Hq"], shape["Q_LEN"], shape["KV_LEN"],
                      torch.device(shape.get("device", "cpu"))), sinks=sinks)


def _sinks_of(sinks: Any, shape: dict):
    """The code's optional ``sinks`` (attention-sink logits for ``flex_attention(..., sinks=)``),
    moved to the shape's device; raises UserCodeError unless it is None or an (H,) float tensor."""
    import torch

    if sinks is None:
        return None
    H = shape["Hq"]
    expected = (f"sinks must be a floating-point torch.Tensor of shape ({H},): one attention-sink "
                f"logit per query head (H = {H}), e.g. sinks = torch.zeros(H, requires_grad=True)")
    if not isinstance(sinks, torch.Tensor):
        raise UserCodeError(CodeProblem("shape", "sinks is not a tensor",
                                        f"sinks is a {type(sinks).__name__}; {expected}."))
    if tuple(sinks.shape) != (H,) or not sinks.is_floating_point():
        raise UserCodeError(CodeProblem(
            "shape", "sinks has the wrong shape or dtype",
            f"sinks has shape {tuple(sinks.shape)} and dtype {sinks.dtype}; {expected}."))
    device = torch.device(shape.get("device", "cpu"))
    return sinks if sinks.device == device else sinks.to(device)


def run_code(code: str, shape: dict) -> Mods:
    """Run the code and return its mods. Raises UserCodeError saying what is wrong and where."""
    return mods_of(execute(code, shape), shape)


def code_shape_mismatch(namespace: Mapping[str, Any], shape: dict) -> list[str]:
    """Shape names the code (its namespace after a run) sets itself to values other than the
    shape controls'."""
    controls = {"B": shape["B"], "H": shape["Hq"], "Q_LEN": shape["Q_LEN"],
                "KV_LEN": shape["KV_LEN"], "D": shape["D"]}
    out = []
    for name, value in controls.items():
        got = namespace.get(name)
        if isinstance(got, int) and not isinstance(got, bool) and got != value:
            out.append(f"{name} = {got} (controls: {value})")
    return out
