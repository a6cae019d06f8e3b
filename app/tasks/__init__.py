"""The work the worker process does (:mod:`app.worker`); the app process never imports this
package, which imports the kernels.

:func:`run` calls a task by name. Tasks take JSON-like arguments and return plain data (dicts,
lists, numbers, numpy arrays); a problem with the user's code raises, and the worker reports it.
"""
from __future__ import annotations

import inspect
from typing import Callable

from app.tasks import info, numerics, timing, views
from app.tasks.mods import CodeTimeout, problem_of

TASKS: dict[str, Callable] = {
    "prepare": views.prepare,
    "mask_view": views.mask_view,
    "block_view": views.block_view,
    "score_view": views.score_view,
    "probs_view": views.probs_view,
    "gallery_view": views.gallery_view,
    "check": numerics.check,
    "gradients": numerics.gradients,
    "benchmark": timing.benchmark,
    "sweep": timing.sweep,
    "compare": timing.compare,
    "run_preset": timing.run_preset,
    "environment": info.environment,
    "providers": info.providers,
}


def run(task: str, kwargs: dict, progress: Callable[[float, str], None]):
    """Run the named task; tasks that take ``progress`` get the worker's progress callback."""
    fn = TASKS.get(task)
    if fn is None:
        raise ValueError(f"unknown worker task {task!r}; known: {', '.join(sorted(TASKS))}")
    if "progress" in inspect.signature(fn).parameters:
        return fn(**kwargs, progress=progress)
    return fn(**kwargs)


def startup_info() -> dict:
    return info.startup_info()


def warm_up() -> None:
    """Pay the first use of tracing (lazy imports) before the first request's clock starts."""
    views.prepare("def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
                  "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + (q_idx - kv_idx)\n",
                  {"B": 1, "Hq": 1, "Hkv": 1, "Q_LEN": 8, "KV_LEN": 8, "D": 8}, 0)


__all__ = ["run", "TASKS", "CodeTimeout", "problem_of", "startup_info", "warm_up"]
