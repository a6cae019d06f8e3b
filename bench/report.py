"""Reports of benchmark results: offline HTML, markdown summary, PNG figures and the CSV.

``python -m bench report RESULTS [RESULTS ...] --out DIR`` writes into DIR:

- ``report.html``: self-contained (plotly's JavaScript inlined, no network): speed-up bars per
  variant, TFLOP/s against sequence length, the summary, error and status tables, the environments.
  Without plotly the same page embeds the matplotlib PNGs instead.
- ``summary.md``: the summary table (TFLOP/s, its fraction of the GPU's measured bf16 matmul peak,
  and median ms per provider), the run-to-run spread of a run of several processes, and the
  error table.
- ``figures/*.png``: matplotlib figures.
- ``results.csv``: every row of every input, with a ``source`` column naming its run.

Several inputs (two GPUs, two commits) are compared side by side: each is a ``source``. A run of
several processes (``run --processes N``, bench.spread) shows the median over its processes in each
cell (the errors: the worst process's), and the spread of the processes' median times in a table
of its own.
"""
from __future__ import annotations

import base64
import html
import io
import math
import os
import shutil
import statistics
import tempfile
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench import env as env_mod
from bench import spread as spread_mod
from bench.runner import COLUMNS, load_results
from bench.timing import PEAK_MATMUL_SIZE

PASS_LABELS = {"fwd": "forward", "fp8": "FP8 forward (float8_e4m3fn in, bfloat16 out)",
               "fwd_bwd": "forward+backward", "decode": "decode",
               "train_step": "train step (block forward+backward)"}
_BASELINE_ORDER = ("torch_flex", "sdpa_cudnn", "sdpa_flash", "sdpa_math")


class ReportError(ValueError):
    """A report cannot be written where asked (the message says why and what to do)."""


class ReportExistsError(ReportError, FileExistsError):
    """The report folder exists; pass --force to overwrite it."""


#: What a report folder holds; ``--force`` replaces only a folder that holds nothing else.
REPORT_FILES = ("report.html", "summary.md", "results.csv", "figures")


@dataclass
class Source:
    label: str
    path: str
    envs: list
    rows: list
    notes: list = field(default_factory=list)  #: what a reader must know beside the table (:func:`_notes`)


@dataclass
class Cell:
    """A (source, case, provider): its metrics and status. In a run of several processes each
    metric is the median over the processes, but for the correctness metrics (``out_max_abs``,
    ``out_correct``, ...), which are the worst process's (:func:`_worst_process`); and
    ``process_times`` holds each process's median time (ms) by process number."""

    metrics: dict
    status: str
    note: str
    process_times: dict = field(default_factory=dict)


def load_sources(paths, labels=None) -> list[Source]:
    sources = []
    for i, path in enumerate(paths):
        data = load_results(path)
        envs = data.get("envs") or []
        label = labels[i] if labels and i < len(labels) else (
            env_mod.label(envs[-1]) if envs else Path(path).stem)
        sources.append(Source(label, str(path), envs, data["rows"], _notes(data)))
    seen = defaultdict(int)
    for s in sources:  # two runs on the same GPU and commit still need distinct names
        seen[s.label] += 1
    counts = defaultdict(int)
    for s in sources:
        if seen[s.label] > 1:
            counts[s.label] += 1
            s.label = f"{s.label} #{counts[s.label]} ({Path(s.path).name})"
    return sources


def _notes(data: dict) -> list[str]:
    """What the table of a results payload does not show: a run that is not finished (its table
    holds fewer cases than its config), and records of rows.jsonl outside its config.json (left
    out of the table)."""
    notes = []
    done, total = data.get("cases_done"), data.get("cases_total")
    if data.get("complete") is False and total:
        notes.append(f"incomplete: {done} of {total} cases (the run stopped early or is still running; "
                     "`python -m bench run ... --resume` finishes it)")
    outside = data.get("cases_outside_config") or []
    if outside:
        rows = data.get("rows_outside_config")
        notes.append(f"{'' if rows is None else f'{rows} rows of '}{len(outside)} case(s) in rows.jsonl "
                     f"lie outside config.json and are left out (e.g. {outside[0]!r})")
    return notes


