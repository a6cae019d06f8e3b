"""The environment a run was measured in: device, driver, library versions, commit, time."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import socket
import statistics
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def _version(dist_name: str) -> str | None:
    # Package metadata only: importing triton here would run its @jit decorators before flexcore
    # selects Triton's interpreter on CPU machines.
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _flexlab_version() -> str | None:
    try:
        return importlib.metadata.version("flexlab")
    except importlib.metadata.PackageNotFoundError:
        pyproject = REPO_ROOT / "pyproject.toml"
        if pyproject.exists():
            for line in pyproject.read_text().splitlines():
                if line.strip().startswith("version"):
                    return line.split("=", 1)[1].strip().strip('"') + " (source tree)"
    return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return None


#: env key of the measured bf16 matmul peak (TFLOP/s), the roofline of the report's "% of peak".
PEAK_KEY = "bf16_matmul_tflops"


def capture(device: torch.device | str | None = None, *, peak: bool = False) -> dict:
    """A flat JSON-able dict describing this machine and checkout.

    Keys: time_utc, host, platform, python, device, gpu_name, gpu_count, gpu_memory_gb,
    compute_capability, driver, cuda, cudnn, torch, triton, flash_attn, flexlab, git_commit,
    git_dirty, git_branch, cpu, plan_cache (``FLEXLAB_PLAN_CACHE`` as set, None when unset), and
    ``bf16_matmul_tflops``: with ``peak`` on a GPU, the measured bf16 matmul peak
    (:func:`bench.timing.matmul_peak_tflops`); None otherwise (not measured).
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    info = {
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": str(device),
        "gpu_name": None, "gpu_count": 0, "gpu_memory_gb": None, "compute_capability": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flash_attn": _version("flash_attn") or _version("flash-attn"),
        "flexlab": _flexlab_version(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None,
        "git_branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
        "cpu": platform.processor() or platform.machine(),
        "plan_cache": os.environ.get("FLEXLAB_PLAN_CACHE"),
        PEAK_KEY: None,
    }
    status = _git("status", "--porcelain", "--untracked-files=no")
    info["git_dirty"] = None if status is None else bool(status)
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info.update(gpu_name=props.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_gb=round(props.total_memory / 2**30, 1),
                    compute_capability=f"{props.major}.{props.minor}", driver=_driver())
        try:
            info["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            pass
        if peak:
            from bench.timing import PEAK_MATMUL_SIZE, matmul_peak_tflops

            info[PEAK_KEY] = round(matmul_peak_tflops(device), 1)
            info["peak_method"] = (f"torch.matmul bf16 {PEAK_MATMUL_SIZE}x{PEAK_MATMUL_SIZE}x"
                                   f"{PEAK_MATMUL_SIZE}, median time")
    return info


def peak_tflops(envs: list) -> float | None:
    """The measured bf16 matmul peak of a run's environments (the median over its segments and
    processes that measured one), or None where none did (CPU runs, older results)."""
    values = [e[PEAK_KEY] for e in envs or [] if isinstance(e, dict)
              and isinstance(e.get(PEAK_KEY), (int, float)) and e[PEAK_KEY] > 0]
    return statistics.median(values) if values else None


def label(env: dict) -> str:
    """Short name of a run for comparisons: GPU (or CPU) and commit."""
    device = env.get("gpu_name") or f"cpu ({env.get('cpu') or 'unknown'})"
    commit = (env.get("git_commit") or "nocommit")[:8]
    return f"{device} @ {commit}" + ("+dirty" if env.get("git_dirty") else "")
