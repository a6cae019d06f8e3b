"""Kernel options that change flexcore's dispatch rules, for tests that pin a path."""
from __future__ import annotations

from flexcore.kernels.policy import DispatchPolicy
from flexcore.options import KernelOptions


def policy_options(fields: dict | None = None, **families) -> KernelOptions:
    """KernelOptions with ``fields`` (other KernelOptions fields) whose policy differs from the
    defaults in the given fields per family:
    ``policy_options(forward={"refine": "on"}, backward={"fused": "off"})``."""
    return KernelOptions(**(fields or {}), policy=DispatchPolicy().replace(**families))