def _notes_text(sources) -> list[str]:
    """``note: ...`` lines of the sources (each prefixed with its label when there are several)."""
    multi = len(sources) > 1
    return [f"note: {s.label}: {n}" if multi else f"note: {n}" for s in sources for n in s.notes]


def _case_key(row: dict) -> tuple:
    """(variant, pass, dtype, D, Hq, Hkv, B, Q, KV, Dv): every field of the case id, so that two
    cases never share a row (results without ``v_head_dim`` have Dv = D)."""
    d = int(row["head_dim"])
    dv = row.get("v_head_dim")
    return (row["variant"], row["pass"], row["dtype"], d, int(row["q_heads"]), int(row["kv_heads"]),
            int(row["batch"]), int(row["q_len"]), int(row["kv_len"]), d if dv in (None, "") else int(dv))


def _dims_text(key: tuple) -> str:
    """``D=64``, or ``D=64/128`` when the value head dim differs."""
    d, dv = key[3], key[9]
    return f"D={d}" if d == dv else f"D={d}/{dv}"


def _shape_text(key: tuple) -> str:
    variant, p, dtype, d, hq, hkv, b, q, kv, dv = key
    heads = f"H={hq}" if hq == hkv else f"H={hq}/{hkv}"
    seq = f"S={kv}" if q == kv else f"Q={q} KV={kv}"
    return f"B={b} {heads} {seq} {_dims_text(key)}"


def build_cells(sources: list[Source]) -> tuple[dict, list[tuple], list[str]]:
    """{(source, case_key, provider): Cell}, the sorted case keys, the providers in first-seen order."""
    cells: dict = {}
    cases, providers = {}, {}
    by_process = defaultdict(dict)  # (cell key, metric) -> {process: value} of a run's processes
    for s in sources:
        for row in s.rows:
            key = _case_key(row)
            cases[key] = True
            provider = row["provider"]
            if provider != "baseline":
                providers.setdefault(provider, True)
            cell_key = (s.label, key, provider)
            cell = cells.setdefault(cell_key, Cell({}, "ok", ""))
            if row["metric"] == "status":
                cell.status, cell.note = row["status"], row.get("note") or ""
            else:
                cell.metrics[row["metric"]] = row["value"]
                process = row.get("process")
                if process is not None and isinstance(row["value"], (int, float)):
                    by_process[(cell_key, row["metric"])][int(process)] = row["value"]
                    if row["metric"] == "time_ms" and row["status"] == "ok":
                        cell.process_times[int(process)] = row["value"]
                if row["status"] == "fail":
                    cell.metrics.setdefault("_fails", []).append(row["metric"])
                elif row["status"] in ("error", "unsupported") and row["metric"].endswith("_correct"):
                    cell.metrics.setdefault("_errors", []).append(f"{row['metric']}: {row.get('note')}")
                if row["metric"] in ("time_ms", "compile_s") and row.get("note"):
                    cell.metrics.setdefault("_note", row["note"])
    errors = defaultdict(lambda: defaultdict(dict))  # (cell key, prefix) -> {process: {metric: value}}
    for (cell_key, metric), values in by_process.items():
        prefix = _error_prefix(metric)
        if prefix is not None:
            for process, value in values.items():
                errors[(cell_key, prefix)][process][metric] = value
        elif len(values) > 1:
            cells[cell_key].metrics[metric] = statistics.median(values.values())
    for (cell_key, prefix), per_process in errors.items():
        if len(per_process) > 1:
            cells[cell_key].metrics.update(_worst_process(prefix, per_process.values()))
    order = {"fwd": 0, "fp8": 0.5, "fwd_bwd": 1, "decode": 2, "train_step": 3}
    variant_order = {}
    for s in sources:
        for row in s.rows:
            variant_order.setdefault(row["variant"], len(variant_order))
    keys = sorted(cases, key=lambda k: (order.get(k[1], 9), variant_order[k[0]], k[6:9], k[4:6], k[3], k[9],
                                        k[2]))
    return cells, keys, list(providers)


