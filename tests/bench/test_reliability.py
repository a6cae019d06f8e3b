"""Bad input, mixed configs, broken result files and exit codes: one-line errors, nothing silent."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from bench import providers as prov
from bench import runner
from bench.__main__ import main
from bench.grid import build_grid, load_config
from tests.bench.helpers import ALIBI, CAUSAL, PerturbedProvider


def _config(path, *, variants=(CAUSAL,), shapes=([1, 16],), heads=(1,), passes=("fwd",),
            providers=("sdpa_math",), **settings):
    path.write_text(json.dumps({
        "providers": list(providers), "settings": {"cpu_reps": 1, **settings},
        "groups": [{"variants": list(variants), "shapes": [list(s) for s in shapes], "heads": list(heads),
                    "head_dim": [8], "dtype": ["float32"], "passes": list(passes)}]}))
    return path


def _one_line(capsys) -> str:
    """The one ``error:`` line on stderr (a progress line may precede it; no traceback)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# ---- configs are checked before anything runs -------------------------------------------------

_TOML_GROUP = ('providers = ["sdpa_math"]\n[settings]\ncpu_reps = 1\n{settings}\n[[groups]]\n'
               'variants = {variants}\nshapes = {shapes}\nheads = {heads}\nhead_dim = [8]\n'
               'dtype = ["fp32"]\npasses = ["fwd"]\n')


def _toml(tmp_path, settings="", variants='["causal"]', shapes="[[1, 16]]", heads="[1]"):
    path = tmp_path / "grid.toml"
    path.write_text(_TOML_GROUP.format(settings=settings, variants=variants, shapes=shapes, heads=heads))
    return str(path)


@pytest.mark.parametrize("case, args, words", [
    ("unknown variant", lambda t: ["--config", _toml(t, variants='["no_such_variant"]')],
     ["unknown variant 'no_such_variant'", "causal"]),
    ("seed is a string", lambda t: ["--config", _toml(t, settings='seed = "x"')], ["seed='x'", "integer"]),
    ("block_size 0", lambda t: ["--config", _toml(t, settings="block_size = 0")],
     ["block_size=0", "power of two"]),
    ("heads are words", lambda t: ["--config", _toml(t, heads='["two"]')], ["heads", "'two'"]),
    ("--seq abc", lambda t: ["--config", _toml(t), "--seq", "abc"], ["--seq 'abc'", "integers"]),
    ("broken TOML", lambda t: ["--config", str(_broken(t))], ["does not parse as TOML", "grid.toml"]),
    ("fractional length", lambda t: ["--config", _toml(t, shapes="[[1, 32.5]]")],
     ["32.5 is not an integer"]),
    ("bad device", lambda t: ["--config", _toml(t), "--device", "tpu"], ["--device 'tpu'"]),
    ("unknown setting", lambda t: ["--config", _toml(t, settings="rep = 3")], ["unknown setting", "rep"]),
    ("top-level group key", lambda t: ["--config", str(_stray_key(t))], ["unknown top-level key", "heads"]),
])
def test_config_errors_are_one_line_and_exit_2_before_anything_runs(case, args, words, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", *args(tmp_path), "--out", str(out), "--no-progress"]) == 2, case
    line = _one_line(capsys)
    for word in words:
        assert word in line, (case, line)
    assert not out.exists(), case


def _broken(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('providers = ["sdpa_math"\n[[groups]]\n')
    return path


def _stray_key(tmp_path):
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"providers": ["sdpa_math"], "heads": [2],
                                "groups": [{"variants": ["causal"], "shapes": [[1, 16]], "heads": [1],
                                            "head_dim": [8]}]}))
    return path


def test_cuda_device_without_a_gpu_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert main(["run", "--config", _toml(tmp_path), "--device", "cuda", "--out", str(out)]) == 2
    assert "no CUDA GPU on this machine" in _one_line(capsys)
    assert not out.exists()


def test_argparse_errors_are_one_line_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--config", _toml(tmp_path), "--seed", "x"])
    assert exc.value.code == 2
    assert "--seed" in _one_line(capsys)


def test_shapes_are_never_truncated():
    base = {"providers": ["sdpa_math"], "groups": [{"variants": ["causal"], "heads": [1], "head_dim": [8]}]}
    for shapes in ([[1, 32.5]], [[1, "32"]], [[True, 32]], [[1, 0]]):
        config = json.loads(json.dumps(base))
        config["groups"][0]["shapes"] = shapes
        with pytest.raises(Exception, match="shapes entry"):
            build_grid(config)


