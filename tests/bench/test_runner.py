"""The runner: long-form schema, correctness and gradient checks that can fail, resumable runs."""
from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch

from bench import providers as prov
from bench import runner
from bench.runner import COLUMNS, Row
from tests.bench.helpers import ALIBI, CAUSAL, PerturbedProvider, small_grid


def _rows(path):
    return json.loads(path.read_text())["rows"]


def _by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def test_schema_of_json_and_csv(small_run):
    data = json.loads(small_run.read_text())
    assert data["schema"] == runner.SCHEMA_VERSION and data["complete"]
    assert data["columns"] == COLUMNS == [("pass" if f.name == "pass_" else f.name)
                                          for f in dataclasses.fields(Row)]
    rows = data["rows"]
    assert rows and all(list(r) == COLUMNS for r in rows)
    with open(small_run.parent / "results.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) and list(csv_rows[0]) == COLUMNS
    # One row per (case, provider, metric).
    keys = [(r["case_id"], r["provider"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))
    env = data["envs"][0]
    for key in ("gpu_name", "driver", "cuda", "torch", "triton", "flexlab", "git_commit", "time_utc"):
        assert key in env
    assert env["torch"] == torch.__version__


def test_metrics_of_every_case(small_run):
    rows = _rows(small_run)
    cases = {r["case_id"] for r in rows}
    assert len(cases) == 4
    for case in cases:
        mine = _by(rows, case_id=case, provider="sdpa_math")
        metrics = {r["metric"]: r for r in mine}
        for m in ("time_ms", "time_ms_p20", "time_ms_p80", "compile_s", "setup_s", "tflops", "out_max_abs",
                  "out_rel_fro", "out_correct", "peak_mem_bytes"):
            assert m in metrics, (case, m)
        assert metrics["time_ms_p20"]["value"] <= metrics["time_ms"]["value"] <= metrics["time_ms_p80"]["value"]
        # SDPA math is its own baseline: its error equals the baseline's and passes.
        base = {r["metric"]: r["value"] for r in _by(rows, case_id=case, provider="baseline")}
        assert metrics["out_max_abs"]["value"] == base["out_max_abs"] < 1e-5
        assert metrics["out_correct"]["value"] == 1
        if "fwd_bwd" in case:
            for g in ("dq", "dk", "dv"):
                assert metrics[f"{g}_correct"]["value"] == 1 and metrics[f"{g}_rel_fro"]["value"] < 1e-5
        if ALIBI in case and "fwd_bwd" in case:
            # The learnable slopes' gradient is compared too.
            assert metrics["dcap0_correct"]["value"] == 1 and metrics["dcap0_rel_fro"]["value"] < 1e-5


def test_tflops_is_flops_over_median_time(small_run):
    from bench.flops import attention_flops

    rows = _rows(small_run)
    r = _by(rows, provider="sdpa_math", metric="tflops")[0]
    t = _by(rows, provider="sdpa_math", metric="time_ms", case_id=r["case_id"])[0]["value"]
    flops = attention_flops(r["batch"], r["q_heads"], r["q_len"], r["kv_len"], r["head_dim"],
                            r["v_head_dim"], r["density"], r["pass"])
    assert r["value"] == pytest.approx(flops / (t * 1e-3) / 1e12)


def test_wrong_outputs_and_gradients_fail(tmp_path, monkeypatch):
    for p in (PerturbedProvider("wrong_out", out_scale=1.01), PerturbedProvider("wrong_dq", dq_scale=1.01),
              PerturbedProvider("no_cap_grad", detach_bias=True)):
        monkeypatch.setitem(prov.PROVIDERS, p.name, p)
    grid = small_grid(providers=("wrong_out", "wrong_dq", "no_cap_grad"), passes=("fwd_bwd",),
                      variants=[f"{ALIBI}+{CAUSAL}"])
    rows = _rows(runner.run(grid, tmp_path / "r", progress=False, log=lambda m: None))
    get = {(r["provider"], r["metric"]): r for r in rows}
    assert get[("wrong_out", "out_correct")]["value"] == 0 and get[("wrong_out", "out_correct")]["status"] == "fail"
    assert get[("wrong_dq", "out_correct")]["value"] == 1
    assert get[("wrong_dq", "dq_correct")]["value"] == 0 and get[("wrong_dq", "dk_correct")]["value"] == 1
    assert get[("wrong_dq", "dq_rel_fro")]["value"] == pytest.approx(0.01, rel=1e-3)
    # The bias without autograd never reaches the learnable slopes.
    assert get[("no_cap_grad", "dcap0_correct")]["status"] == "fail"
    assert "no gradient" in get[("no_cap_grad", "dcap0_correct")]["note"]



class _TurnedAway(PerturbedProvider):
    """SDPA math that, at every call, meets a Gluon kernel kept as failed, as flexcore's calls do
    once a first launch failed."""

    def prepare(self, ctx):
        from flexcore.kernels import hopper
        inner = super().prepare(ctx)

        def call(q, k, v):
            assert hopper._turned_away("failed kernel")
            return inner.call(q, k, v)

        return dataclasses.replace(inner, call=call, grad_call=None)


def test_rows_timed_on_the_template_after_a_failed_gluon_kernel_say_why(tmp_path, monkeypatch):
    # In every case, not only the first (the warning is given once per process); a provider that
    # meets no kept failure keeps its note.
    import collections

    from flexcore.kernels import hopper
    monkeypatch.setattr(hopper, "_unsupported", {"failed kernel": "RuntimeError: boom"})
    monkeypatch.setattr(hopper, "_declined", collections.Counter())
    for p in (_TurnedAway("turned_away"), PerturbedProvider("steady")):
        monkeypatch.setitem(prov.PROVIDERS, p.name, p)
    grid = small_grid(providers=("turned_away", "steady"), passes=("fwd",), variants=[CAUSAL, ALIBI])
    rows = _rows(runner.run(grid, tmp_path / "r", progress=False, log=lambda m: None))
    cases = {r["case_id"] for r in rows}
    assert len(cases) == 2
    for case in cases:
        for metric in ("setup_s", "compile_s"):
            (row,) = _by(rows, case_id=case, provider="turned_away", metric=metric)
            assert row["note"] == "perturbed; Gluon kernel not used (RuntimeError: boom): the Triton template's times"
            (row,) = _by(rows, case_id=case, provider="steady", metric=metric)
            assert row["note"] == "perturbed"
        assert _by(rows, case_id=case, provider="turned_away", metric="out_correct")[0]["value"] == 1


def test_rounds_interleave_the_providers_and_pool_their_repetitions(tmp_path, monkeypatch):
    """With settings.rounds = 3, a case's providers are timed one after another in each of 3 rounds
    (each a third of the repetitions, every other round in reverse order), and each reports
    quantiles over the pooled repetitions."""
    from bench import timing

    for p in (PerturbedProvider("first"), PerturbedProvider("second")):
        monkeypatch.setitem(prov.PROVIDERS, p.name, p)
    steps, order = {}, []
    real = timing.time_call

    def spy(step, *args, **kwargs):
        order.append(steps.setdefault(step, len(steps)))
        return real(step, *args, **kwargs)

    monkeypatch.setattr(runner, "time_call", spy)
    grid = small_grid(providers=("first", "second"), passes=("fwd",), variants=[CAUSAL], cpu_reps=6,
                      rounds=3)
    rows = _rows(runner.run(grid, tmp_path / "r", progress=False, log=lambda m: None))
    assert order == [0, 1, 1, 0, 0, 1], order
    for name in ("first", "second"):
        got = {r["metric"]: r for r in _by(rows, provider=name)}
        assert got["reps"]["value"] == 6  # 3 rounds of 2
        assert "3 interleaved rounds" in got["time_ms"]["note"]
        assert got["time_ms_p20"]["value"] <= got["time_ms"]["value"] <= got["time_ms_p80"]["value"]


def test_refuses_to_overwrite_a_run(tmp_path):
    grid = small_grid(variants=[CAUSAL], passes=("fwd",))
    runner.run(grid, tmp_path / "r", progress=False, log=lambda m: None)
    with pytest.raises(runner.RunDirError, match="--resume"):
        runner.run(grid, tmp_path / "r", progress=False, log=lambda m: None)
    runner.run(grid, tmp_path / "r", progress=False, force=True, log=lambda m: None)


def test_interrupted_run_resumes_without_redoing_cases(tmp_path, monkeypatch):
    grid = small_grid()
    out = tmp_path / "r"
    first = runner.run(grid, out, progress=False, log=lambda m: None)
    lines = (out / "rows.jsonl").read_text().splitlines()
    assert len(lines) == 4
    # Simulate a kill during the third case: two finished lines and half of a third.
    (out / "rows.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    kept = {json.loads(l)["case_id"]: json.loads(l) for l in lines[:2]}
    assert runner.load_results(out)["cases_done"] == 2  # the cut line is ignored

    ran = []
    real = runner.CaseRunner.run

    def spy(self):
        ran.append(self.case.case_id)
        return real(self)

    monkeypatch.setattr(runner.CaseRunner, "run", spy)
    runner.run(grid, out, resume=True, progress=False, log=lambda m: None)
    assert sorted(ran) == sorted(set(c.case_id for c in grid.cases) - set(kept))
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] and data["cases_done"] == 4 and len(data["envs"]) == 2
    for case_id, entry in kept.items():  # finished cases are kept as written
        assert [r for r in data["rows"] if r["case_id"] == case_id] == entry["rows"]
    assert first == out / "results.json"


def test_max_minutes_stops_early_and_resume_finishes(tmp_path):
    grid = small_grid(max_minutes=1e-9)
    out = tmp_path / "r"
    runner.run(grid, out, progress=False, log=lambda m: None)
    assert json.loads((out / "results.json").read_text())["cases_done"] == 1  # at least one case per invocation
    grid.settings.max_minutes = 0
    runner.run(grid, out, resume=True, progress=False, log=lambda m: None)
    assert json.loads((out / "results.json").read_text())["complete"]


def test_decode_reports_bandwidth(tmp_path):
    from bench.grid import build_grid

    config = {"groups": [{"variants": [f"{ALIBI}"], "shapes": [[2, 1, 96]], "heads": [[4, 2]],
                          "head_dim": [16], "dtype": ["float32"], "passes": ["decode"]}],
              "providers": ["sdpa_math"], "settings": {"cpu_reps": 2}}
    rows = _rows(runner.run(build_grid(config), tmp_path / "d", progress=False, log=lambda m: None))
    gbps = _by(rows, provider="sdpa_math", metric="gbps")[0]["value"]
    t = _by(rows, provider="sdpa_math", metric="time_ms")[0]["value"]
    assert gbps == pytest.approx(2 * 2 * 96 * 32 * 4 / (t * 1e-3) / 1e9)
    assert _by(rows, provider="sdpa_math", metric="out_correct")[0]["value"] == 1


def test_bench_imports_no_plotting_or_streamlit():
    import subprocess
    import sys

    code = ("import sys, bench.__main__, bench.runner, bench.providers, bench.report, bench.forward\n"
            "bad = [m for m in ('plotly', 'streamlit', 'matplotlib') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the library entry point: mods in memory, a progress callback -------------------------------

def _progress_log():
    calls = []
    return calls, lambda done, total, case: calls.append((done, total, case.case_id))


def _assert_progress(calls, grid):
    # Each case reports as it starts and as it ends, in order; done only grows, and ends at total.
    total = len(grid.cases)
    assert [c[1] for c in calls] == [total] * 2 * total
    assert [c[0] for c in calls] == [d for i in range(total) for d in (i, i + 1)]
    assert [c[2] for c in calls[::2]] == [c.case_id for c in grid.cases] == [c[2] for c in calls[1::2]]


def test_run_grid_with_mods_in_memory_equals_the_spec_run(tmp_path):
    # The same mods given in memory (a function of the case) give the same rows as the spec
    # resolved by bench: same inputs (seeded by case id), same errors, same captured gradient.
    from bench.mods import resolve

    grid = small_grid(variants=[f"{ALIBI}+{CAUSAL}"])
    by_spec = runner.run_grid(grid, tmp_path / "spec")
    built = []

    def mods(case):
        built.append(case.case_id)
        return resolve(case.variant, B=case.batch, H=case.q_heads, KV_HEADS=case.kv_heads,
                       Q_LEN=case.q_len, KV_LEN=case.kv_len, D=case.head_dim, device="cpu")

    calls, progress = _progress_log()
    in_memory = runner.run_grid(grid, mods=mods, progress=progress)  # no folder: a temporary one
    assert built == [c.case_id for c in grid.cases]  # once per case
    _assert_progress(calls, grid)
    assert in_memory["complete"] and in_memory["cases_done"] == len(grid.cases)

    def errors(data):
        return {(r["case_id"], r["provider"], r["metric"]): r["value"] for r in data["rows"]
                if r["metric"].endswith(("_max_abs", "_correct"))}

    assert errors(in_memory) == errors(by_spec)
    assert any(k[2] == "dcap0_correct" for k in errors(in_memory))


def test_run_grid_labels_rows_with_the_case_and_names_captured_gradients(tmp_path):
    # One Mods object for every case; the case's variant text is only a label (it names no
    # registry variant or file). The learnable tensor's rows use its name in ``captured``.
    import dataclasses

    from variants.core import Mods, Shape

    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mods = Mods(alibi, causal, {"slopes": slopes}, Shape(2, 4, 40, 72))
    grid = small_grid(variants=[CAUSAL])
    grid.cases[:] = [dataclasses.replace(c, variant="my experiment") for c in grid.cases]
    calls, progress = _progress_log()
    out = tmp_path / "mine"
    data = runner.run_grid(grid, out, mods=mods, progress=progress)
    _assert_progress(calls, grid)
    assert (out / "results.json").exists() and runner.load_results(out)["rows"] == data["rows"]
    rows = data["rows"]
    assert {r["variant"] for r in rows} == {"my experiment"}
    for case in grid.cases:
        mine = {r["metric"]: r for r in _by(rows, case_id=case.case_id, provider="sdpa_math")}
        assert mine["out_correct"]["value"] == 1
        if case.pass_ == "fwd_bwd":
            assert mine["dslopes_correct"]["value"] == 1 and mine["dslopes_rel_fro"]["value"] < 1e-5
    # A function that fails for a case makes that case's rows errors, naming the failure.
    grid.cases[:] = grid.cases[:1]

    def broken(case):
        raise ValueError("no mods for this shape")

    rows = runner.run_grid(grid, mods=broken)["rows"]
    assert [r["status"] for r in rows] == ["error"]
    assert "no mods for this shape" in rows[0]["note"]