#: Suffixes of the correctness metrics (``out_max_abs``, ``dq_correct``, ...).
_ERROR_SUFFIXES = ("_max_abs", "_mean_abs", "_rel_fro", "_tolerance", "_correct")


def _error_prefix(metric: str) -> str | None:
    """``out`` of ``out_max_abs``; None for a metric that is not a correctness metric."""
    return next((metric[:-len(s)] for s in _ERROR_SUFFIXES if metric.endswith(s)), None)


def _worst_process(prefix: str, per_process) -> dict:
    """The ``prefix_*`` error metrics of the worst of a run's processes: one whose check failed,
    else (and among those) the largest max abs error. A correctness cell is judged by its worst
    process, not the median, so that one failing process fails it (as the summary's ✗ does); its
    metrics come from one process, so that its max abs error and tolerance belong together."""
    def badness(metrics):
        error = metrics.get(f"{prefix}_max_abs", -math.inf)
        error = math.inf if math.isnan(error) else error  # a NaN error is the worst there is
        return metrics.get(f"{prefix}_correct", 1) != 1, error

    return max(per_process, key=badness)


def pick_baseline(cells: dict, providers: list[str], requested: str | None) -> str | None:
    if requested:
        return requested
    timed = {p for (_, _, p), c in cells.items() if c.metrics.get("time_ms") is not None}
    for name in _BASELINE_ORDER:
        if name in timed:
            return name
    return next((p for p in providers if p in timed), None)


