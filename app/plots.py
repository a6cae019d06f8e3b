"""Plotly figures for the workbench, built from the plain data the services return.

Axes carry their quantity and unit ("median latency (ms)"); logarithmic axes label 1, 2 and 5 of
each decade (and more within a short range), with unlabelled minor ticks between.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

#: Colours of empty, partial and full blocks (colour-blind safe: light grey, orange, blue).
BLOCK_COLOURS = ("#e8e8e8", "#f28e2b", "#4e79a7")
#: Colour of each pass in latency charts.
PASS_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "forward+backward": "#59a14f"}


def _layout(fig, title: str, x: str, y: str, height: int = 420, reversed_y: bool = True):
    fig.update_layout(title=title, height=height, margin=dict(l=10, r=10, t=50, b=10),
                      xaxis_title=x, yaxis_title=y)
    if reversed_y:
        fig.update_yaxes(autorange="reversed")
    return fig


def log_ticks(values: Sequence[float]) -> list[float]:
    """Labelled ticks of a log axis covering ``values``: 1-2-5 per decade, denser in a short range."""
    positive = [float(v) for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not positive:
        return []
    lo, hi = min(positive), max(positive)
    span = math.log10(hi / lo) if hi > lo else 0.0
    # About a dozen labels at most, however many decades the data spans.
    if span <= 1.3:
        mantissas = (1, 1.5, 2, 3, 4, 5, 6, 8)
    elif span <= 2.6:
        mantissas = (1, 2, 5)
    elif span <= 5:
        mantissas = (1, 3)
    else:
        mantissas = (1,)
    ticks = []
    for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        for m in mantissas:
            v = m * 10.0 ** e
            if lo / 1.6 <= v <= hi * 1.6:
                ticks.append(float(f"{v:.6g}"))
    return ticks


def tick_text(value: float) -> str:
    """A tick label in full: 0.002, 0.5, 20, 5000, 2e+06."""
    return f"{value:,.6g}" if 1e-4 <= abs(value) < 1e6 else f"{value:.0e}"


def bar_text(value) -> str:
    """A number written on a bar: four significant digits."""
    return "" if value is None else f"{value:,.4g}"


def set_log_axis(fig, axis: str, values: Sequence[float], title: str) -> None:
    """Make ``axis`` ("x" or "y") logarithmic with full tick labels and minor ticks."""
    ticks = log_ticks(values)
    update = dict(type="log", title_text=title, tickmode="array", tickvals=ticks,
                  ticktext=[tick_text(t) for t in ticks], ticks="outside", ticklen=6,
                  minor=dict(ticks="outside", ticklen=3, tickcolor="#999", dtick="D1",
                             showgrid=False))
    (fig.update_yaxes if axis == "y" else fig.update_xaxes)(**update)


def _index_axis(n: int, step: int):
    """Index of the first position each pooled pixel covers (so hover shows real indices)."""
    return [i * step for i in range(n)]


def _pooled_note(pool, what: str) -> str:
    rs, cs = pool
    return "" if (rs, cs) == (1, 1) else f" (each pixel: {what} of {rs}×{cs} positions)"


def mask_heatmap(view: dict, title: str):
    import plotly.graph_objects as go

    pooled = np.asarray(view["pooled"], dtype=float)
    rs, cs = view["pool"]
    fig = go.Figure(go.Heatmap(
        z=pooled, x=_index_axis(pooled.shape[1], cs), y=_index_axis(pooled.shape[0], rs),
        zmin=0, zmax=1, colorscale=[[0, "#f7f7f7"], [1, "#1f4e79"]],
        colorbar=dict(title="fraction kept"),
        hovertemplate="q_idx %{y}<br>kv_idx %{x}<br>kept %{z:.2f}<extra></extra>"))
    return _layout(fig, title + _pooled_note(view["pool"], "fraction kept"), "key index kv_idx",
                   "query index q_idx")


def block_map(view: dict, title: str):
    import plotly.graph_objects as go

    m = np.asarray(view["map"])
    bq, bkv = view["block_size"]
    names = ("empty", "partial", "full")
    text = [[names[int(v)] for v in row] for row in m]
    c0, c1, c2 = BLOCK_COLOURS
    scale = [[0, c0], [1 / 3, c0], [1 / 3, c1], [2 / 3, c1], [2 / 3, c2], [1, c2]]
    fig = go.Figure(go.Heatmap(
        z=m, zmin=-0.5, zmax=2.5, colorscale=scale, text=text, xgap=1, ygap=1,
        x=list(range(m.shape[1])), y=list(range(m.shape[0])),
        colorbar=dict(tickvals=[0, 1, 2], ticktext=list(names), title="block"),
        hovertemplate=(f"query block %{{y}} (rows ×{bq})<br>key block %{{x}} (cols ×{bkv})"
                       "<br>%{text}<extra></extra>")))
    fig = _layout(fig, title, f"key block ({bkv} keys each)", f"query block ({bq} queries each)")
    if max(m.shape) <= 32:  # whole block numbers, not 0.5 steps
        fig.update_xaxes(dtick=1)
        fig.update_yaxes(dtick=1)
    return fig


def value_heatmap(view: dict, title: str, quantity: str, diverging: bool = True):
    """Scores, biases or probabilities of one (b, h); masked positions (NaN) are blank."""
    import plotly.graph_objects as go

    pooled = np.asarray(view["pooled"], dtype=float)
    rs, cs = view["pool"]
    style = dict(colorscale="RdBu_r", zmid=0) if diverging else dict(colorscale="Viridis", zmin=0)
    fig = go.Figure(go.Heatmap(
        z=pooled, x=_index_axis(pooled.shape[1], cs), y=_index_axis(pooled.shape[0], rs),
        colorbar=dict(title=quantity), **style,
        hovertemplate=f"q_idx %{{y}}<br>kv_idx %{{x}}<br>{quantity} %{{z:.4g}}<extra></extra>"))
    return _layout(fig, title + _pooled_note(view["pool"], "mean"), "key index kv_idx",
                   "query index q_idx")


def probability_heatmap(view: dict, title: str):
    """Attention probabilities on a log colour scale (they span decades); masked positions blank."""
    import plotly.graph_objects as go

    pooled = np.asarray(view["pooled"], dtype=float)
    rs, cs = view["pool"]
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(pooled > 0, np.log10(np.where(pooled > 0, pooled, 1.0)), np.nan)
    finite = z[np.isfinite(z)]
    low = math.floor(finite.min()) if finite.size else -3
    low = max(low, -12)
    ticks = list(range(low, 1))
    fig = go.Figure(go.Heatmap(
        z=np.maximum(z, low), x=_index_axis(pooled.shape[1], cs), y=_index_axis(pooled.shape[0], rs),
        zmin=low, zmax=0, colorscale="Viridis", customdata=pooled,
        colorbar=dict(title="probability", tickvals=ticks, ticktext=[f"1e{t}" if t else "1"
                                                                     for t in ticks]),
        hovertemplate="q_idx %{y}<br>kv_idx %{x}<br>p %{customdata:.3g}<extra></extra>"))
    return _layout(fig, title + _pooled_note(view["pool"], "mean"), "key index kv_idx",
                   "query index q_idx")


def mask_difference(view: dict, title: str, labels: Sequence[str]):
    """Where two masks differ: +1 kept by the first only, −1 by the second only."""
    import plotly.graph_objects as go

    pooled = np.asarray(view["pooled"], dtype=float)
    rs, cs = view["pool"]
    fig = go.Figure(go.Heatmap(
        z=pooled, x=_index_axis(pooled.shape[1], cs), y=_index_axis(pooled.shape[0], rs),
        zmin=-1, zmax=1, colorscale=[[0, "#b2182b"], [0.5, "#f7f7f7"], [1, "#2166ac"]],
        colorbar=dict(title="kept", tickvals=[-1, 0, 1],
                      ticktext=[f"{labels[1]} only", "same", f"{labels[0]} only"]),
        hovertemplate="q_idx %{y}<br>kv_idx %{x}<br>%{z:.2f}<extra></extra>"))
    return _layout(fig, title + _pooled_note(view["pool"], "mean"), "key index kv_idx",
                   "query index q_idx")


def error_heatmap(pooled, title: str, quantity: str = "|error|"):
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(z=np.asarray(pooled, dtype=float), colorscale="Viridis",
                               colorbar=dict(title=quantity),
                               hovertemplate="q_idx %{y}<br>dim %{x}<br>" + quantity
                               + " %{z:.3e}<extra></extra>"))
    return _layout(fig, title, "head dimension", "query index q_idx", height=360)


def latency_bars(rows: Sequence[dict], title: str):
    """Median latency per provider (x) and pass (colour), log axis in ms."""
    import plotly.graph_objects as go

    fig = go.Figure()
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    for p in PASS_COLOURS:
        sub = [r for r in rows if r["pass"] == p]
        if sub:
            fig.add_bar(x=[r["provider"] for r in sub], y=[r["ms"] for r in sub], name=p,
                        marker_color=PASS_COLOURS[p], text=[bar_text(r["ms"]) for r in sub],
                        textposition="outside", cliponaxis=False,
                        hovertemplate="%{x}<br>%{y:.4g} ms<extra>" + p + "</extra>")
    fig.update_layout(title=title, barmode="group", height=400, legend_title_text="pass",
                      margin=dict(l=10, r=10, t=50, b=10),
                      uniformtext=dict(minsize=9, mode="hide"))  # no label wider than its bar
    fig.update_xaxes(title_text="provider", categoryorder="array", categoryarray=providers)
    set_log_axis(fig, "y", [r["ms"] for r in rows], "median latency (ms)")
    return fig


def value_bars(rows: Sequence[dict], x: str, y: str, title: str, x_title: str, y_title: str,
               color: str | None = None, log: bool = False, color_title: str | None = None):
    """Grouped bars of a long-form table with titled axes (log y when ``log``)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    groups = list(dict.fromkeys(r[color] for r in rows)) if color else [None]
    for g in groups:
        sub = [r for r in rows if color is None or r[color] == g]
        fig.add_bar(x=[r[x] for r in sub], y=[r[y] for r in sub], name=str(g) if g else y_title,
                    hovertemplate="%{x}<br>%{y:.4g}<extra>" + (str(g) if g else "") + "</extra>")
    fig.update_layout(title=title, barmode="group", height=380, showlegend=color is not None,
                      legend_title_text=color_title or color or "",
                      margin=dict(l=10, r=10, t=50, b=10))
    fig.update_xaxes(title_text=x_title)
    if log:
        set_log_axis(fig, "y", [r[y] for r in rows], y_title)
    else:
        fig.update_yaxes(title_text=y_title, rangemode="tozero", tickformat="~g")
    return fig


