"""Results as records bound to what they were computed from, and the exported report.

A record is JSON data: ``{"kind", "fingerprint", "params", "provenance", "data"}``. The report of
an experiment holds only the records whose fingerprint is the experiment's current one; others
are listed as stale and left out.
"""
from __future__ import annotations

import base64
import html as html_mod
import io
import json
import zipfile

import numpy as np

from app.services import tables
from app.services.bench import report_of_rows
from app.services.common import SHAPE_KEYS, provenance
from app.services.playground import benchmark_summary, sweep_rows

TITLES = {"check": "Check against float64", "grad": "Gradients against float64",
          "bench": "Benchmark", "sweep": "Sequence-length sweep", "compare": "Two mods compared"}
#: Block map colours of empty, partial and full blocks (the same as the pages').
BLOCK_COLOURS = ("#e8e8e8", "#f28e2b", "#4e79a7")


def jsonable(value):
    """Plain JSON data of a task's result (numpy arrays become nested lists, NaN becomes None)."""
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return None if np.isnan(v) else v
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def make_record(kind: str, fingerprint: str, data: dict, params: dict | None = None) -> dict:
    """A result record: what was computed, from which code/shape/seed, where and when."""
    return {"kind": kind, "fingerprint": fingerprint, "params": jsonable(params or {}),
            "provenance": provenance(), "data": jsonable(data)}


def is_current(record: dict | None, fingerprint: str) -> bool:
    return bool(record) and record.get("fingerprint") == fingerprint


# ---- images -------------------------------------------------------------------------------------