def _fmt(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


#: Rows read against the bf16 matmul peak: 16-bit inputs (fp16 runs on the same tensor cores at
#: the same rate) in the attention passes; float32 rows and train steps have other ceilings.
ROOFLINE_DTYPES = ("bfloat16", "float16")
ROOFLINE_PASSES = ("fwd", "fwd_bwd", "decode")


def peak_fraction(tflops, peak) -> float | None:
    """A row's TFLOP/s as a fraction of the measured peak, or None without either."""
    if tflops is None or not peak:
        return None
    return tflops / peak


def _cell_text(cell: Cell | None, peak: float | None = None) -> str:
    """``TFLOP/s (median ms)``, with the fraction of ``peak`` (the GPU's measured bf16 matmul
    TFLOP/s, None where it does not apply) as ``TFLOP/s (xx%, median ms)``."""
    if cell is None:
        return ""
    if cell.status != "ok":
        return cell.status
    t, tf = cell.metrics.get("time_ms"), cell.metrics.get("tflops")
    tokens = cell.metrics.get("tokens_per_s")
    if t is None:
        return "—"
    fraction = peak_fraction(tf, peak)
    if tokens is not None:  # a train step: throughput is what training cares about
        text = f"{_fmt(tokens / 1e3)}k tok/s ({_fmt(t)} ms)"
    elif fraction is not None:
        text = f"{_fmt(tf)} ({100 * fraction:.0f}%, {_fmt(t)} ms)"
    else:
        text = f"{_fmt(tf)} ({_fmt(t)} ms)" if tf is not None else f"{_fmt(t)} ms"
    if cell.metrics.get("_fails"):
        text += " ✗"
    return text


def source_peaks(sources) -> dict[str, float | None]:
    """{source label: its GPU's measured bf16 matmul peak in TFLOP/s, or None (not measured)}."""
    return {s.label: env_mod.peak_tflops(s.envs) for s in sources}


def _roofline(key: tuple) -> bool:
    return key[2] in ROOFLINE_DTYPES and key[1] in ROOFLINE_PASSES


def summary_rows(sources, cells, keys, providers) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the summary table: TFLOP/s (fraction of the measured peak, median ms)
    per source × provider, then flexlab's speed-up over each other timed provider (their median
    time ÷ flexlab's). The fraction appears where the source measured a peak (GPU runs) and the
    row is a 16-bit attention pass (ROOFLINE_DTYPES, ROOFLINE_PASSES)."""
    peaks = source_peaks(sources)
    multi = len(sources) > 1
    columns = [(s.label, p) for s in sources for p in providers
               if any((s.label, k, p) in cells for k in keys)]
    header = ["variant", "shape", "dtype", "pass"] + [f"{p} [{s}]" if multi else p for s, p in columns]
    # flexlab's speed-up over each other provider: their median time over flexlab's (> 1: faster).
    ratios = [(s, p) for s, p in columns if p != RATIO_PROVIDER and (s, RATIO_PROVIDER) in columns
              and any(_time(cells.get((s, k, p))) for k in keys)]
    header += [f"{RATIO_PROVIDER} ÷ {p}" + (f" [{s}]" if multi else "") for s, p in ratios]
    rows = []
    for key in keys:
        row = [key[0], _shape_text(key), key[2], key[1]]
        row += [_cell_text(cells.get((s, key, p)), peaks.get(s) if _roofline(key) else None)
                for s, p in columns]
        for s, p in ratios:
            mine, theirs = _time(cells.get((s, key, RATIO_PROVIDER))), _time(cells.get((s, key, p)))
            row.append(f"{theirs / mine:.2f}×" if mine and theirs else "")
        rows.append(row)
    return header, rows


#: The provider whose speed-ups the summary table lists.
RATIO_PROVIDER = "flexlab"


def _time(cell: Cell | None):
    """A cell's median time for ratios: None unless the provider ran (status ok) and the time is a
    finite positive number (a NaN would make every ratio and geometric mean it enters NaN)."""
    t = cell.metrics.get("time_ms") if cell is not None and cell.status == "ok" else None
    return t if isinstance(t, (int, float)) and math.isfinite(t) and t > 0 else None


def spread_rows(sources, cells, keys, providers) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the run-to-run spread table: per case, and per source × provider whose
    cells hold the times of several processes, max/min - 1 of the processes' median times
    (bench.spread.spread), marked ⚠ above bench.spread.SPREAD_LIMIT. No rows where no source is
    a run of several processes."""
    multi = len(sources) > 1
    columns = [(s.label, p) for s in sources for p in providers
               if any(len(getattr(cells.get((s.label, k, p)), "process_times", {})) > 1 for k in keys)]
    header = ["variant", "shape", "dtype", "pass"] + [f"{p} [{s}]" if multi else p for s, p in columns]
    rows = []
    for key in keys:
        texts = []
        for s, p in columns:
            cell = cells.get((s, key, p))
            value = spread_mod.spread(cell.process_times.values()) if cell is not None else None
            texts.append("" if value is None else spread_mod.spread_text(value))
        if any(texts):
            rows.append([key[0], _shape_text(key), key[2], key[1]] + texts)
    return header, rows


def _process_count(cells) -> int:
    return max((len(c.process_times) for c in cells.values()), default=0)


def _cells_note(sources) -> str:
    """The summary table's legend: what a cell holds, and where the peak fraction comes from."""
    peaks = source_peaks(sources)
    measured = [f"{label}: {peak:.0f} TFLOP/s" for label, peak in peaks.items() if peak]
    text = ("Cells: TFLOP/s (% of the GPU's measured bf16 matmul peak, median ms); FLOPs as in "
            "docs/benchmark-method.md (bench.flops.attention_flops); train steps: thousands of "
            "tokens/s (median ms). ")
    if measured:
        text += (f"Peak: torch.matmul bf16 {PEAK_MATMUL_SIZE}³, median time ({'; '.join(measured)}); "
                 "the fraction is shown for bf16/fp16 rows. ")
    if len(measured) < len(peaks):
        text += ("No % of peak for " + ", ".join(label for label, peak in peaks.items() if not peak)
                 + ": no bf16 matmul peak measured there (a CPU run, or results older than the "
                 "measurement). ")
    return text + "✗ marks a correctness failure."


def error_rows(sources, cells, keys, providers) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the error table: one row per (source, case, provider) that ran."""
    header = ["source", "variant", "shape", "dtype", "pass", "provider", "out max abs", "out rel fro",
              "out tolerance", "grads (worst rel fro)", "pass/fail"]
    rows = []
    for key in keys:
        for s in sources:
            for p in ["baseline"] + providers:
                cell = cells.get((s.label, key, p))
                if cell is None or (cell.status != "ok" and p != "baseline"):
                    continue
                m = cell.metrics
                grad_rel = [v for k, v in m.items() if k.endswith("_rel_fro") and not k.startswith("out")
                            and isinstance(v, (int, float))]
                corrects = [v for k, v in m.items() if k.endswith("_correct")]
                if p == "baseline":
                    verdict = "reference"
                elif m.get("_errors"):
                    verdict = "error"
                elif not corrects:
                    verdict = "—"
                else:
                    verdict = "pass" if all(v == 1 for v in corrects) else "FAIL: " + ", ".join(
                        k.replace("_correct", "") for k, v in m.items() if k.endswith("_correct") and v != 1)
                rows.append([s.label, key[0], _shape_text(key), key[2], key[1], p,
                             _fmt(m.get("out_max_abs")), _fmt(m.get("out_rel_fro")),
                             _fmt(m.get("out_tolerance")), _fmt(max(grad_rel)) if grad_rel else "—", verdict])
    return header, rows


def status_rows(sources, cells, keys, providers) -> tuple[list[str], list[list[str]]]:
    """Distinct (source, provider, status, note) of providers that did not run, with a count."""
    counts: dict = defaultdict(int)
    for (label, key, p), cell in cells.items():
        if cell.status != "ok":
            counts[(label, p, cell.status, cell.note)] += 1
    header = ["source", "provider", "status", "cases", "reason"]
    return header, [[l, p, st, str(n), note] for (l, p, st, note), n in sorted(counts.items())]


def speedups(sources, cells, keys, providers, baseline) -> dict:
    """{pass: {variant: {(source, provider): geometric-mean speed-up over the baseline}}}."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for p_name in PASS_LABELS:
        for s in sources:
            for prov in providers:
                if prov == baseline:
                    continue  # 1 by definition: the line at 1 shows it
                per_variant = defaultdict(list)
                for key in keys:
                    if key[1] != p_name:
                        continue
                    base = cells.get((s.label, key, baseline))
                    cell = cells.get((s.label, key, prov))
                    # The same cells as the summary table's ratios: a provider that did not run
                    # (status error, ...) or a NaN time gives no bar.
                    tb, tp = _time(base), _time(cell)
                    if tb and tp:
                        per_variant[key[0]].append(tb / tp)
                for variant, values in per_variant.items():
                    out[p_name][variant][(s.label, prov)] = math.exp(sum(map(math.log, values)) / len(values))
    return out


def tflops_series(sources, cells, keys, providers) -> dict:
    """{(pass, variant): {line label: [(kv_len, TFLOP/s), ...]}} for lines over sequence length."""
    varying_d = len({(k[3], k[9]) for k in keys}) > 1
    varying_dtype = len({k[2] for k in keys}) > 1
    multi = len(sources) > 1
    out: dict = defaultdict(lambda: defaultdict(list))
    for key in keys:
        for s in sources:
            for prov in providers:
                cell = cells.get((s.label, key, prov))
                tf = cell.metrics.get("tflops") if cell else None
                if tf is None:
                    continue
                label = (prov + (f" {_dims_text(key)}" if varying_d else "")
                         + (f" {key[2]}" if varying_dtype else "") + (f" [{s.label}]" if multi else ""))
                out[(key[1], key[0])][label].append((key[8], tf))
    for series in out.values():
        for label in series:
            series[label].sort()
    return out


# ---- writers ---------------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def esc(text):
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf"]


def _colors(names) -> dict:
    """One colour per provider (or line label), the same in every figure."""
    out = {}
    for name in names:
        out.setdefault(name, _PALETTE[len(out) % len(_PALETTE)])
    return out


def _series_by_pass(series) -> dict:
    """{pass: {variant: lines}} from the {(pass, variant): lines} of the TFLOP/s plots."""
    by_pass = defaultdict(dict)
    for (p_name, variant), lines in series.items():
        by_pass[p_name][variant] = lines
    return by_pass


def _png_figures(speed, series, baseline, fig_dir: Path, colors: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    paths = []
    for p_name, per_variant in speed.items():
        if not per_variant:
            continue
        variants = list(per_variant)
        bars = sorted({k for v in per_variant.values() for k in v})
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(variants) * max(1, len(bars)) / 3), 4))
        width = 0.8 / max(1, len(bars))
        for i, bar in enumerate(bars):
            xs = [j + i * width for j in range(len(variants))]
            ys = [per_variant[v].get(bar, float("nan")) for v in variants]
            multi = len({b[0] for b in bars}) > 1
            ax.bar(xs, ys, width, label=f"{bar[1]} [{bar[0]}]" if multi else bar[1],
                   color=colors.get(bar[1]), hatch="//" if multi and bar[0] != bars[0][0] else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(variants))])
        ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"speed-up over {baseline} (geo-mean)")
        ax.set_title(f"Speed-up, {PASS_LABELS.get(p_name, p_name)}")
        ax.legend(fontsize=7)
        path = fig_dir / f"speedup_{p_name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")  # long variant labels grow the canvas
        plt.close(fig)
        paths.append(path)
    for p_name, per_variant in _series_by_pass(series).items():
        n = len(per_variant)
        cols = min(3, n)
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
        line_colors = _colors(label for lines in per_variant.values() for label in lines)
        for ax, (variant, lines) in zip(axes.flat, per_variant.items()):
            for label, points in lines.items():
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label,
                        color=line_colors[label])
            ax.set_xscale("log", base=2)
            ax.set_title(variant, fontsize=9)
            ax.set_xlabel("KV length")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(f"TFLOP/s against sequence length, {PASS_LABELS.get(p_name, p_name)}")
        path = fig_dir / f"tflops_{p_name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")  # long variant labels grow the canvas
        plt.close(fig)
        paths.append(path)
    return paths