def test_every_setting_is_type_and_range_checked():
    from bench.grid import ConfigError, Settings

    good = build_grid({"providers": ["sdpa_math"], "groups": [
        {"variants": ["causal"], "shapes": [[1, 16]], "heads": [1], "head_dim": [8]}]})
    assert good.settings == Settings()
    for key, bad in (("rep_ms", 0), ("rep_ms", "1"), ("min_reps", 2.5), ("cpu_reps", 0), ("seed", -1),
                     ("max_minutes", float("nan")), ("block_size", 96), ("pin_host", 1),
                     ("compile_backend", "tvm"), ("mask_budget_gb", -1)):
        with pytest.raises(ConfigError, match=key):
            build_grid({"providers": ["sdpa_math"], "settings": {key: bad}, "groups": [
                {"variants": ["causal"], "shapes": [[1, 16]], "heads": [1], "head_dim": [8]}]})


def test_variant_parameters_are_checked_at_each_shape():
    from bench.mods import VariantError

    group = {"variants": ["sliding_window(window_size=S//0)"], "shapes": [[1, 16]], "heads": [1],
             "head_dim": [8]}
    with pytest.raises(VariantError, match="ZeroDivisionError"):
        build_grid({"providers": ["sdpa_math"], "groups": [group]})
    group["variants"] = ["sliding_window(window_size=-S)"]
    with pytest.raises(VariantError, match="window_size"):
        build_grid({"providers": ["sdpa_math"], "groups": [group]})
    group["variants"] = ["sliding_window(window=4)"]
    with pytest.raises(VariantError, match="unknown parameter 'window'"):
        build_grid({"providers": ["sdpa_math"], "groups": [group]})


# ---- resume checks the config ----------------------------------------------------------------

