"""What the worker reports about its machine: device, versions, providers (for the Environment
page and each result's provenance)."""
from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from app.tasks.mods import device
from bench.env import capture
from bench.providers import PROVIDERS, availability


def _version(dist: str) -> str:
    # Package metadata only: importing triton here would run its @jit decorators early.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def startup_info() -> dict:
    """Sent once when the worker is ready: what it runs on."""
    info = {"pid": os.getpid(), "device": device(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": _version("triton")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def environment() -> dict:
    """bench's environment capture of this machine and checkout (flat JSON values only)."""
    env = capture(device())
    return {k: v for k, v in env.items() if isinstance(v, (str, int, float, bool)) or v is None}


def providers() -> list[dict]:
    """Each attention provider bench knows, whether it runs here, and why not."""
    out = []
    for name, (ok, why) in availability(torch.device(device())).items():
        out.append({"name": name, "available": bool(ok), "reason": why,
                    "description": getattr(PROVIDERS.get(name), "description", "")})
    return out
