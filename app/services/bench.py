"""The Benchmarks page's work: bench presets (run by the worker), result files (run here, by
bench's loader), comparison tables and bench's report."""
from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import Callable

from bench.grid import PRESET_HELP, preset_names
from bench.report import write_report
from bench.runner import load_results

from app.services.common import call, provider_label, results_dir, workbench_dir
from app.settings import REPO_ROOT

#: Runs committed with the repository (the latest anchors per GPU).
PUBLISHED_DIR = REPO_ROOT / "bench" / "results"


def presets() -> dict[str, str]:
    """bench's preset names and what each measures."""
    return {n: PRESET_HELP.get(n, "") for n in preset_names()}


def run_preset(name: str, progress: Callable[[float, str], None] | None = None) -> dict:
    """Run a bench preset on this machine (in the worker); its results (``rows``, ``envs``,
    ``path``)."""
    return call("run_preset", progress, name=name, out_dir=workbench_dir(f"preset-{name}"))


def content_key(data: bytes) -> str:
    """Uploads are told apart by content: two files named results.json are two runs."""
    return hashlib.sha256(data).hexdigest()[:8]


def load_uploaded(name: str, data: bytes) -> dict:
    """Load an uploaded results.json / results.csv with bench's loader (kept for reports)."""
    folder = Path(workbench_dir("uploads", content_key(data)))
    suffix = ".csv" if name.lower().endswith(".csv") else ".json"
    path = folder / f"results{suffix}"
    path.write_bytes(data)
    try:
        loaded = load_results(path)
    except Exception as e:  # noqa: BLE001 - a file that is not bench's results
        raise ValueError(f"{name} is not a bench results file: {e}") from None
    loaded["path"] = str(path)
    loaded["name"] = name
    return loaded


def discovered_results() -> dict[str, str]:
    """Run folders under ``results/`` (bench's default output) and the runs published under
    ``bench/results/``: label -> path."""
    found = {}
    for root, prefix in ((results_dir(), ""), (PUBLISHED_DIR, "bench/results/")):
        if root.is_dir():
            for path in sorted(root.rglob("results.json")):
                found[prefix + str(path.parent.relative_to(root))] = str(path.parent)
    return found


def load_results_path(path: str) -> dict:
    data = load_results(path)
    data["path"] = path
    return data


def short_variant(variant: str) -> str:
    """A variant spec for display: a mod file's stem instead of its full path."""
    if variant.endswith(".py") or "/" in variant:
        return Path(variant.split(":", 1)[0]).stem
    return variant


def timing_table(results: dict, label: str) -> list[dict]:
    """Long-form rows of time_ms / tflops per case and provider, tagged with ``label``. A run of
    several processes (``--processes N``) gives the median of its processes' values."""
    values: dict[tuple, list[float]] = {}
    first: dict[tuple, dict] = {}
    for r in results.get("rows", []):
        timed = r.get("metric") in ("time_ms", "tflops") and r.get("status") == "ok"
        if timed and r.get("value") is not None:
            key = (r["case_id"], r["provider"], r["metric"])
            values.setdefault(key, []).append(float(r["value"]))
            first.setdefault(key, r)
    out = []
    for key, r in first.items():
        variant = short_variant(str(r["variant"]))
        case = str(r["case_id"]).replace(str(r["variant"]), variant, 1)
        out.append({"file": label, "case": case, "variant": variant,
                    "provider": provider_label(r["provider"]), "metric": r["metric"],
                    "value": statistics.median(values[key]), "dtype": r["dtype"], "pass": r.get("pass")})
    return out


def status_table(results: dict, label: str) -> list[dict]:
    """(provider, case) pairs that did not run or failed, with bench's reason."""
    out = []
    for r in results.get("rows", []):
        if r.get("metric") == "status" or r.get("status") not in ("ok", None):
            variant = short_variant(str(r["variant"]))
            out.append({"file": label, "provider": provider_label(r["provider"]),
                        "status": r["status"],
                        "case": str(r["case_id"]).replace(str(r["variant"]), variant, 1),
                        "metric": r["metric"], "reason": r.get("note", "")})
    return out


def report_files(paths: list[str], labels: list[str] | None = None) -> dict[str, bytes]:
    """``{"html": ..., "md": ...}``: bench's report (``bench.report.write_report``) of result files."""
    with tempfile.TemporaryDirectory() as tmp:
        written = write_report(list(paths), Path(tmp) / "report", force=True, labels=labels)
        files = {}
        for path in map(Path, written):
            if path.suffix in (".html", ".md"):
                files[path.suffix[1:]] = path.read_bytes()
    if not files:
        raise ValueError("bench's report code wrote no HTML or markdown file.")
    return files


def report_of_rows(rows: list[dict], envs: list, label: str, variant_names: dict[str, str]
                   ) -> dict[str, bytes]:
    """bench's report of rows kept with an experiment; variant specs (generated file paths) are
    renamed after the experiment (``variant_names``) so the report never shows a file path."""
    renamed = [{**r, "variant": variant_names.get(r["variant"], short_variant(r["variant"]))}
               for r in rows]
    for r in renamed:
        r["case_id"] = "|".join([r["variant"]] + str(r["case_id"]).split("|")[1:])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.json"
        path.write_text(json.dumps({"schema": "flexlab-bench/1", "name": label, "envs": envs,
                                    "rows": renamed}))
        return report_files([str(path)], [label])