def test_resume_refuses_another_config_naming_the_differing_keys(tmp_path, capsys):
    out = tmp_path / "out"
    first = _config(tmp_path / "a.json")
    assert main(["run", "--config", str(first), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    before = (out / "rows.jsonl").read_text()
    other = _config(tmp_path / "b.json", shapes=([1, 24],), rep_ms=50)
    assert main(["run", "--config", str(other), "--out", str(out), "--resume", "--no-progress"]) == 2
    line = _one_line(capsys)
    assert "cases: 1 added" in line and "1 removed" in line and "settings.rep_ms: 100.0 -> 50.0" in line
    assert (out / "rows.jsonl").read_text() == before
    assert json.loads((out / "results.json").read_text())["cases_total"] == 1
    # The same config resumes (a new --max-minutes does not change what is measured).
    assert main(["run", "--config", str(first), "--out", str(out), "--resume", "--max-minutes", "5",
                 "--no-progress"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] and data["cases_done"] == data["cases_total"] == 1
    assert data["config"]["fingerprint"] == build_grid(load_config(first)).to_dict()["fingerprint"]


def test_results_count_only_the_configured_cases(tmp_path):
    """A stray record in rows.jsonl (another config's case, or a case twice) never counts."""
    grid = build_grid(load_config(_config(tmp_path / "a.json", shapes=([1, 16], [1, 24]))))
    out = tmp_path / "out"
    runner.run(grid, out, progress=False, log=lambda m: None)
    lines = (out / "rows.jsonl").read_text().splitlines()
    stray = json.loads(lines[0])
    stray["case_id"] = "other|B1|H1/1|Q8|KV8|D8/8|float32|fwd"
    for row in stray["rows"]:
        row["case_id"] = stray["case_id"]
    (out / "rows.jsonl").write_text("\n".join([lines[0], lines[0], json.dumps(stray), lines[1]]) + "\n")
    data = runner.load_results(out)
    assert data["cases_done"] == data["cases_total"] == 2 and data["complete"]
    assert data["cases_outside_config"] == [stray["case_id"]]
    assert {r["case_id"] for r in data["rows"]} == {c.case_id for c in grid.cases}
    keys = [(r["case_id"], r["provider"], r["metric"]) for r in data["rows"]]
    assert len(keys) == len(set(keys))


# ---- report --force ----------------------------------------------------------------------------

def test_report_force_with_a_bad_input_keeps_the_old_report(small_run, tmp_path, capsys):
    rep = tmp_path / "rep"
    assert main(["report", str(small_run), "--out", str(rep)]) == 0
    before = {p.relative_to(rep): p.read_bytes() for p in rep.rglob("*") if p.is_file()}
    bad = tmp_path / "bad" / "results.json"
    bad.parent.mkdir()
    text = small_run.read_text()
    bad.write_text(text[: len(text) // 2])  # truncated, as by a full disk
    capsys.readouterr()
    assert main(["report", str(bad), "--out", str(rep), "--force"]) == 2
    line = _one_line(capsys)
    assert str(bad) in line and "not valid JSON" in line
    after = {p.relative_to(rep): p.read_bytes() for p in rep.rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rep.")]  # no staging left


def test_report_rejects_rows_without_the_case_columns(small_run, tmp_path, capsys):
    data = json.loads(small_run.read_text())
    del data["rows"][3]["variant"]
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps(data))
    assert main(["report", str(bad), "--out", str(tmp_path / "rep")]) == 2
    assert "row 3 lacks column(s) ['variant']" in _one_line(capsys)
    assert not (tmp_path / "rep").exists()


def test_report_force_replaces_a_report_but_never_a_run_folder(small_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(small_run.parent, run_dir)
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["report", str(small_run), "--out", str(run_dir), "--force"]) == 2
    assert "not a report's" in _one_line(capsys)
    assert sorted(p.name for p in run_dir.iterdir()) == before
    rep = tmp_path / "rep"
    assert main(["report", str(small_run), "--out", str(rep)]) == 0
    (rep / "summary.md").write_text("stale")
    assert main(["report", str(small_run), "--out", str(rep), "--force"]) == 0
    assert (rep / "summary.md").read_text().startswith("# flexlab benchmark")


# ---- the exit code ------------------------------------------------------------------------------

def test_exit_code_is_1_when_no_provider_measured_anything(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def make():\n    raise ValueError('no such table')\n")
    out = tmp_path / "out"
    assert main(["run", "--config", str(_config(tmp_path / "g.json", variants=(str(broken),))),
                 "--out", str(out), "--no-progress", "--keep-going"]) == 1
    err = capsys.readouterr().err
    assert "0 measured" in err and "1 errors" in err
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows and all(r["status"] == "error" and "no such table" in r["note"] for r in rows)


def test_exit_code_is_1_on_a_failed_check_unless_keep_going(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(prov.PROVIDERS, "wrong_out", PerturbedProvider("wrong_out", out_scale=1.01))
    config = _config(tmp_path / "g.json", variants=(f"{ALIBI}+{CAUSAL}",), heads=([2, 1],),
                     providers=("sdpa_math", "wrong_out"))
    assert main(["run", "--config", str(config), "--out", str(tmp_path / "a"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "1 correctness checks failed" in err and "wrong_out out_correct" in err
    assert main(["run", "--config", str(config), "--out", str(tmp_path / "b"), "--no-progress",
                 "--keep-going"]) == 0
    assert "--keep-going" in capsys.readouterr().err
    # The same run with correct providers only exits 0.
    good = _config(tmp_path / "h.json", variants=(f"{ALIBI}+{CAUSAL}",), heads=([2, 1],))
    assert main(["run", "--config", str(good), "--out", str(tmp_path / "c"), "--no-progress"]) == 0


# ---- a run of several processes and a plain run never share a folder ---------------------------

_FLAGS = ["run", "--variants", CAUSAL, "--batch", "1", "--seq", "16", "--heads", "1", "--head-dim", "8",
          "--dtype", "fp32", "--passes", "fwd", "--providers", "sdpa_math", "--device", "cpu",
          "--no-progress"]


def test_resume_with_another_process_count_is_refused_both_ways(tmp_path, capsys):
    # A run of two processes, stopped in its second: resuming it as a plain run is refused
    # before anything is written (it used to add plain rows and drop `processes` from config.json).
    spread_dir = tmp_path / "spread"
    plain = tmp_path / "plain"
    assert main(_FLAGS + ["--out", str(plain)]) == 0
    spread_dir.mkdir()
    config = {**json.loads((plain / "config.json").read_text()), "processes": 2}
    (spread_dir / "config.json").write_text(json.dumps(config))
    (spread_dir / "processes" / "1").mkdir(parents=True)
    shutil.copy(plain / "rows.jsonl", spread_dir / "processes" / "1" / "rows.jsonl")
    def files():  # the lock file aside: every run, refused or not, takes the lock first
        return {str(p.relative_to(spread_dir)): p.read_bytes() for p in spread_dir.rglob("*")
                if p.is_file() and p.name != "run.lock"}

    before = files()
    capsys.readouterr()
    assert main(_FLAGS + ["--out", str(spread_dir), "--resume"]) == 2
    line = _one_line(capsys)
    assert "holds a run of 2 processes" in line and "resume it with --processes 2" in line
    assert files() == before
    # Nor is a plain run's folder (without --resume too) a spread run's, nor one of another count.
    assert main(_FLAGS + ["--out", str(spread_dir)]) == 2
    assert "holds a previous run" in _one_line(capsys)
    assert main(_FLAGS + ["--out", str(plain), "--resume", "--processes", "2"]) == 2
    line = _one_line(capsys)
    assert "--resume --processes 2" in line and "resume it without --processes" in line
    assert main(_FLAGS + ["--out", str(spread_dir), "--resume", "--processes", "3"]) == 2
    assert "resume it with --processes 2" in _one_line(capsys)
    # --force starts over: the process folders go with the rest.
    assert main(_FLAGS + ["--out", str(spread_dir), "--force"]) == 0
    assert not (spread_dir / "processes").exists()
    assert "processes" not in json.loads((spread_dir / "config.json").read_text())


# ---- result files ------------------------------------------------------------------------------

def test_a_truncated_results_csv_is_an_error_naming_the_line(small_run, tmp_path, capsys):
    text = (small_run.parent / "results.csv").read_text()
    cut = tmp_path / "cut" / "results.csv"
    cut.parent.mkdir()
    cut.write_text(text[:3000])  # `head -c 3000`: the last row ends mid-way
    line_no = text[:3000].count("\n") + 1
    assert main(["summary", str(cut)]) == 2
    line = _one_line(capsys)
    assert f"{cut} line {line_no}:" in line and "cut short" in line
    assert main(["report", str(cut), "--out", str(tmp_path / "rep")]) == 2
    assert f"line {line_no}" in _one_line(capsys)
    # A row with a field too many is malformed too.
    lines = text.splitlines()
    cut.write_text("\n".join(lines[:3] + [lines[3] + ",extra"] + lines[4:]) + "\n")
    assert main(["summary", str(cut)]) == 2
    assert f"{cut} line 4:" in _one_line(capsys)
    cut.write_text(text)
    assert main(["summary", str(cut)]) == 0


def test_env_json_runs_must_be_environments(small_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(small_run.parent, run_dir)
    (run_dir / "env.json").write_text(json.dumps({"runs": [1, 2]}))
    assert main(["summary", str(run_dir)]) == 2
    line = _one_line(capsys)
    assert str(run_dir / "env.json") in line and "runs[0] is int" in line
    data = json.loads(small_run.read_text())
    data["envs"] = ["h100"]
    (tmp_path / "results.json").write_text(json.dumps(data))
    assert main(["summary", str(tmp_path / "results.json")]) == 2
    assert "envs[0] is str" in _one_line(capsys)


# ---- flags -------------------------------------------------------------------------------------

def _never(*args, **kwargs):
    raise AssertionError("an empty flag must be refused before anything runs")


@pytest.mark.parametrize("flag", ["--variants", "--providers", "--passes", "--dtype"])
def test_an_empty_list_flag_is_an_error_not_the_whole_grid(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run", _never)  # it used to run the whole preset
    out = tmp_path / "out"
    assert main(["run", "--config", "tiny", flag, "", "--out", str(out), "--no-progress"]) == 2
    assert f"{flag} is empty" in _one_line(capsys)
    assert not out.exists()
    if flag != "--variants":  # " , " as variants is two empty specs, refused as such
        assert main(["run", "--config", "tiny", flag, " , ", "--out", str(out), "--no-progress"]) == 2
        assert f"{flag} is empty" in _one_line(capsys)
    with pytest.raises(Exception, match=f"{flag} is empty"):
        build_grid(load_config("tiny"), **{{"--dtype": "dtypes"}.get(flag, flag[2:]): []})


def test_empty_first_call_flags_are_errors(capsys, monkeypatch):
    from bench import first_call

    monkeypatch.setattr(first_call, "measure", _never)  # it used to time the anchors variants
    for flag in ("--variants", "--providers"):
        assert main(["first-call", flag, "", "--device", "cpu"]) == 2
        assert f"{flag} is empty" in _one_line(capsys)


# ---- Ctrl-C ------------------------------------------------------------------------------------

def test_ctrl_c_exits_130_saying_where_the_finished_cases_are(tmp_path, capsys, monkeypatch):
    config = _config(tmp_path / "g.json", shapes=([1, 16], [1, 24], [1, 32]))
    out = tmp_path / "out"
    calls = []
    real = runner.CaseRunner.run

    def interrupted_second(self):
        calls.append(self.case.case_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(runner.CaseRunner, "run", interrupted_second)
    try:
        code = main(["run", "--config", str(config), "--out", str(out), "--no-progress"])
    except KeyboardInterrupt:  # raised on, it would stop the test session
        pytest.fail("Ctrl-C escaped main() as a KeyboardInterrupt (a traceback on the command line)")
    assert code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: ") and str(out / "rows.jsonl") in last and "--resume" in last
    assert len(runner.read_jsonl(out / "rows.jsonl")) == 1
    assert json.loads((out / "results.json").read_text())["cases_done"] == 1
    monkeypatch.setattr(runner.CaseRunner, "run", real)
    assert main(["run", "--config", str(config), "--out", str(out), "--no-progress", "--resume"]) == 0
    assert json.loads((out / "results.json").read_text())["complete"]