def _plotly_figures(speed, series, baseline, colors: dict) -> list[str] | None:
    """HTML fragments of the plotly figures (plotly.js inlined once), or None without plotly."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        return None
    figs = []
    for p_name, per_variant in speed.items():
        if not per_variant:
            continue
        variants = list(per_variant)
        bars = sorted({k for v in per_variant.values() for k in v})
        multi = len({b[0] for b in bars}) > 1
        fig = go.Figure()
        sources = sorted({b[0] for b in bars})
        for bar in bars:
            fig.add_bar(name=f"{bar[1]} [{bar[0]}]" if multi else bar[1], x=variants,
                        y=[per_variant[v].get(bar) for v in variants], marker_color=colors.get(bar[1]),
                        marker_pattern_shape="/" if multi and bar[0] != sources[0] else "")
        fig.add_hline(y=1.0, line_color="black", line_width=1)
        fig.update_layout(title=f"Speed-up over {baseline} (geometric mean over shapes), "
                                f"{PASS_LABELS.get(p_name, p_name)}", barmode="group",
                          yaxis_title="speed-up", height=420)
        figs.append(fig)
    for p_name, per_variant in _series_by_pass(series).items():
        n = len(per_variant)
        cols = min(3, n)
        rows = math.ceil(n / cols)
        fig = make_subplots(rows=rows, cols=cols, subplot_titles=list(per_variant))
        line_colors = _colors(label for lines in per_variant.values() for label in lines)
        shown = set()
        for i, (variant, lines) in enumerate(per_variant.items()):
            for label, points in lines.items():
                fig.add_scatter(x=[x for x, _ in points], y=[y for _, y in points], mode="lines+markers",
                                name=label, legendgroup=label, showlegend=label not in shown,
                                line_color=line_colors[label], row=i // cols + 1, col=i % cols + 1)
                shown.add(label)
        fig.update_xaxes(type="log", title_text="KV length")
        fig.update_yaxes(title_text="TFLOP/s")
        fig.update_layout(title=f"TFLOP/s against sequence length, {PASS_LABELS.get(p_name, p_name)}",
                          height=320 * rows)
        figs.append(fig)
    return [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs)]


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: left; }
th { background: #f0f0f0; }
h2 { margin-top: 1.6em; }
.note { color: #555; font-size: 13px; }
"""