def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def mask_png(view: dict, title: str) -> bytes:
    """The (pooled) mask as a PNG: dark where kept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = np.asarray(view["pooled"], dtype=float)
    rs, cs = view["pool"]
    fig, ax = plt.subplots(figsize=(4.2, 4.0))
    im = ax.imshow(pooled, cmap="Blues", vmin=0, vmax=1, interpolation="nearest",
                   extent=(0, pooled.shape[1] * cs, pooled.shape[0] * rs, 0))
    ax.set_xlabel("key index kv_idx")
    ax.set_ylabel("query index q_idx")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, label="fraction kept")
    return _png(fig)


def block_png(view: dict, title: str) -> bytes:
    """The block map as a PNG: empty, partial and full blocks in the pages' colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    m = np.asarray(view["map"], dtype=float)
    bq, bkv = view["block_size"]
    fig, ax = plt.subplots(figsize=(4.2, 4.0))
    ax.imshow(m, cmap=ListedColormap(BLOCK_COLOURS), vmin=-0.5, vmax=2.5, interpolation="nearest")
    ax.set_xlabel(f"key block ({bkv} keys each)")
    ax.set_ylabel(f"query block ({bq} queries each)")
    ax.set_title(title, fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=[Patch(color=c, label=n) for c, n in zip(BLOCK_COLOURS,
                                                                ("empty", "partial", "full"))],
              loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return _png(fig)


# ---- the report ---------------------------------------------------------------------------------

def _sections(results: dict, fingerprint: str) -> tuple[list[tuple[str, tables.Table]], list[str]]:
    """(title, table) of each current result, and the kinds left out as stale."""
    out, stale = [], []
    for kind in ("check", "grad", "bench", "sweep", "compare"):
        record = results.get(kind)
        if not record:
            continue
        if not is_current(record, fingerprint):
            stale.append(TITLES[kind])
            continue
        data = record["data"]
        if kind == "check":
            out.append((TITLES[kind], tables.check_table(data["rows"])))
        elif kind == "grad":
            out.append((TITLES[kind], tables.gradient_table(data["rows"])))
        elif kind == "bench":
            out.append((TITLES[kind], tables.benchmark_table(benchmark_summary(data["rows"]))))
        elif kind == "sweep":
            out.append((f"{TITLES[kind]} ({record['params'].get('pass', '')})",
                        tables.sweep_table(sweep_rows(data["rows"]))))
        elif kind == "compare":
            out.append((f"{TITLES[kind]}: {' vs '.join(data['labels'])}",
                        tables.compare_table(data)))
    return out, stale


def report(name: str, code: str, shape: dict, seed: int, fingerprint: str, results: dict,
           images: dict[str, bytes], env: dict | None = None) -> dict[str, bytes]:
    """The experiment's report: ``{"html": self-contained page, "zip": markdown, PNGs and JSON}``.

    Args:
        results: ``{kind: record}``; only records of ``fingerprint`` are included.
        images: ``{"mask": png, "block_map": png}`` of the current code.
    """
    sections, stale = _sections(results, fingerprint)
    shape_text = ", ".join(f"{k}={shape[k]}" for k in SHAPE_KEYS if k in shape)
    where = env or {}
    facts = [("shape", shape_text), ("seed", str(seed)), ("fingerprint", fingerprint),
             ("commit", str(where.get("commit") or "unknown")),
             ("device", str(where.get("device") or "unknown")),
             ("torch / triton", f"{where.get('torch')} / {where.get('triton')}")]
    stale_note = ("Left out because they were computed from other code, shape or seed (stale): "
                  + ", ".join(stale) + ".") if stale else ""
    bench = results.get("bench")
    bench_files = None
    if is_current(bench, fingerprint):
        data = bench["data"]
        bench_files = report_of_rows(data["rows"], data.get("envs", []), name,
                                     {spec: name for spec in {r["variant"] for r in data["rows"]}})

    # Markdown, with the images beside it in the archive.
    md = [f"# {name}", "", "flexlab Playground experiment.", ""]
    md += [f"- **{k}**: {v}" for k, v in facts] + ["", "```python", code.rstrip(), "```", ""]
    md += ["## Mask and block map", "", "![mask](mask.png) ![block map](block_map.png)", ""]
    for title, table in sections:
        md += [f"## {title}", "", tables.markdown(table), ""]
    if stale_note:
        md += [f"_{stale_note}_", ""]
    if bench_files and "md" in bench_files:
        md += ["---", "", bench_files["md"].decode()]
    markdown_text = "\n".join(md)

    def img(png: bytes, alt: str) -> str:
        return (f"<img alt='{alt}' src='data:image/png;base64,{base64.b64encode(png).decode()}' "
                "style='max-width:45%;margin-right:1em'>")

    parts = [f"<h1>{html_mod.escape(name)}</h1><p>flexlab Playground experiment.</p><ul>"]
    parts += [f"<li><b>{html_mod.escape(k)}</b>: {html_mod.escape(v)}</li>" for k, v in facts]
    parts += ["</ul>", f"<pre style='background:#f6f6f6;padding:.8em'><code>{html_mod.escape(code)}"
              "</code></pre>",
              "<h2>Mask and block map</h2>",
              img(images["mask"], "mask") + img(images["block_map"], "block map")]
    for title, table in sections:
        parts.append(f"<h2>{html_mod.escape(title)}</h2>{tables.html(table)}")
    if stale_note:
        parts.append(f"<p><i>{html_mod.escape(stale_note)}</i></p>")
    body = "\n".join(parts)
    style = ("<style>body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}"
             "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}"
             "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left}"
             "th{background:#f0f0f0}</style>")
    if bench_files and "html" in bench_files:
        page = bench_files["html"].decode().replace("<body>", "<body>" + style + body + "<hr>", 1)
    else:
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>"
                f"{html_mod.escape(name)}</title>{style}</head><body>{body}</body></html>")

    record = {"name": name, "code": code, "shape": shape, "seed": seed, "fingerprint": fingerprint,
              "results": {k: v for k, v in results.items() if is_current(v, fingerprint)},
              "provenance": env}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("report.md", markdown_text)
        z.writestr("mask.png", images["mask"])
        z.writestr("block_map.png", images["block_map"])
        z.writestr("experiment.json", json.dumps(record, indent=1))
    return {"html": page.encode(), "zip": buf.getvalue(), "md": markdown_text.encode()}
