"""Reports: offline HTML that parses, PNGs that open, markdown columns, comparisons, no overwrite."""
from __future__ import annotations

import json
import shutil
import sys
from html.parser import HTMLParser

import pytest

from bench import report


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.script_srcs, self.links, self.imgs, self.text = [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "script" and attrs.get("src"):
            self.script_srcs.append(attrs["src"])
        if tag == "link" and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag == "img":
            self.imgs.append(attrs.get("src", ""))

    def handle_data(self, data):
        self.text.append(data)


def _parse(path):
    parser = _Collect()
    parser.feed(path.read_text())
    parser.close()
    return parser


def _second_run(small_run, tmp_path, gpu="Test GPU B"):
    """A copy of the small run that claims another GPU (a stand-in for a second machine)."""
    other = tmp_path / "other"
    shutil.copytree(small_run.parent, other)
    data = json.loads((other / "results.json").read_text())
    for env in data["envs"]:
        env["gpu_name"] = gpu
    for row in data["rows"]:
        if row["metric"] == "time_ms":
            row["value"] *= 2
    (other / "results.json").write_text(json.dumps(data))
    (other / "rows.jsonl").unlink()  # keep the edited results.json authoritative
    return other / "results.json"


def test_report_files(small_run, tmp_path):
    out = tmp_path / "rep"
    paths = report.write_report([small_run.parent], out)
    names = {p.name for p in paths}
    assert {"report.html", "summary.md", "results.csv"} <= names
    pngs = sorted((out / "figures").glob("*.png"))
    assert pngs
    from PIL import Image

    for png in pngs:
        with Image.open(png) as im:
            im.verify()
            assert im.size[0] > 100 and im.size[1] > 100
    parsed = _parse(out / "report.html")
    assert "table" in parsed.tags and "script" in parsed.tags  # plotly figures, inline
    assert not parsed.script_srcs and not parsed.links  # nothing loaded from elsewhere
    html_text = (out / "report.html").read_text()
    assert 'src="http' not in html_text and "src='http" not in html_text
    text = " ".join(parsed.text)
    assert "Errors against float64" in text and "Environment" in text and "sdpa_math" in text


def test_markdown_summary_columns(small_run, tmp_path):
    report.write_report(small_run, tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text().splitlines()
    header = next(line for line in md if line.startswith("| variant"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["variant", "shape", "dtype", "pass",
                                                                 "sdpa_math"]
    table_rows = [l for l in md[md.index(header) + 2:] if l.startswith("|")]
    assert len(table_rows) >= 4 and all("ms)" in l for l in table_rows[:4])


def test_existing_report_needs_force(small_run, tmp_path):
    out = tmp_path / "rep"
    report.write_report(small_run, out)
    marker = (out / "summary.md").read_text()
    with pytest.raises(report.ReportExistsError, match="--force"):
        report.write_report(small_run, out)
    assert (out / "summary.md").read_text() == marker
    report.write_report(small_run, out, force=True)


def test_cli_refuses_overwrite(small_run, tmp_path):
    from bench.__main__ import main

    out = tmp_path / "rep"
    assert main(["report", str(small_run), "--out", str(out)]) == 0
    assert main(["report", str(small_run), "--out", str(out)]) == 2
    assert main(["report", str(small_run), "--out", str(out), "--force"]) == 0


def test_two_runs_side_by_side(small_run, tmp_path):
    other = _second_run(small_run, tmp_path)
    out = tmp_path / "cmp"
    report.write_report([small_run, other], out, labels=["run-A", "run-B"])
    md = (out / "summary.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| variant"))
    assert "sdpa_math [run-A]" in header and "sdpa_math [run-B]" in header
    html_text = (out / "report.html").read_text()
    assert "run-A" in html_text and "run-B" in html_text and "Test GPU B" in html_text
    csv_text = (out / "results.csv").read_text().splitlines()
    assert csv_text[0].startswith("source,") and any(l.startswith("run-B,") for l in csv_text)
    # Default labels come from the environments (GPU @ commit).
    report.write_report([small_run, other], tmp_path / "cmp2")
    assert "Test GPU B @" in (tmp_path / "cmp2" / "summary.md").read_text()


def test_report_without_plotly_embeds_pngs(small_run, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly now raises ImportError
    report.write_report(small_run, tmp_path / "rep")
    parsed = _parse(tmp_path / "rep" / "report.html")
    assert parsed.imgs and all(src.startswith("data:image/png;base64,") for src in parsed.imgs)
    assert "script" not in parsed.tags


def test_report_reads_an_unfinished_run(tmp_path):
    from bench import runner
    from tests.bench.helpers import small_grid

    out = tmp_path / "r"
    runner.run(small_grid(), out, progress=False, log=lambda m: None)
    (out / "results.json").unlink()
    lines = (out / "rows.jsonl").read_text().splitlines()
    (out / "rows.jsonl").write_text(lines[0] + "\n" + lines[1][:20])
    report.write_report(out, tmp_path / "rep")
    assert "sdpa_math" in (tmp_path / "rep" / "summary.md").read_text()


def _row(case: dict, provider: str, metric: str, value, run_id: str = "r1") -> dict:
    return {**case, "run_id": run_id, "provider": provider, "metric": metric, "value": value,
            "status": "ok", "note": "", "unit": ""}


def _results(path, envs: list, cases: list[tuple[dict, float, float]]):
    """A results.json of flexlab rows: (case, time_ms, tflops) each."""
    rows = []
    for case, ms, tflops in cases:
        rows += [_row(case, "flexlab", "time_ms", ms), _row(case, "flexlab", "tflops", tflops)]
    path.write_text(json.dumps({"schema": "flexlab-bench/1", "name": path.stem, "envs": envs, "rows": rows}))
    return path


def _case(dtype: str, pass_: str = "fwd") -> dict:
    return {"case_id": f"causal|{dtype}|{pass_}", "variant": "causal", "batch": 1, "q_heads": 16,
            "kv_heads": 16, "q_len": 4096, "kv_len": 4096, "head_dim": 128, "v_head_dim": 128,
            "dtype": dtype, "pass": pass_, "density": 0.5}


def test_roofline_fraction_of_the_measured_peak(tmp_path):
    """bf16/fp16 attention rows of a run that measured a peak show TFLOP/s as a fraction of it;
    float32 rows, and runs without a measured peak (CPU), show none and the legend says why."""
    from bench.env import PEAK_KEY, peak_tflops

    peak = 800.0
    gpu_env = {"run_id": "r1", "gpu_name": "Fake GPU", "git_commit": "a" * 40, PEAK_KEY: peak}
    cpu_env = {"run_id": "r1", "gpu_name": None, "cpu": "x86_64", "git_commit": "a" * 40, PEAK_KEY: None}
    cases = [(_case("bfloat16"), 2.0, 412.0), (_case("float16", "fwd_bwd"), 7.0, 301.0),
             (_case("float32"), 9.0, 55.0)]
    gpu = _results(tmp_path / "gpu.json", [gpu_env], cases)
    cpu = _results(tmp_path / "cpu.json", [cpu_env], cases)
    assert peak_tflops([gpu_env]) == peak and peak_tflops([cpu_env]) is None
    assert peak_tflops([gpu_env, {**gpu_env, PEAK_KEY: 780.0}, {**gpu_env, PEAK_KEY: 790.0}]) == 790.0

    sources = report.load_sources([gpu, cpu], ["gpu", "cpu"])
    cells, keys, providers = report.build_cells(sources)
    header, rows = report.summary_rows(sources, cells, keys, providers)
    by_case = {(r[2], r[3]): r for r in rows}
    for case, ms, tflops in cases:
        row = by_case[(case["dtype"], case["pass"])]
        fraction = tflops / peak
        plain = f"{report._fmt(tflops)} ({report._fmt(ms)} ms)"
        if case["dtype"] == "float32":
            assert row[header.index("flexlab [gpu]")] == plain
        else:
            assert row[header.index("flexlab [gpu]")] == (
                f"{report._fmt(tflops)} ({100 * fraction:.0f}%, {report._fmt(ms)} ms)")
            assert f"{100 * fraction:.0f}%" in row[header.index("flexlab [gpu]")]
        assert row[header.index("flexlab [cpu]")] == plain

    out = tmp_path / "rep"
    report.write_report([gpu, cpu], out, labels=["gpu", "cpu"])
    md = (out / "summary.md").read_text()
    assert f"gpu: {peak:.0f} TFLOP/s" in md and "No % of peak for cpu" in md
    assert "52%" in md  # 412 of 800, written by hand once: the cell reads as a person expects
    assert "% of peak" in (out / "report.html").read_text()


# ---- synthetic results: each rule of the tables on rows built by hand ---------------------------

def _case_rows(case, provider, time_ms=1.0, *, status="ok", process=None, errors=None, head_dim=16,
               v_head_dim=16):
    """A (case, provider)'s rows as a run writes them: status, time_ms, and ``errors``
    {prefix: (max_abs, tolerance)} with their *_correct (status fail over tolerance)."""
    from bench.runner import Row

    variant, batch, q_len, kv_len = case
    base = dict(run_id="r", case_id=f"{variant}|B{batch}|H2/2|Q{q_len}|KV{kv_len}|D{head_dim}/{v_head_dim}"
                "|float32|fwd", variant=variant, batch=batch, q_heads=2, kv_heads=2, q_len=q_len,
                kv_len=kv_len, head_dim=head_dim, v_head_dim=v_head_dim, dtype="float32", pass_="fwd",
                density=1.0, provider=provider, process=process)
    rows = [Row(**base, metric="status", value=None, unit="", status=status)]
    if status == "ok":
        rows.append(Row(**base, metric="time_ms", value=time_ms, unit="ms", status="ok"))
    for prefix, (max_abs, tol) in (errors or {}).items():
        ok = max_abs <= tol
        rows += [Row(**base, metric=f"{prefix}_max_abs", value=max_abs, unit="abs", status="ok"),
                 Row(**base, metric=f"{prefix}_tolerance", value=tol, unit="abs", status="ok"),
                 Row(**base, metric=f"{prefix}_correct", value=float(ok), unit="bool",
                     status="ok" if ok else "fail")]
    return [r.to_dict() for r in rows]


def _synthetic(tmp_path, rows, name="results.json", **payload):
    path = tmp_path / name
    path.write_text(json.dumps({"schema": "flexlab-bench/1", "name": "synthetic", "envs": [],
                                "rows": rows, **payload}))
    return path


def test_cases_that_differ_in_the_value_head_dim_keep_their_own_rows(tmp_path):
    rows = (_case_rows(("causal", 1, 64, 64), "flexlab", 1.0, v_head_dim=16)
            + _case_rows(("causal", 1, 64, 64), "sdpa_math", 2.0, v_head_dim=16)
            + _case_rows(("causal", 1, 64, 64), "flexlab", 3.0, v_head_dim=64)
            + _case_rows(("causal", 1, 64, 64), "sdpa_math", 9.0, v_head_dim=64))
    sources = report.load_sources([_synthetic(tmp_path, rows)])
    cells, keys, providers = report.build_cells(sources)
    header, table = report.summary_rows(sources, cells, keys, providers)
    shapes = [row[1] for row in table]
    assert shapes == ["B=1 H=2 S=64 D=16", "B=1 H=2 S=64 D=16/64"]
    ratio = header.index("flexlab ÷ sdpa_math")
    assert [row[ratio] for row in table] == ["2.00×", "3.00×"]
    speed = report.speedups(sources, cells, keys, providers, "sdpa_math")
    # The geometric mean of both cases' speed-ups (2 and 3), not of one of them.
    assert speed["fwd"]["causal"][(sources[0].label, "flexlab")] == pytest.approx(6 ** 0.5)


def test_error_table_judges_a_cell_by_its_worst_process(tmp_path):
    """One process failing its check fails the cell (the summary's ✗ says so too), and the cell's
    errors are that process's; the times stay the median over the processes."""
    case = ("causal", 1, 64, 64)
    rows = []
    for process, max_abs in ((1, 1e-7), (2, 5e-5), (3, 2e-7)):  # tolerance 1e-5: process 2 fails
        rows += _case_rows(case, "flexlab", 1.0 + process, process=process, errors={"out": (max_abs, 1e-5)})
    sources = report.load_sources([_synthetic(tmp_path, rows)])
    cells, keys, providers = report.build_cells(sources)
    cell = cells[(sources[0].label, keys[0], "flexlab")]
    assert cell.metrics["time_ms"] == 3.0 and cell.metrics["out_max_abs"] == 5e-5
    header, table = report.error_rows(sources, cells, keys, providers)
    assert table[0][header.index("pass/fail")] == "FAIL: out"
    assert table[0][header.index("out max abs")] == "5e-05"
    summary_header, summary = report.summary_rows(sources, cells, keys, providers)
    assert summary[0][summary_header.index("flexlab")].endswith("✗")
    # All passing: the largest error is shown, with its own process's tolerance.
    rows = []
    for process, (max_abs, tol) in ((1, (1e-7, 1e-5)), (2, (3e-6, 4e-6)), (3, (2e-7, 1e-5))):
        rows += _case_rows(case, "flexlab", 1.0, process=process, errors={"out": (max_abs, tol)})
    sources = report.load_sources([_synthetic(tmp_path, rows, "passing.json")])
    cells, keys, providers = report.build_cells(sources)
    header, table = report.error_rows(sources, cells, keys, providers)
    assert table[0][header.index("pass/fail")] == "pass"
    assert (table[0][header.index("out max abs")], table[0][header.index("out tolerance")]) == ("3e-06", "4e-06")


def test_speedups_skip_cells_that_did_not_run_or_have_no_time(tmp_path):
    """The geometric-mean bars use the summary table's cells: a provider whose status is an error
    (even with a time row) or whose time is NaN gives no bar, and never a NaN one."""
    rows = (_case_rows(("causal", 1, 64, 64), "flexlab", 1.0) + _case_rows(("causal", 1, 64, 64), "sdpa_math", 4.0)
            + _case_rows(("causal", 1, 128, 128), "flexlab", float("nan"))
            + _case_rows(("causal", 1, 128, 128), "sdpa_math", 4.0)
            + _case_rows(("causal", 1, 256, 256), "flexlab", 1.0)
            + _case_rows(("causal", 1, 256, 256), "sdpa_math", 4.0))
    for r in rows:  # sdpa_math errored at S=256 after its time was written
        if r["q_len"] == 256 and r["provider"] == "sdpa_math" and r["metric"] == "status":
            r["status"], r["note"] = "error", "RuntimeError: boom"
    sources = report.load_sources([_synthetic(tmp_path, rows)])
    cells, keys, providers = report.build_cells(sources)
    speed = report.speedups(sources, cells, keys, providers, "sdpa_math")
    assert speed["fwd"]["causal"][(sources[0].label, "flexlab")] == pytest.approx(4.0)
    header, table = report.summary_rows(sources, cells, keys, providers)
    assert [row[header.index("flexlab ÷ sdpa_math")] for row in table] == ["4.00×", "", ""]


def test_summary_notes_an_unfinished_run_and_rows_outside_its_config(tmp_path):
    from bench import runner
    from tests.bench.helpers import small_grid

    out = tmp_path / "r"
    grid = small_grid(passes=("fwd",))
    runner.run(grid, out, progress=False, log=lambda m: None)
    lines = (out / "rows.jsonl").read_text().splitlines()
    assert len(lines) == 2
    (out / "rows.jsonl").write_text(lines[0] + "\n")  # as if stopped after its first case
    md = report.summary_markdown([out])
    assert md.startswith("note: incomplete: 1 of 2 cases") and "--resume" in md
    # A config.json of other cases: every record lies outside it, and the note says how many rows.
    config = json.loads((out / "config.json").read_text())
    for case in config["cases"]:
        case["q_len"] += 1
    (out / "config.json").write_text(json.dumps(config))
    md = report.summary_markdown([out])
    n_rows = len(json.loads(lines[0])["rows"])
    assert f"note: {n_rows} rows of 1 case(s) in rows.jsonl lie outside config.json" in md
    assert "incomplete: 0 of 2 cases" in md
    rep = tmp_path / "rep"
    report.write_report([out], rep)
    assert "lie outside config.json" in (rep / "summary.md").read_text()
    assert "incomplete: 0 of 2 cases" in (rep / "report.html").read_text()
    # A finished run has no note.
    (out / "rows.jsonl").write_text("\n".join(lines) + "\n")
    (out / "config.json").write_text(json.dumps(grid.to_dict()))
    assert report.summary_markdown([out]).startswith("| variant")
