"""The Playground's work, done by the worker: check the code, draw it, compare it with float64,
time it, sweep it, set it beside another mod.

Views of the code (mask, block map, scores) are cached per (code, shape, seed); actions (Check,
Gradients, Benchmark, Sweep, Compare) return plain data that the page keeps as the experiment's
results.
"""
from __future__ import annotations

from typing import Callable

import streamlit as st

from app.services.common import (ActionFailed, call, limits, provider_label, shape_problem,
                                 workbench_dir)

PASS_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward+backward"}


def _items(shape: dict) -> tuple:
    return tuple(sorted(shape.items()))


def prepare(code: str, shape: dict, seed: int) -> dict:
    """Check the user's code in the worker (run it, lower its mods, probe every index).

    Returns:
        ``{"ok": True, "score_source", "mask_source", "tensors", "mismatch"}`` or
        ``{"ok": False, "problem": CodeProblem, "log_tail": str, "transient": bool}``; transient
        problems (the worker died, a time limit) are not remembered, so pressing again retries.
    """
    problem = shape_problem(shape)
    if problem is not None:
        return {"ok": False, "problem": problem, "log_tail": "", "transient": False}
    try:
        return _prepare(code, _items(shape), seed)
    except ActionFailed as e:
        return {"ok": False, "problem": e.problem, "log_tail": e.log_tail, "transient": True}


@st.cache_data(show_spinner=False, max_entries=64)
def _prepare(code: str, shape_items: tuple, seed: int) -> dict:
    try:
        return call("prepare", code=code, shape=dict(shape_items), seed=seed)
    except ActionFailed as e:
        if not e.cacheable:
            raise
        return {"ok": False, "problem": e.problem, "log_tail": "", "transient": False}


@st.cache_data(show_spinner=False, max_entries=128)
def _view(task: str, code: str, shape_items: tuple, seed: int, b: int, h: int,
          extra: tuple = ()) -> dict:
    return call(task, code=code, shape=dict(shape_items), seed=seed, b=b, h=h, **dict(extra))


def mask_view(code: str, shape: dict, seed: int, b: int, h: int) -> dict:
    """The token-level mask of head (b, h), pooled for display, with exact counts."""
    return _view("mask_view", code, _items(shape), seed, b, h)


def block_view(code: str, shape: dict, seed: int, b: int, h: int) -> dict:
    """Block map of (b, h), block counts over all heads, sparsity and forward FLOPs saved."""
    return _view("block_view", code, _items(shape), seed, b, h)


def score_view(code: str, shape: dict, seed: int, b: int, h: int, zero_scores: bool) -> dict:
    """Scores after the score_mod for (b, h) (masked positions blank)."""
    return _view("score_view", code, _items(shape), seed, b, h, (("zero_scores", zero_scores),))


def probs_view(code: str, shape: dict, seed: int, b: int, h: int) -> dict:
    """Attention probabilities of (b, h) on the seed's random q and k."""
    return _view("probs_view", code, _items(shape), seed, b, h)


def check(code: str, shape: dict, seed: int, dtypes: list[str], b: int, h: int) -> dict:
    """flexcore against float64 in each dtype; raises ActionFailed."""
    return call("check", code=code, shape=shape, seed=seed, dtypes=list(dtypes), b=b, h=h)


def gradients(code: str, shape: dict, seed: int) -> dict:
    """Gradients of flexcore and the providers against float64, in the shape's dtype."""
    return call("gradients", code=code, shape=shape, seed=seed, dtype=shape["dtype"])


def benchmark(code: str, shape: dict, seed: int, title: str, passes: list[str], fingerprint: str,
              progress: Callable[[float, str], None] | None = None) -> dict:
    """Every provider available here, for each pass: bench's rows, envs and run folder."""
    return call("benchmark", progress, code=code, shape=shape, seed=seed, title=title,
                passes=list(passes), out_dir=workbench_dir("playground", fingerprint))


def sweep(code: str, shape: dict, seed: int, title: str, lengths: list[int], pass_: str,
          providers: list[str], fingerprint: str,
          progress: Callable[[float, str], None] | None = None) -> dict:
    """Latency and TFLOP/s against S = Q_LEN = KV_LEN for each provider (bench's rows)."""
    return call("sweep", progress, code=code, shape=shape, seed=seed, title=title,
                lengths=[int(n) for n in lengths], pass_=pass_, providers=list(providers),
                out_dir=workbench_dir("sweeps", fingerprint))