def write_report(results, out_dir, *, force: bool = False, labels=None, baseline: str | None = None
                 ) -> list[Path]:
    """Write the report of one or more results into ``out_dir``; return the written paths.

    The inputs are read and checked first, the report is built in a temporary folder beside
    ``out_dir`` and then moved into place: a bad input, or a failure while building, leaves an
    existing report as it was.

    Raises:
        ResultsFileError: an input is malformed (its path and the reason).
        ReportExistsError: ``out_dir`` exists and is not empty, and ``force`` is False.
        ReportError: ``force`` on a folder that holds more than a report (a run folder, say).
    """
    out_dir = Path(out_dir)
    inputs = list(results) if not isinstance(results, (str, os.PathLike)) else [results]
    sources = load_sources(inputs, labels)
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ReportError(f"report folder {out_dir} is a file; choose another --out")
        present = sorted(p.name for p in out_dir.iterdir())
        if present and not force:
            raise ReportExistsError(f"report folder {out_dir} exists; pass --force to overwrite it")
        foreign = [name for name in present if name not in REPORT_FILES]
        if foreign:
            raise ReportError(f"report folder {out_dir} holds files that are not a report's "
                              f"({', '.join(foreign[:5])}); --force replaces only a report folder, "
                              "choose another --out")
    resolved = out_dir.resolve()
    for path in inputs:
        p = Path(path).resolve()
        if p == resolved or resolved in p.parents:
            raise ReportError(f"--out {out_dir} would replace the input {path}; choose another --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        written = _build_report(sources, staging, baseline)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it private; a report is meant to be shared
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:8]}.old"
            os.rename(out_dir, old)
            os.rename(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out_dir / p.relative_to(staging) for p in written]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _build_report(sources: list[Source], out_dir: Path, baseline: str | None) -> list[Path]:
    """Write the report files of ``sources`` into the (empty) folder ``out_dir``."""
    fig_dir = out_dir / "figures"
    fig_dir.mkdir(exist_ok=True)
    cells, keys, providers = build_cells(sources)
    base = pick_baseline(cells, providers, baseline)
    speed = speedups(sources, cells, keys, providers, base) if base else {}
    series = tflops_series(sources, cells, keys, providers)
    s_header, s_rows = summary_rows(sources, cells, keys, providers)
    e_header, e_rows = error_rows(sources, cells, keys, providers)
    if len(sources) == 1:  # one run: the source column says nothing
        e_header, e_rows = e_header[1:], [r[1:] for r in e_rows]
    st_header, st_rows = status_rows(sources, cells, keys, providers)
    sp_header, sp_rows = spread_rows(sources, cells, keys, providers)
    written = []

    combined = [{**row, "source": s.label} for s in sources for row in s.rows]
    csv_path = out_dir / "results.csv"
    _write_combined_csv(csv_path, combined)
    written.append(csv_path)

    colors = _colors(providers)
    pngs = _png_figures(speed, series, base, fig_dir, colors)
    written += pngs

    title = "flexlab benchmark: " + " vs ".join(s.label for s in sources)
    notes = _notes_text(sources)
    md = [f"# {title}", "", *[line for n in notes for line in (n, "")], _cells_note(sources), "",
          markdown_table(s_header, s_rows), ""]
    if sp_rows:
        md += ["## Run-to-run spread", "", _spread_note(cells), "", markdown_table(sp_header, sp_rows), ""]
    md += ["## Errors against float64", "", markdown_table(e_header, e_rows), ""]
    if st_rows:
        md += ["## Providers that did not run", "", markdown_table(st_header, st_rows), ""]
    md_path = out_dir / "summary.md"
    _write_text(md_path, "\n".join(md))
    written.append(md_path)

    fragments = _plotly_figures(speed, series, base, colors)
    if fragments is None:
        fragments = [f'<img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
                     f'{base64.b64encode(p.read_bytes()).decode()}">' for p in pngs]
        figure_note = "plotly is not installed: static figures."
    else:
        figure_note = "Interactive figures (plotly, embedded)."
    env_header = ["key"] + [s.label for s in sources]
    env_keys = []
    for s in sources:
        for e in s.envs:
            env_keys += [k for k in e if k not in env_keys]
    env_rows = [[k] + [" | ".join(str(e.get(k)) for e in s.envs) for s in sources] for k in env_keys]
    parts = [
        "<!DOCTYPE html>", "<html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
        f"<p class='note'>Speed-ups are relative to <b>{html.escape(str(base))}</b> in the same run. "
        f"{figure_note}</p>",
        "<h2>Figures</h2>", *fragments,
        "<h2>Summary: TFLOP/s (% of peak, median ms)</h2>",
        *[f"<p class='note'><b>{html.escape(n)}</b></p>" for n in notes],
        f"<p class='note'>{html.escape(_cells_note(sources))}</p>", html_table(s_header, s_rows),
        *([f"<h2>Run-to-run spread</h2><p class='note'>{html.escape(_spread_note(cells))}</p>",
           html_table(sp_header, sp_rows)] if sp_rows else []),
        "<h2>Errors against float64</h2>",
        "<p class='note'>pass iff max abs error ≤ 2 × the same-dtype baseline's + eps(dtype); "
        "the baseline is SDPA math, or flexcore's reference with upcast=False where SDPA cannot "
        "express the variant.</p>", html_table(e_header, e_rows),
        "<h2>Providers that did not run</h2>", html_table(st_header, st_rows),
        "<h2>Environment</h2>", html_table(env_header, env_rows),
        "</body></html>",
    ]
    html_path = out_dir / "report.html"
    _write_text(html_path, "\n".join(parts))
    written.append(html_path)
    return written


