"""Choosing between timed kernel candidates the same way in every process: a tie rule over
interleaved timings, and the choices persisted per GPU and versions.

Timings of near-equal candidates differ by noise from one process to the next, so the fastest by
timing alone is not a stable choice. Each candidate is timed over several rounds (:func:`benchmark`
for triton's autotuner, :func:`time_candidates` for other timed choices), and :func:`choose` keeps, among the candidates within
``TuneRule.tolerance`` of the fastest median, the earliest in the candidates' order: the kernels
list their candidates best first, so that order is the documented preference
(docs/decisions.md#deterministic-choice). :class:`ChoiceCache` keeps the first process's choice on
disk, keyed by the GPU, the library versions and the kernel and problem, so that later processes
launch the same configuration without timing again.

Where the cache lives: ``FLEXLAB_PLAN_CACHE`` unset, empty, ``1`` or ``on``: under
``$XDG_CACHE_HOME/flexlab/plans`` (``~/.cache/flexlab/plans`` without it); ``0``, ``off``, ``no`` or
``false``: no cache; anything else: that folder. A :class:`TuneRule` with ``plan_cache`` "on" or "off"
overrides the variable.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Mapping, Sequence

from flexcore.errors import InputError

Switch = Literal["auto", "on", "off"]

#: ``timer(call)``: run ``call`` repeatedly and return its times in ms (one round of samples).
Timer = Callable[[Callable[[], object]], Sequence[float]]

_OFF = ("0", "off", "no", "false")
_ON = ("", "1", "on", "yes", "true")


@dataclass(frozen=True)
class TuneRule:
    """How timed candidates are compared and remembered.

    Attributes:
        tolerance: candidates whose median is within this fraction of the fastest median tie; the
            earliest of them in preference order wins.
        rounds: timing rounds per candidate, each a warm-up and ``rep_ms`` of samples; a
            candidate's median is taken over the samples of all its rounds.
        rep_ms: time spent timing one candidate in one round.
        warmup_ms: warm-up of one candidate before each round's samples.
        plan_cache: "auto": as ``FLEXLAB_PLAN_CACHE`` says (on by default); "on": always (in
            ``cache_dir`` when given); "off": never read nor write persisted choices.
        cache_dir: the folder of persisted choices; None: the default (see the module docstring).
    """

    tolerance: float = 0.02
    rounds: int = 4
    rep_ms: float = 30.0
    warmup_ms: float = 10.0
    plan_cache: Switch = "auto"
    cache_dir: str | None = None

    def __post_init__(self):
        for name, low in (("tolerance", 0.0), ("rep_ms", 0.0), ("warmup_ms", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
                raise InputError(f"TuneRule.{name} = {value!r}: expected a number >= {low:g}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise InputError(f"TuneRule.rounds = {self.rounds!r}: expected an int >= 1")
        if self.plan_cache not in ("auto", "on", "off"):
            raise InputError(f"TuneRule.plan_cache = {self.plan_cache!r}: expected 'auto', 'on' or 'off'")


DEFAULT_RULE = TuneRule()


def choose(times_ms: Sequence[float], tolerance: float) -> int:
    """The index of the candidate to keep: the first (in the given, preference order) whose time
    is at most ``(1 + tolerance)`` times the fastest. Candidates that failed carry ``inf``; when
    every one failed the first is kept (its launch then reports why).

    Example:
        >>> choose([1.01, 1.00, 1.30], tolerance=0.02)   # 1.01 ties with 1.00: the first wins
        0
    """
    if not times_ms:
        raise ValueError("choose() needs at least one candidate time")
    finite = [t for t in times_ms if math.isfinite(t)]
    if not finite:
        return 0
    limit = min(finite) * (1.0 + tolerance)
    return next(i for i, t in enumerate(times_ms) if t <= limit)


def _samples(rule: TuneRule, timer: Timer | None, call: Callable[[], object]) -> list[float]:
    if timer is None:
        from triton.testing import do_bench

        return list(do_bench(call, warmup=rule.warmup_ms, rep=rule.rep_ms, return_mode="all"))
    return [float(t) for t in timer(call)]


def benchmark(rule: TuneRule = DEFAULT_RULE, timer: Timer | None = None):
    """A benchmark for triton's autotuner (its ``do_bench(kernel_call, quantiles)``): the
    ``quantiles`` of one configuration's samples pooled over ``rule.rounds`` rounds, each of
    ``rule.rep_ms`` after ``rule.warmup_ms`` of warm-up. ``timer``: one round's samples
    (:data:`Timer`); default: triton's ``do_bench``, which flushes L2 before each sample."""
    def bench(kernel_call: Callable[[], object], quantiles: Sequence[float] = (0.5, 0.2, 0.8)):
        import torch

        samples: list[float] = []
        for _ in range(rule.rounds):
            samples += _samples(rule, timer, kernel_call)
        if not samples:
            return [math.inf] * len(quantiles)
        values = torch.tensor(samples, dtype=torch.float64)
        return values.quantile(torch.tensor(list(quantiles), dtype=torch.float64)).tolist()
    return bench


