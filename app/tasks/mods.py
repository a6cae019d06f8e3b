"""The user's code inside the worker: run once per (code, shape, seed), seeded, under a time limit.

Every action of the Playground gets its mods from :func:`mods_for`, so the float64 reference and
every candidate (bench's providers included, which take the mods in memory) read the very same
captured tensors, even ``torch.randn`` ones created without a seed: the code runs under
``torch.manual_seed(seed)`` and its mods are kept for later actions.
"""
from __future__ import annotations

import collections
import contextlib
import random
import signal
import threading
from typing import Any

import torch

from app.usercode import (FILENAME, CodeProblem, UserCodeError, execute, mods_of,
                          problem_from_exception, source_line)
from variants.core import Mods

#: Seconds the user's own Python (the code, and tracing its mods) may run before it is stopped.
CODE_SECONDS_CPU = 5.0
CODE_SECONDS_GPU = 15.0
_KEPT = 16


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def code_seconds() -> float:
    return CODE_SECONDS_GPU if device() == "cuda" else CODE_SECONDS_CPU


class CodeTimeout(BaseException):
    """The user's code ran past its time limit (a BaseException, so that the user's own
    ``except Exception`` cannot swallow it)."""

    def __init__(self, seconds: float, code: str, lineno: int | None):
        super().__init__(f"stopped after {seconds:g} s")
        self.seconds, self.code, self.lineno = seconds, code, lineno

    def problem(self) -> CodeProblem:
        if self.lineno is not None:
            message = (f"The code was still running at line {self.lineno} after {self.seconds:g} s "
                       "(an endless loop such as `while True`?). It was stopped. Make every loop "
                       "finish and run again.")
        else:
            message = (f"The code did not finish within {self.seconds:g} s, inside the libraries "
                       "rather than on one of your lines: the shape may be too large for this "
                       "machine. It was stopped. Try a smaller shape.")
        return CodeProblem("timeout", "Stopped: the code did not finish", message, self.lineno,
                           source_line(self.code, self.lineno))


_LIMIT = threading.local()


@contextlib.contextmanager
def time_limit(code: str, seconds: float | None = None):
    """Stop the user's code after ``seconds`` with :class:`CodeTimeout` naming its line.

    Nested uses keep the outermost limit. The alarm is a signal, so this works on the worker's
    main thread only (where requests run).
    """
    if getattr(_LIMIT, "active", False) or threading.current_thread() is not threading.main_thread():
        yield
        return
    seconds = code_seconds() if seconds is None else seconds

    def alarm(signum, frame):
        lineno = None
        while frame is not None:
            if frame.f_code.co_filename == FILENAME:
                lineno = frame.f_lineno
                break
            frame = frame.f_back
        raise CodeTimeout(seconds, code, lineno)

    previous = signal.signal(signal.SIGALRM, alarm)
    _LIMIT.active = True
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _LIMIT.active = False


def seed_everything(seed: int) -> None:
    """The state the user's code starts from: the seed, and torch's defaults it may have changed."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def code_shape(shape: dict) -> dict:
    """The part of the shape the user's code sees (names it reads, and the device)."""
    return {k: int(shape[k]) for k in ("B", "Hq", "Hkv", "Q_LEN", "KV_LEN", "D")} | {"device": device()}


#: (code, code shape, seed) -> (its mods, its namespace), the last few runs.
_CACHE: collections.OrderedDict = collections.OrderedDict()


def _run(code: str, shape: dict, seed: int) -> tuple[Mods, dict[str, Any]]:
    cshape = code_shape(shape)
    key = (code, tuple(sorted(cshape.items())), int(seed))
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    seed_everything(seed)
    with time_limit(code):
        namespace = execute(code, cshape)
    _CACHE[key] = (mods_of(namespace, cshape), namespace)
    while len(_CACHE) > _KEPT:
        _CACHE.popitem(last=False)
    return _CACHE[key]


def mods_for(code: str, shape: dict, seed: int) -> Mods:
    """The user's mods at this shape and seed: the code runs the first time, later calls share its
    result (and so its captured tensors). Never mutate what it returns.

    Raises:
        UserCodeError: the code failed (its problem names the line).
        CodeTimeout: it ran past the time limit.
    """
    return _run(code, shape, seed)[0]


def namespace_for(code: str, shape: dict, seed: int) -> dict[str, Any]:
    """The globals of the run :func:`mods_for` keeps (the code runs only if it has not yet)."""
    return _run(code, shape, seed)[1]


def problem_of(exc: BaseException, code: str, stage: str) -> CodeProblem:
    """A CodeProblem for an exception raised while working on the user's code."""
    if isinstance(exc, CodeTimeout):
        return exc.problem()
    if isinstance(exc, UserCodeError):
        return exc.problem
    if isinstance(exc, NotImplementedError):
        return CodeProblem("unavailable", "Not available yet", str(exc))
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
        return CodeProblem("memory", "Out of GPU memory", f"{exc}".splitlines()[0] +
                           " Try a smaller shape.")
    return problem_from_exception(exc, code, stage)
