"""Run-to-run spread (bench.spread, ``run --processes N``): one grid timed in fresh processes one
after another, their rows merged with a ``process`` number, and the spread of each row's median
time computed from those rows.

The run is a tiny flexlab-against-SDPA-math grid under Triton's interpreter, in two processes
(about ten seconds, most of it two Python start-ups).
"""
from __future__ import annotations

import json
import statistics

import pytest

from bench import report, spread
from bench.__main__ import main

_ARGS = ["run", "--variants", "causal", "--batch", "1", "--seq", "64", "--heads", "2", "--head-dim", "16",
         "--dtype", "fp32", "--passes", "fwd", "--providers", "flexlab,sdpa_math", "--device", "cpu",
         "--no-progress"]


@pytest.fixture(scope="module")
def spread_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("spread") / "run"
    code = main(_ARGS + ["--processes", "2", "--out", str(out)])
    assert code == 0
    return out


def _times(rows):
    """{(case_id, provider): {process: time_ms}} of the timed rows."""
    out = {}
    for r in rows:
        if r["metric"] == "time_ms" and r["status"] == "ok":
            out.setdefault((r["case_id"], r["provider"]), {})[r["process"]] = r["value"]
    return out


def test_each_process_is_a_run_and_the_merge_holds_both(spread_run):
    data = json.loads((spread_run / "results.json").read_text())
    assert data["complete"] and data["cases_done"] == data["cases_total"] == 1
    assert json.loads((spread_run / "config.json").read_text())["processes"] == 2
    times = _times(data["rows"])
    assert set(times) == {(c, p) for c, _ in times for p in ("flexlab", "sdpa_math")}
    for by_process in times.values():
        assert set(by_process) == {1, 2} and all(t > 0 for t in by_process.values())
    envs = data["envs"]
    assert [e["process"] for e in envs] == [1, 2] and envs[0]["run_id"] != envs[1]["run_id"]
    for k, env in zip((1, 2), envs):
        own = json.loads((spread.process_dir(spread_run, k) / "results.json").read_text())
        assert own["complete"] and [e["run_id"] for e in own["envs"]] == [env["run_id"]]
        # The merged rows of process k are that process's rows, tagged with k.
        merged = [{c: v for c, v in r.items() if c != "process"} for r in data["rows"] if r["process"] == k]
        assert merged == [{c: v for c, v in r.items() if c != "process"} for r in own["rows"]]
        assert {r["run_id"] for r in data["rows"] if r["process"] == k} == {env["run_id"]}
        assert env["bf16_matmul_tflops"] is None  # a CPU run measures no peak


def test_spread_is_computed_from_the_processes_rows(spread_run):
    rows = json.loads((spread_run / "results.json").read_text())["rows"]
    times = _times(rows)
    found = {(s.case_id, s.provider): s for s in spread.spreads(rows)}
    assert set(found) == set(times)
    for key, by_process in times.items():
        expected = max(by_process.values()) / min(by_process.values()) - 1
        assert found[key].spread == pytest.approx(expected)
        assert found[key].times_ms == by_process
        assert found[key].flagged == (expected > spread.SPREAD_LIMIT)
    # The report: each cell holds the median over the processes, the spread table each spread.
    sources = report.load_sources([spread_run])
    cells, keys, providers = report.build_cells(sources)
    header, table = report.spread_rows(sources, cells, keys, providers)
    assert header[4:] == ["flexlab", "sdpa_math"] and len(table) == 1
    for (case_id, provider), by_process in times.items():
        cell = cells[(sources[0].label, keys[0], provider)]
        assert cell.metrics["time_ms"] == pytest.approx(statistics.median(by_process.values()))
        assert cell.process_times == by_process
        expected = max(by_process.values()) / min(by_process.values()) - 1
        assert table[0][header.index(provider)] == spread.spread_text(expected)
    md = report.summary_markdown([spread_run])
    assert "## Run-to-run spread" in md and "2 separate processes" in md


def test_resume_keeps_finished_processes_and_checks_the_count(spread_run, capsys):
    before = {k: (spread.process_dir(spread_run, k) / "rows.jsonl").read_text() for k in (1, 2)}
    assert main(_ARGS + ["--processes", "2", "--out", str(spread_run)]) == 2
    assert "holds a previous run" in capsys.readouterr().err
    assert main(_ARGS + ["--processes", "3", "--out", str(spread_run), "--resume"]) == 2
    assert "holds a run of 2 processes; resume it with --processes 2" in capsys.readouterr().err
    assert main(_ARGS + ["--processes", "2", "--out", str(spread_run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "process 1 of 2" not in err and "spread over 2 processes" in err  # nothing ran again
    assert {k: (spread.process_dir(spread_run, k) / "rows.jsonl").read_text() for k in (1, 2)} == before


def test_a_failed_process_is_an_error_naming_it(tmp_path):
    from bench.grid import build_grid

    grid = build_grid({"variants": ["causal"], "shapes": [[1, 32]], "heads": [1], "head_dim": [16],
                       "dtype": ["float32"], "passes": ["fwd"], "providers": ["sdpa_math"]})
    with pytest.raises(spread.SpreadError, match="process 1 of 2 exited with status 1"):
        spread.run_processes(grid, tmp_path / "r", 2, device="cpu", python="false", log=lambda m: None)


def test_spread_of_times():
    assert spread.spread([2.0, 2.1, 2.05]) == pytest.approx(0.05)
    assert spread.spread([1.0]) is None and spread.spread([]) is None
    assert spread.spread_text(0.031) == "3.1% ⚠" and spread.spread_text(0.02) == "2.0%"
    rows = [{"case_id": "c", "provider": "p", "metric": "time_ms", "status": "ok", "value": v, "process": k}
            for k, v in ((1, 1.0), (2, 1.04), (3, 1.02))]
    rows.append({**rows[0], "status": "error", "value": 9.0, "process": 4})        # not a timing
    rows.append({**rows[0], "provider": "q", "process": None})                     # a plain run's row
    found, = spread.spreads(rows)
    assert (found.case_id, found.provider, found.times_ms) == ("c", "p", {1: 1.0, 2: 1.04, 3: 1.02})
    assert found.spread == pytest.approx(0.04) and found.flagged


def test_max_minutes_bounds_each_process_and_resume_finishes(tmp_path, capsys):
    """With --max-minutes each process stops after its first case (the limit is tiny); every
    command exits 0 on what was measured, and --resume finishes process 1, then runs process 2.
    The merge holds a case only once both processes finished it."""
    out = tmp_path / "r"
    args = ["run", "--variants", "causal,noop", "--batch", "1", "--seq", "32", "--heads", "1", "--head-dim",
            "16", "--dtype", "fp32", "--passes", "fwd", "--providers", "sdpa_math", "--device", "cpu",
            "--no-progress", "--processes", "2", "--max-minutes", "0.00001", "--out", str(out)]
    done = []
    for attempt in range(3):
        assert main(args + (["--resume"] if attempt else [])) == 0
        data = json.loads((out / "results.json").read_text())
        done.append((spread._finished(spread.process_dir(out, 1)), spread._finished(spread.process_dir(out, 2)),
                     data["cases_done"], data["complete"]))
    assert done == [(1, 0, 0, False), (2, 1, 1, False), (2, 2, 2, True)]
    assert "max_minutes" in capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["case_id"].split("|")[0], r["process"]) for r in rows if r["metric"] == "time_ms"} == {
        (v, k) for v in ("causal", "noop") for k in (1, 2)}