def _write_text(path: Path, text: str) -> None:
    from bench.runner import _atomic_write

    _atomic_write(path, text)


def _write_combined_csv(path: Path, rows: list[dict]) -> None:
    import csv

    buf = io.StringIO()
    columns = ["source"] + COLUMNS
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    _write_text(path, buf.getvalue())


def _spread_note(cells) -> str:
    return (f"max/min - 1 of the median times measured by {_process_count(cells)} separate processes, "
            f"one after another (python -m bench run --processes N); ⚠ marks a spread above "
            f"{100 * spread_mod.SPREAD_LIMIT:.0f}%.")


def summary_markdown(results, labels=None) -> str:
    """The summary table (TFLOP/s, % of peak and median ms per provider) of one or more results,
    as markdown, followed by the run-to-run spread table of a run of several processes."""
    sources = load_sources(list(results) if not isinstance(results, (str, os.PathLike)) else [results],
                           labels)
    from bench import cp  # context-parallel runs (python -m bench.cp) get their scaling table

    if sources and all(cp.is_cp_results(s.rows) for s in sources):
        return "\n\n".join((f"## {s.label}\n\n" if len(sources) > 1 else "") + cp.scaling_markdown(s.rows)
                           for s in sources)
    cells, keys, providers = build_cells(sources)
    text = "".join(n + "\n\n" for n in _notes_text(sources))
    text += markdown_table(*summary_rows(sources, cells, keys, providers))
    sp_header, sp_rows = spread_rows(sources, cells, keys, providers)
    if sp_rows:
        text += "\n\n## Run-to-run spread\n\n" + _spread_note(cells) + "\n\n" + markdown_table(sp_header, sp_rows)
    return text


def print_summary(results, labels=None) -> None:
    print(summary_markdown(results, labels))
