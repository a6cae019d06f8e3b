"""Error metrics and tolerances relative to torch's own error (FlagAttention style).

A result passes when ``err(ours, golden) <= factor * err(torch_same_dtype, golden) + eps``, with the
golden computed in float64 (``flex_attention_reference(..., upcast=True)``) and the baseline being
torch's own computation in the tested dtype (e.g. ``upcast=False``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flexcore.errors import InputError

__all__ = ["error_metrics", "tolerance_check", "within_tolerance", "assert_close_to_reference",
           "ToleranceResult", "DEFAULT_EPS"]

#: Absolute slack added to the threshold, per dtype of the tested output: about two units in the
#: last place at 1.0, so a baseline that happens to be exact does not demand exactness.
DEFAULT_EPS = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3,
               torch.bfloat16: 1.6e-2}

METRICS = ("max_abs", "mean_abs", "rel_fro")


def error_metrics(out: Tensor, golden: Tensor) -> dict[str, float]:
    """Errors of ``out`` against ``golden``, computed in float64.

    Positions where both are the same infinity (e.g. lse = -inf of fully masked rows) count as
    exact. A NaN in either, or an infinity that does not match, makes every metric inf.

    Returns:
        ``{"max_abs": max|out - golden|, "mean_abs": mean|out - golden|,
        "rel_fro": ‖out - golden‖_F / ‖golden‖_F}`` (rel_fro is absolute when golden is all zero).
    """
    if not isinstance(out, Tensor) or not isinstance(golden, Tensor):
        raise InputError(f"error_metrics takes two tensors; got {type(out).__name__} and "
                         f"{type(golden).__name__}")
    if out.shape != golden.shape:
        raise InputError(f"error_metrics: out has shape {tuple(out.shape)} but golden has "
                         f"{tuple(golden.shape)}")
    a = out.detach().to(device=golden.device, dtype=torch.float64)
    g = golden.detach().to(torch.float64)
    if a.numel() == 0:
        return {"max_abs": 0.0, "mean_abs": 0.0, "rel_fro": 0.0}
    same_inf = torch.isinf(a) & torch.isinf(g) & (a == g)
    finite = torch.isfinite(a) & torch.isfinite(g)
    if not bool((same_inf | finite).all()):
        inf = float("inf")
        return {"max_abs": inf, "mean_abs": inf, "rel_fro": inf}
    diff = torch.where(finite, a - g, torch.zeros_like(a))
    g_finite = torch.where(finite, g, torch.zeros_like(g))
    abs_diff = diff.abs()
    norm_g = float(torch.linalg.vector_norm(g_finite))
    norm_d = float(torch.linalg.vector_norm(diff))
    return {"max_abs": float(abs_diff.max()), "mean_abs": float(abs_diff.mean()),
            "rel_fro": norm_d / norm_g if norm_g > 0 else norm_d}


@dataclass(frozen=True)
class ToleranceResult:
    """Outcome of :func:`tolerance_check`.

    Attributes:
        passed: ``errors[metric]`` is finite and at most ``threshold``.
        errors: :func:`error_metrics` of the tested output.
        baseline_errors: :func:`error_metrics` of the baseline.
        threshold: ``factor * baseline_errors[metric] + eps``.
        metric: the metric compared.
    """
    passed: bool
    errors: dict
    baseline_errors: dict
    threshold: float
    metric: str

    def __bool__(self) -> bool:
        return self.passed

    def describe(self, name: str = "out") -> str:
        return (f"{name}: {self.metric} = {self.errors[self.metric]:.3e} vs threshold "
                f"{self.threshold:.3e} (baseline {self.metric} = "
                f"{self.baseline_errors[self.metric]:.3e}); ours {_fmt(self.errors)}; "
                f"baseline {_fmt(self.baseline_errors)}")


def _fmt(errors: dict) -> str:
    return ", ".join(f"{k}={v:.3e}" for k, v in errors.items())


def within_tolerance(error: float, threshold: float) -> bool:
    """Whether an error passes its threshold. A non-finite error (NaN, or an infinity the
    reference lacks) never passes, even where the baseline's is non-finite too: its threshold is
    then inf, and inf <= inf would pass any result."""
    return math.isfinite(error) and error <= threshold


def tolerance_check(out: Tensor, golden: Tensor, baseline: Tensor, factor: float = 2.0,
                    atol: float | None = None, metric: str = "max_abs") -> ToleranceResult:
    """Pass iff ``err(out) <= factor * err(baseline) + eps`` (errors against ``golden``).

    Args:
        out: the tested result.
        golden: float64 reference of the same shape.
        baseline: torch's own result in the tested dtype (e.g. the reference with upcast=False).
        factor: allowed ratio to the baseline's error.
        atol: the eps; default ``DEFAULT_EPS[out.dtype]`` (1e-5 for dtypes not listed).
        metric: one of "max_abs", "mean_abs", "rel_fro".

    Example:
        >>> res = tolerance_check(ours, golden, torch_same_dtype)
        >>> assert res.passed, res.describe()
    """
    if metric not in METRICS:
        raise InputError(f"metric must be one of {METRICS}; got {metric!r}")
    if factor < 0:
        raise InputError(f"factor must be >= 0; got {factor}")
    eps = DEFAULT_EPS.get(out.dtype, 1e-5) if atol is None else atol
    errors = error_metrics(out, golden)
    baseline_errors = error_metrics(baseline, golden)
    threshold = factor * baseline_errors[metric] + eps
    return ToleranceResult(passed=within_tolerance(errors[metric], threshold), errors=errors,
                           baseline_errors=baseline_errors, threshold=threshold, metric=metric)


def assert_close_to_reference(out: Tensor, golden: Tensor, baseline: Tensor, factor: float = 2.0,
                              atol: float | None = None, metric: str = "max_abs",
                              name: str = "out") -> ToleranceResult:
    """Assert :func:`tolerance_check`; the failure message shows both errors.

    Example:
        >>> assert_close_to_reference(out, golden, torch_out, name="dq")
    """
    result = tolerance_check(out, golden, baseline, factor=factor, atol=atol, metric=metric)
    if not result.passed:
        raise AssertionError(f"{result.describe(name)} (factor {factor})")
    return result
