"""Plotly figures for the workbench, built from the plain data ``app.services`` returns."""
from __future__ import annotations

from typing import Sequence

#: Colours of empty, partial and full blocks (colour-blind safe: light grey, orange, blue).
BLOCK_COLOURS = ("#e8e8e8", "#f28e2b", "#4e79a7")


def _layout(fig, title: str, x: str, y: str, height: int = 420):
    fig.update_layout(title=title, height=height, margin=dict(l=10, r=10, t=40, b=10),
                      xaxis_title=x, yaxis_title=y)
    fig.update_yaxes(autorange="reversed")
    return fig


def _axis(n: int, step: int):
    """Index of the first position each pooled pixel covers (so hover shows real indices)."""
    return [i * step for i in range(n)]


def mask_heatmap(view: dict, title: str):
    import plotly.graph_objects as go

    pooled = view["pooled"]
    rs, cs = view["pool"]
    pooled_note = "" if (rs, cs) == (1, 1) else f" (each pixel: {rs}×{cs} positions, fraction kept)"
    fig = go.Figure(go.Heatmap(z=pooled, x=_axis(pooled.shape[1], cs), y=_axis(pooled.shape[0], rs),
                               zmin=0, zmax=1, colorscale=[[0, "#f7f7f7"], [1, "#1f4e79"]],
                               colorbar=dict(title="kept"),
                               hovertemplate="q_idx %{y}<br>kv_idx %{x}<br>kept %{z:.2f}<extra></extra>"))
    return _layout(fig, title + pooled_note, "kv_idx", "q_idx")


def block_map(view: dict, title: str):
    import plotly.graph_objects as go

    m = view["map"]
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


def score_heatmap(view: dict, title: str):
    import plotly.graph_objects as go

    pooled = view["pooled"]
    rs, cs = view["pool"]
    pooled_note = "" if (rs, cs) == (1, 1) else f" (each pixel: mean of {rs}×{cs} kept positions)"
    fig = go.Figure(go.Heatmap(z=pooled, x=_axis(pooled.shape[1], cs), y=_axis(pooled.shape[0], rs),
                               colorscale="RdBu_r", zmid=0, colorbar=dict(title="score"),
                               hovertemplate="q_idx %{y}<br>kv_idx %{x}<br>score %{z:.4g}<extra></extra>"))
    return _layout(fig, title + pooled_note + " — masked positions blank", "kv_idx", "q_idx")


def error_heatmap(pooled, title: str):
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(z=pooled, colorscale="Viridis", colorbar=dict(title="|error|"),
                               hovertemplate="q_idx %{y}<br>dim %{x}<br>|err| %{z:.3e}<extra></extra>"))
    return _layout(fig, title, "head dim", "q_idx", height=360)


def bars(rows: Sequence[dict], x: str, y: str, title: str, color: str | None = None,
         log_y: bool = False, text: str | None = None):
    """A grouped bar chart of a long-form table (rows of dicts)."""
    import pandas as pd
    import plotly.express as px

    frame = pd.DataFrame(list(rows))
    fig = px.bar(frame, x=x, y=y, color=color, barmode="group", log_y=log_y, text=text,
                 title=title)
    if text:
        fig.update_traces(texttemplate="%{y:.3g}", textposition="outside", cliponaxis=False)
    if log_y:  # decades only: plotly's default labels 2 and 5 between decades read as values
        fig.update_yaxes(dtick=1, tickformat="~g")
    fig.update_layout(height=380, margin=dict(l=10, r=10, t=40, b=10))
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
                 log_x=log_x, title=title, facet_col="file" if side_by_side else None,
                 labels={"value": value_label})
    fig.update_layout(height=max(380, 26 * n_cases * max(1, frame["provider"].nunique()) // 2 + 140),
                      margin=dict(l=10, r=10, t=60, b=10))
    fig.update_yaxes(autorange="reversed", title=None)
    if log_x:
        fig.update_xaxes(dtick=1)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    return fig
