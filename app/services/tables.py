"""Result tables as text, the same for the pages and the exported report.

Numbers are written in full (``440.01``, never cut to ``40.01``), errors in scientific notation,
memory in MiB; every table is ``(header, rows)`` of strings.
"""
from __future__ import annotations

import math

from app.services.common import provider_label

Table = tuple[list[str], list[list[str]]]


def fmt(value, kind: str = "") -> str:
    """One number as text: ``kind`` is "" (plain), "err" (scientific), "bytes" or "pct"."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and kind != "bytes":
        return f"{value:,}"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if kind == "err":
        return f"{value:.3e}"
    if kind == "bytes":
        return f"{value / 2**20:,.1f} MiB"
    if kind == "pct":
        return f"{value:.1f} %"
    a = abs(value)
    if a == 0:
        return "0"
    if a >= 1e5:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:,.2f}"
    if a >= 1:
        return f"{value:.3f}"
    if a >= 1e-3:
        return f"{value:.4f}"
    return f"{value:.3e}"


def verdict(passed) -> str:
    return "—" if passed is None else ("pass" if passed else "FAIL")


def check_table(rows: list[dict]) -> Table:
    header = ["dtype", "result", "max |err|", "threshold", "torch max |err|", "mean |err|"]
    return header, [[r["dtype"], verdict(r["passed"]), fmt(r["max_abs"], "err"),
                     fmt(r["threshold"], "err"), fmt(r["torch_max_abs"], "err"),
                     fmt(r["mean_abs"], "err")] for r in rows]


def gradient_table(rows: list[dict]) -> Table:
    header = ["source", "tensor", "result", "max |err|", "threshold", "mean |err|", "rel. Frobenius"]
    return header, [[r["source"], r["tensor"], verdict(r.get("passed")), fmt(r["max_abs"], "err"),
                     fmt(r.get("threshold"), "err"), fmt(r["mean_abs"], "err"),
                     fmt(r["rel_fro"], "err")] for r in rows]


PASS_NAMES = {"fwd": "forward", "fwd_bwd": "forward+backward"}


def benchmark_table(summary: list[dict]) -> Table:
    header = ["provider", "pass", "median ms", "p20–p80 ms", "TFLOP/s", "peak memory",
              "max |out − float64|", "correct", "how"]
    out = []
    for s in summary:
        if s["ms"] is None:
            continue
        spread = "—" if s["p20"] is None else f"{fmt(s['p20'])}–{fmt(s['p80'])}"
        out.append([s["label"], PASS_NAMES.get(s["pass"], s["pass"]), fmt(s["ms"]), spread,
                    fmt(s["tflops"]), fmt(s["peak_bytes"], "bytes"), fmt(s["out_max_abs"], "err"),
                    verdict(s["correct"]), s["note"]])
    return header, out


def sweep_table(rows: list[dict]) -> Table:
    header = ["provider", "S", "median ms", "TFLOP/s"]
    return header, [[r["provider"], fmt(r["S"]), fmt(r["ms"]), fmt(r["tflops"])] for r in rows]


def compare_table(result: dict) -> Table:
    """Masks, sparsity and (when timed) flexcore's forward latency of the two mods."""
    header = ["measure", *result["labels"]]
    masks, blocks = result["masks"], result["blocks"]
    rows = [["kept positions of (b, h)"] + [f"{m['kept']:,} of {m['total']:,} "
                                             f"({100 * m['kept'] / m['total']:.2f} %)" for m in masks],
            ["blocks skipped (sparsity)"] + [fmt(b["sparsity"], "pct") for b in blocks],
            ["full / partial / empty blocks"] + [f"{b['full']:,} / {b['partial']:,} / {b['empty']:,}"
                                                 for b in blocks],
            ["forward GFLOP computed"] + [fmt(b["flops_sparse"] / 1e9) for b in blocks]]
    timing = result.get("timing")
    if timing:
        ms = {}
        for r in timing["rows"]:
            if r["metric"] == "time_ms" and r["status"] == "ok":
                ms[r["variant"]] = r["value"]
        rows.append([f"{provider_label('flexlab')} forward, median ms"] +
                    [fmt(ms.get(spec)) for spec in timing["specs"]])
    return header, rows


def markdown(table: Table) -> str:
    header, rows = table

    def esc(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def html(table: Table) -> str:
    import html as html_mod

    header, rows = table
    head = "".join(f"<th>{html_mod.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html_mod.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def frame(table: Table):
    """A pandas DataFrame of text cells (for ``st.table``)."""
    import pandas as pd

    header, rows = table
    return pd.DataFrame(rows, columns=header)
