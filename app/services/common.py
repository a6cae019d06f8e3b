"""What every page shares: the machine's limits, shapes, fingerprints, and calls to the worker.

Pages never run the user's code or a kernel themselves: :func:`call` sends the work to the worker
process (:mod:`app.client`) and turns every way it can fail into an :class:`ActionFailed` that
carries a :class:`app.usercode.CodeProblem` to show.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import streamlit as st

from app import client
from app.settings import REPO_ROOT
from app.usercode import CodeProblem

DTYPES = ("float32", "float16", "bfloat16")
#: The shape keys of an experiment, in display order.
SHAPE_KEYS = ("B", "Hq", "Hkv", "Q_LEN", "KV_LEN", "D", "dtype", "BLOCK_SIZE")

#: Seconds each worker task may take before the worker is stopped (CPU mode runs Triton's
#: interpreter: a benchmark of every provider takes minutes there).
TIMEOUTS_S = {"prepare": 60, "mask_view": 120, "block_view": 120, "score_view": 120,
              "probs_view": 120, "gallery_view": 120, "check": 600, "gradients": 900,
              "benchmark": 1800, "sweep": 3600, "compare": 1200, "run_preset": 3600,
              "environment": 120, "providers": 120}

def provider_label(name: str) -> str:
    """How the pages name a bench provider: bench's ``flexlab*`` providers run flexcore's kernels,
    and the pages call them so (as Check and Gradients do)."""
    return "flexcore" + name[len("flexlab"):] if name.startswith("flexlab") else name


class ActionFailed(Exception):
    """Work sent to the worker did not produce a result.

    Attributes:
        problem: what to show (the user's line where known).
        log_tail: the worker's last log lines when it died (its crash report), else "".
        cacheable: whether the same request would fail the same way (a problem in the code), as
            opposed to a timeout or a dead worker.
    """

    def __init__(self, problem: CodeProblem, log_tail: str = "", cacheable: bool = False):
        super().__init__(f"{problem.title}: {problem.message}")
        self.problem, self.log_tail, self.cacheable = problem, log_tail, cacheable


def call(task: str, progress: Callable[[float, str], None] | None = None, **kwargs) -> Any:
    """Run a task in the worker and return its value.

    Raises:
        ActionFailed: the code has a problem, the task failed, or the worker died (it is then
            restarted, and the problem says so in plain words).
    """
    try:
        return client.worker().call(task, kwargs, TIMEOUTS_S.get(task, 600), progress)
    except client.RemoteError as e:
        problem = CodeProblem.from_dict(e.problem)
        code = kwargs.get("code")
        if problem.lineno and not problem.line and isinstance(code, str):
            from app.usercode import source_line

            problem = CodeProblem(problem.kind, problem.title, problem.message, problem.lineno,
                                  source_line(code, problem.lineno), problem.op)
        raise ActionFailed(problem, cacheable=problem.kind not in ("timeout", "worker",
                                                                   "memory")) from None
    except client.WorkerFailed as e:
        raise ActionFailed(CodeProblem("worker", e.title, e.message), e.log_tail) from None


# ---------------------------------------------------------------------------------------------
# Machine and limits
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """What the shape controls allow on this machine.

    In CPU mode Triton kernels run under Triton's interpreter (about 3 ms per inner-loop step), so
    shapes are capped to what it runs in seconds and timings are not representative.
    """

    cpu_mode: bool
    device: str
    max_len: int
    max_bh: int
    max_d: int
    block_sizes: tuple[int, ...]
    default_block: int
    sweep_lengths: tuple[int, ...]

    def describe(self) -> str:
        if not self.cpu_mode:
            return "GPU mode: flexcore's Triton kernels run on the GPU."
        return (f"CPU mode: no CUDA GPU, so flexcore's kernels run under Triton's interpreter. "
                f"Shapes are limited to Q_LEN, KV_LEN ≤ {self.max_len}, B·Hq ≤ {self.max_bh} and "
                f"D ≤ {self.max_d} so that every action finishes in seconds; timings measured here "
                f"are not representative of GPU performance.")


@st.cache_resource
def limits() -> Limits:
    import torch

    if torch.cuda.is_available():
        return Limits(False, "cuda", 65536, 256, 256, (64, 128, 256), 128,
                      (512, 1024, 2048, 4096, 8192, 16384, 32768))
    return Limits(True, "cpu", 256, 8, 64, (16, 32, 64, 128), 32, (32, 64, 128, 256))


def default_shape() -> dict:
    lim = limits()
    if lim.cpu_mode:
        return dict(B=1, Hq=2, Hkv=2, Q_LEN=128, KV_LEN=128, D=32, dtype="float32",
                    BLOCK_SIZE=lim.default_block)
    return dict(B=2, Hq=16, Hkv=16, Q_LEN=4096, KV_LEN=4096, D=128, dtype="bfloat16",
                BLOCK_SIZE=lim.default_block)


def shape_problem(shape: dict) -> CodeProblem | None:
    """Why a shape cannot be attended, or None."""
    lim = limits()
    if shape["Hq"] % shape["Hkv"]:
        return CodeProblem("shape", "Impossible shape",
                           f"Hq = {shape['Hq']} query heads cannot be shared among Hkv = "
                           f"{shape['Hkv']} key/value heads: Hq must be a multiple of Hkv "
                           "(grouped-query attention). Change Hq or Hkv.")
    if lim.cpu_mode:
        over = [f"{k} = {shape[k]}" for k in ("Q_LEN", "KV_LEN") if shape[k] > lim.max_len]
        if shape["B"] * shape["Hq"] > lim.max_bh:
            over.append(f"B·Hq = {shape['B'] * shape['Hq']}")
        if shape["D"] > lim.max_d:
            over.append(f"D = {shape['D']}")
        if over:
            return CodeProblem("shape", "Shape too large for CPU mode",
                               f"{', '.join(over)} exceeds what the interpreter runs in seconds. "
                               + lim.describe())
    return None


def fingerprint(code: str, shape: dict, seed: int) -> str:
    """The identity of what a result was computed from: code, shape (with dtype and BLOCK_SIZE)
    and seed. A result whose fingerprint differs from the editor's is stale."""
    data = json.dumps({"code": code, "shape": {k: shape.get(k) for k in SHAPE_KEYS},
                       "seed": int(seed)}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Provenance and folders
# ---------------------------------------------------------------------------------------------

def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when tracked files changed since."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    dirty = _git_dirty()
    return head + ("+dirty" if dirty else "")


def _git_dirty() -> bool:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


def worker_info() -> dict:
    """What the worker runs on (device, versions), waiting for it to start if needed."""
    try:
        return client.worker().ready_info()
    except client.WorkerFailed as e:
        raise ActionFailed(CodeProblem("worker", e.title, e.message), e.log_tail) from None


def provenance() -> dict:
    """Where a result was computed: commit, device and versions (kept with every result)."""
    info = worker_info()
    return {"commit": commit(), "device": info.get("gpu") or info.get("device"),
            "torch": info.get("torch"), "triton": info.get("triton"),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def results_dir() -> Path:
    """bench's results folder: ``$FLEXLAB_RESULTS_DIR``, else ``results/`` of the repository."""
    return Path(os.environ.get("FLEXLAB_RESULTS_DIR") or REPO_ROOT / "results")


def workbench_dir(*parts: str) -> str:
    """A folder under ``results/workbench`` (git-ignored) for the runs the workbench makes."""
    path = results_dir().joinpath("workbench", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return str(path)
