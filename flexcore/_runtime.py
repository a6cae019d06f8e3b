"""Where kernels run: a CUDA GPU, or Triton's interpreter on machines without one."""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def use_interpreter() -> bool:
    """True when flexcore's Triton kernels run under Triton's interpreter (no CUDA GPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return not torch.cuda.is_available()


def prepare_triton() -> None:
    """Select the interpreter before any flexcore kernel module is decorated.

    ``TRITON_INTERPRET`` is read when ``@triton.jit`` runs, so every kernel module is imported
    lazily, after this call.
    """
    if use_interpreter():
        os.environ["TRITON_INTERPRET"] = "1"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