def gradient_errors(rows: Sequence[dict], title: str):
    """max |grad − float64 grad| per tensor and source, with each tensor's pass threshold."""
    import plotly.graph_objects as go

    fig = go.Figure()
    tensors = list(dict.fromkeys(r["tensor"] for r in rows))
    for source in dict.fromkeys(r["source"] for r in rows):
        sub = [r for r in rows if r["source"] == source]
        fig.add_bar(x=[r["tensor"] for r in sub], y=[r["max_abs"] for r in sub], name=source)
    thresholds = {r["tensor"]: r["threshold"] for r in rows if r.get("threshold")}
    if thresholds:
        fig.add_scatter(x=list(thresholds), y=list(thresholds.values()), mode="markers",
                        name="pass threshold", marker=dict(symbol="line-ew-open", size=34,
                                                           color="#d62728", line_width=3))
    fig.update_layout(title=title, barmode="group", height=400, legend_title_text="source",
                      margin=dict(l=10, r=10, t=50, b=10))
    fig.update_xaxes(title_text="gradient", categoryorder="array", categoryarray=tensors)
    values = [r["max_abs"] for r in rows] + list(thresholds.values())
    set_log_axis(fig, "y", values, "max |grad − float64 grad|")
    return fig


def sweep_lines(rows: Sequence[dict], metric: str, title: str):
    """One line per provider against S (log-2 axis with the measured lengths as ticks)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for provider in dict.fromkeys(r["provider"] for r in rows):
        sub = sorted((r for r in rows if r["provider"] == provider and r[metric] is not None),
                     key=lambda r: r["S"])
        fig.add_scatter(x=[r["S"] for r in sub], y=[r[metric] for r in sub], name=provider,
                        mode="lines+markers")
    lengths = sorted({r["S"] for r in rows})
    fig.update_layout(title=title, height=400, legend_title_text="provider",
                      margin=dict(l=10, r=10, t=50, b=10))
    fig.update_xaxes(type="log", title_text="sequence length S (Q_LEN = KV_LEN, tokens)",
                     tickmode="array", tickvals=lengths, ticktext=[f"{n:,}" for n in lengths])
    if metric == "ms":
        set_log_axis(fig, "y", [r["ms"] for r in rows], "median latency (ms)")
    else:
        fig.update_yaxes(title_text="TFLOP/s", rangemode="tozero", tickformat="~g")
    return fig


def case_bars(rows: Sequence[dict], title: str, value_label: str, log_x: bool = False,
              side_by_side: bool = False):
    """Horizontal grouped bars, one group per case (readable with many long case names);
    with ``side_by_side`` one panel per results file, sharing the case axis."""
    import pandas as pd
    import plotly.express as px

    frame = pd.DataFrame(list(rows))
    n_cases = frame["case"].nunique()
    fig = px.bar(frame, y="case", x="value", color="provider", barmode="group", orientation="h",
                 title=title, facet_col="file" if side_by_side else None,
                 labels={"value": value_label, "provider": "provider"})
    fig.update_layout(height=max(380, 26 * n_cases * max(1, frame["provider"].nunique()) // 2 + 140),
                      margin=dict(l=10, r=10, t=60, b=10))
    fig.update_yaxes(autorange="reversed", title=None)
    if log_x:
        set_log_axis(fig, "x", list(frame["value"]), value_label)
    else:
        fig.update_xaxes(title_text=value_label)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig


#: What each context-parallel scaling chart shows: (key of bench.cp.scaling_table, axis title).
CP_METRICS = {"tflops": "per-GPU TFLOP/s (forward+backward)",
              "scaling_eff": "scaling efficiency (per-GPU TFLOP/s ÷ one GPU's)"}


def cp_scaling(table: Sequence[dict], metric: str, title: str):
    """One line per (provider, global S) against the number of GPUs, from bench.cp.scaling_table.
    The single-GPU ``flexlab`` point starts every flexlab line, so a line reads as its scaling."""
    import plotly.graph_objects as go

    fig = go.Figure()
    lines: dict = {}
    for e in table:
        if e.get(metric) is None or e["provider"] == "flexlab":
            continue
        lines.setdefault((e["provider"], e["seq"]), []).append(e)
    single = {e["seq"]: e for e in table if e["provider"] == "flexlab" and e["gpus"] == 1}
    for (provider, seq), points in sorted(lines.items()):
        start = single.get(seq) if metric == "tflops" and provider.startswith("flexlab") else None
        points = ([start] if start else []) + sorted(points, key=lambda e: e["gpus"])
        fig.add_scatter(x=[e["gpus"] for e in points], y=[e[metric] for e in points],
                        name=f"{provider}, S={seq:,}", mode="lines+markers")
    gpus = sorted({e["gpus"] for e in table})
    fig.update_layout(title=title, height=400, legend_title_text="provider, global S",
                      margin=dict(l=10, r=10, t=50, b=10))
    fig.update_xaxes(title_text="GPUs", tickmode="array", tickvals=gpus, ticktext=[str(g) for g in gpus])
    fig.update_yaxes(title_text=CP_METRICS.get(metric, metric), rangemode="tozero", tickformat="~g")
    return fig