def compare(code_a: str, code_b: str, label_a: str, label_b: str, shape: dict, seed: int, b: int,
            h: int, time_it: bool, key: str,
            progress: Callable[[float, str], None] | None = None) -> dict:
    """Two mods side by side: masks, block sparsity, output difference and flexcore's latency."""
    return call("compare", progress, code_a=code_a, code_b=code_b, label_a=label_a,
                label_b=label_b, shape=shape, seed=seed, b=b, h=h, time_it=time_it,
                out_dir=workbench_dir("compare", key))


def providers() -> list[dict]:
    """bench's providers, whether each runs here and why not (from the worker)."""
    return _providers()


@st.cache_data(show_spinner=False)
def _providers() -> list[dict]:
    return call("providers")


# ---------------------------------------------------------------------------------------------
# Tables of bench's long-form rows
# ---------------------------------------------------------------------------------------------

def benchmark_summary(rows: list[dict]) -> list[dict]:
    """One entry per (provider, pass): status, median/p20/p80 ms, TFLOP/s, peak memory, output
    error and whether it passed bench's tolerance, with bench's note."""
    out: dict[tuple, dict] = {}
    for r in rows:
        p = r["provider"]
        if p == "baseline":
            continue
        key = (p, r["pass"])
        entry = out.setdefault(key, {"provider": p, "label": provider_label(p), "pass": r["pass"],
                                     "status": "ok", "ms": None, "p20": None, "p80": None,
                                     "tflops": None, "peak_bytes": None, "out_max_abs": None,
                                     "correct": None, "note": ""})
        metric, value = r["metric"], r["value"]
        if metric == "status" or r["status"] not in ("ok", "fail"):
            entry["status"] = r["status"]
            entry["note"] = r.get("note") or entry["note"]
            continue
        if metric == "out_correct":
            entry["correct"] = bool(value) if value is not None else None
        field = {"time_ms": "ms", "time_ms_p20": "p20", "time_ms_p80": "p80", "tflops": "tflops",
                 "peak_mem_bytes": "peak_bytes", "out_max_abs": "out_max_abs"}.get(metric)
        if field is not None:
            entry[field] = value
        if metric == "time_ms" and r.get("note") and not entry["note"]:
            entry["note"] = r["note"]
    return list(out.values())


def latency_rows(summary: list[dict]) -> list[dict]:
    """Median latency per provider and pass, with the backward alone as (fwd+bwd − fwd) where a
    provider has both."""
    rows = [{"provider": s["label"], "pass": PASS_LABELS.get(s["pass"], s["pass"]), "ms": s["ms"]}
            for s in summary if s["ms"] is not None]
    by = {(s["provider"], s["pass"]): s for s in summary if s["ms"] is not None}
    for (provider, p), s in list(by.items()):
        if p == "fwd_bwd" and (provider, "fwd") in by:
            backward = s["ms"] - by[(provider, "fwd")]["ms"]
            if backward > 0:
                rows.append({"provider": s["label"], "pass": PASS_LABELS["bwd"], "ms": backward})
    order = {"forward": 0, "backward": 1, "forward+backward": 2}
    return sorted(rows, key=lambda r: (order.get(r["pass"], 3), r["provider"]))


def sweep_rows(rows: list[dict]) -> list[dict]:
    """``[{provider, S, ms, tflops}]`` of a sweep's successful timings."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r["provider"] == "baseline" or r["status"] != "ok" or r["metric"] not in ("time_ms",
                                                                                    "tflops"):
            continue
        entry = out.setdefault((r["provider"], int(r["kv_len"])),
                               {"provider": provider_label(r["provider"]), "S": int(r["kv_len"]),
                                "ms": None, "tflops": None})
        entry["ms" if r["metric"] == "time_ms" else "tflops"] = r["value"]
    return sorted(out.values(), key=lambda e: (e["provider"], e["S"]))


def not_timed(rows: list[dict]) -> list[dict]:
    """(provider, case) pairs that did not run, with bench's reason."""
    return [{"provider": provider_label(r["provider"]), "pass": PASS_LABELS.get(r["pass"], r["pass"]),
             "S": r["kv_len"], "status": r["status"], "reason": r.get("note") or ""}
            for r in rows if r["metric"] == "status" and r["provider"] != "baseline"]


def cpu_note() -> str:
    return " (CPU: not representative)" if limits().cpu_mode else ""