def time_candidates(calls: Sequence[Callable[[], object]], rule: TuneRule = DEFAULT_RULE,
                    timer: Timer | None = None) -> list[float]:
    """Median time in ms of each call, over ``rule.rounds`` rounds that each time every call in
    turn (so that a drift of the GPU's clocks falls on all of them alike), samples pooled. For
    choices made outside triton's autotuner (one launch against two, say), with :func:`choose`."""
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(rule.rounds):
        for i, call in enumerate(calls):
            samples[i] += _samples(rule, timer, call)
    return [statistics.median(s) if s else math.inf for s in samples]


# ---- persisted choices --------------------------------------------------------------------------


def environment() -> dict[str, str | None]:
    """What a persisted choice depends on besides the kernel and the problem: the current GPU's
    name and compute capability, and the versions of CUDA, torch, triton and flexlab."""
    import importlib.metadata

    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {"gpu": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": version("triton"),
            "flexlab": version("flexlab")}


def cache_location(rule: TuneRule = DEFAULT_RULE, env: Mapping[str, str] | None = None) -> Path | None:
    """The folder of persisted choices under ``rule`` and the environment variables ``env``
    (default ``os.environ``), or None where the cache is off."""
    env = os.environ if env is None else env
    if rule.plan_cache == "off":
        return None
    setting = env.get("FLEXLAB_PLAN_CACHE", "").strip()
    if rule.plan_cache == "auto" and setting.lower() in _OFF:
        return None
    if rule.cache_dir:
        return Path(rule.cache_dir)
    if setting and setting.lower() not in _ON + _OFF:
        return Path(setting).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flexlab" / "plans"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ChoiceCache:
    """Choices kept on disk, one small JSON file per (environment, key) under
    ``folder/<digest of the environment>/``.

    A file is written once, by the first process to choose (an exclusive link of a complete file),
    and never replaced: a later or concurrent process reads that choice, so every process on the
    same GPU and versions launches the same configuration. Files that do not parse, or whose
    environment or key differ from the digest's, read as absent.
    """

    def __init__(self, folder: str | os.PathLike, environment: Mapping[str, str | None]):
        self.environment = dict(environment)
        self.folder = Path(folder) / _digest(json.dumps(self.environment, sort_keys=True))

    def _path(self, key: str) -> Path:
        return self.folder / f"{_digest(key)}.json"

    def get(self, key: str) -> dict | None:
        """The entry stored under ``key`` for this environment, or None."""
        try:
            data = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("environment") != self.environment or data.get("key") != key:
            return None
        entry = data.get("entry")
        return entry if isinstance(entry, dict) else None

    def put(self, key: str, entry: dict) -> dict:
        """Store ``entry`` under ``key`` unless an entry is there already; return the stored one.
        A folder that cannot be written leaves nothing stored and returns ``entry``."""
        path = self._path(key)
        text = json.dumps({"environment": self.environment, "key": key, "entry": entry}, indent=1)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=path.name + ".", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.link(tmp, path)  # fails where another process stored its choice first
            finally:
                os.unlink(tmp)
        except FileExistsError:
            stored = self.get(key)
            return entry if stored is None else stored
        except OSError:
            return entry
        return entry


def cache_for(rule: TuneRule = DEFAULT_RULE) -> ChoiceCache | None:
    """The persisted choices of the current GPU under ``rule``; None where the cache is off, or
    without a CUDA device (choices are kept per GPU)."""
    import torch

    folder = cache_location(rule)
    if folder is None or not torch.cuda.is_available():
        return None
    return ChoiceCache(folder, environment())
