"""Benchmarks (run in the worker): the Playground's mods, a sequence-length sweep, two mods
compared, and bench's presets, all through bench's runner (:func:`bench.runner.run_grid`).

bench takes the Playground's mods in memory, those :func:`app.tasks.mods.mods_for` keeps: the timed
mods read the same captured tensors as Check and Gradients, and the code runs once per shape.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from app.names import file_safe
from app.tasks.mods import device, mods_for
from app.tasks.numerics import output_difference
from app.tasks.views import (CHUNK_POSITIONS, block_mask_of, block_view_of, mask_view_of,
                             pool_factors, pool_sums, slice_mod)
from bench.grid import Case, Grid, Settings, build_grid, load_config
from bench.providers import PROVIDERS
from bench.runner import ModsSource, run_grid
from flexcore import create_mask


def _run(grid: Grid, out_dir: str, progress: Callable[[float, str], None],
         mods: ModsSource | None = None) -> dict:
    """Run ``grid`` into ``out_dir`` (replacing an earlier run there), reporting each case."""
    def report(done: int, total: int, case: Case) -> None:
        progress(done / max(total, 1), f"{done}/{total} cases done; {case.case_id[:80]}")

    data = run_grid(grid, out_dir, mods=mods, progress=report, device=device(), force=True)
    return {"rows": data["rows"], "envs": data.get("envs", []), "path": str(out_dir)}


def label(title: str, limit: int = 40) -> str:
    """The variant label of an experiment's rows: its name, file-name-safe (reports and the
    Benchmarks page show it; ``|`` would split bench's case ids)."""
    return file_safe(title, "playground", limit=limit)


def _case(variant: str, shape: dict, pass_: str, q_len: int | None = None) -> Case:
    L = q_len or shape["Q_LEN"]
    S = q_len or shape["KV_LEN"]
    return Case(variant, shape["B"], shape["Hq"], shape["Hkv"], L, S, shape["D"], shape["D"],
                shape["dtype"], pass_)


def _settings(shape: dict, seed: int) -> Settings:
    # Three wall-clock repetitions on the CPU: the interpreter takes seconds per call.
    return Settings(block_size=shape["BLOCK_SIZE"], cpu_reps=3, seed=seed)


def benchmark(code: str, shape: dict, seed: int, title: str, passes: list[str], out_dir: str,
              progress) -> dict:
    """Every provider available here on the Playground's mods, for each pass (``fwd``,
    ``fwd_bwd``): latency, TFLOP/s, peak memory and output errors (bench's long-form rows)."""
    mods = mods_for(code, shape, seed)  # the code's problems surface here, with its line
    grid = Grid("playground", [_case(label(title), shape, p) for p in passes], list(PROVIDERS),
                _settings(shape, seed))
    return _run(grid, out_dir, progress, mods)


def sweep(code: str, shape: dict, seed: int, title: str, lengths: list[int], pass_: str,
          providers: list[str], out_dir: str, progress) -> dict:
    """Latency and TFLOP/s against the sequence length (Q_LEN = KV_LEN = S) for each provider; the
    code runs once per length (its captured tensors follow Q_LEN and KV_LEN), before any timing,
    so that its problems surface with their line."""
    by_length = {s: mods_for(code, {**shape, "Q_LEN": s, "KV_LEN": s}, seed)
                 for s in sorted({int(n) for n in lengths})}
    cases = [_case(label(title), shape, pass_, s) for s in by_length]
    return _run(Grid("sweep", cases, list(providers), _settings(shape, seed)), out_dir, progress,
                lambda case: by_length[case.q_len])


def _mask_comparison(mods_a, mods_b, shape: dict, b: int, h: int) -> dict:
    """Both masks of (b, h) pooled, their difference, and exact counts of where they differ."""
    L, S = shape["Q_LEN"], shape["KV_LEN"]
    rs, cs = pool_factors(L, S)
    both = only_a = only_b = 0
    diff = []

    def dense(mods, q0, rows):
        if mods.mask_mod is None:
            return np.ones((rows, S), dtype=bool)
        return create_mask(slice_mod(mods.mask_mod, b, h, False, q0), 1, 1, rows, S,
                           device=device())[0, 0].cpu().numpy()

    step = max(rs, (CHUNK_POSITIONS // max(S, 1)) // rs * rs)
    for q0 in range(0, L, step):
        rows = min(step, L - q0)
        a, c = dense(mods_a, q0, rows), dense(mods_b, q0, rows)
        both += int((a & c).sum())
        only_a += int((a & ~c).sum())
        only_b += int((~a & c).sum())
        n = np.maximum(pool_sums(np.ones(a.shape), rs, cs), 1)
        diff.append((pool_sums(a, rs, cs) - pool_sums(c, rs, cs)) / n)
    return {"pooled": np.concatenate(diff).astype(np.float32), "pool": (rs, cs), "both": both,
            "only_a": only_a, "only_b": only_b, "total": L * S}


def compare(code_a: str, code_b: str, label_a: str, label_b: str, shape: dict, seed: int, b: int,
            h: int, time_it: bool, out_dir: str, progress) -> dict:
    """Two mods side by side at one shape: masks, block sparsity, outputs and flexcore's latency."""
    mods_a, mods_b = mods_for(code_a, shape, seed), mods_for(code_b, shape, seed)
    L, S = shape["Q_LEN"], shape["KV_LEN"]
    out = {"labels": [label_a, label_b],
           "masks": [mask_view_of(m, L, S, b, h) for m in (mods_a, mods_b)],
           "blocks": [block_view_of(block_mask_of(m, shape), shape, b, h) for m in (mods_a, mods_b)],
           "mask_difference": _mask_comparison(mods_a, mods_b, shape, b, h)}
    progress(0.2, "outputs")
    out["outputs"] = output_difference(code_a, code_b, shape, seed, b, h)
    out["timing"] = None
    if time_it:
        specs = [label(label_a), label(label_b)]
        if specs[0] == specs[1]:
            specs = [f"{specs[0]}_a", f"{specs[1]}_b"]
        by_spec = dict(zip(specs, (mods_a, mods_b)))
        grid = Grid("compare", [_case(s, shape, "fwd") for s in specs], ["flexlab"],
                    _settings(shape, seed))
        timing = _run(grid, out_dir, lambda f, text: progress(0.3 + 0.7 * f, text),
                      lambda case: by_spec[case.variant])
        out["timing"] = {**timing, "specs": specs}
    return out


def run_preset(name: str, out_dir: str, progress) -> dict:
    """Run one of bench's presets into ``out_dir``; its loaded results."""
    return _run(build_grid(load_config(name), name), out_dir, progress)


__all__ = ["benchmark", "sweep", "compare", "run_preset"]
