"""One writer per output folder, and runs that survive SIGKILL: real processes against one folder.

The runs use ``mods/held.py``, whose factory waits for a gate file (or sleeps), so a test knows a
run is inside a case, holding the folder, when it starts the second process or sends the kill.
"""
from __future__ import annotations

import csv
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import runner
from bench.grid import build_grid, load_config
from tests.bench.helpers import MODS

ROOT = Path(__file__).resolve().parents[2]
HELD = str(MODS / "held.py")


def _config(path: Path, shapes=([1, 16],), passes=("fwd",)) -> Path:
    """A JSON config of SDPA-math cases on the held mod (each case a fraction of a second)."""
    path.write_text(json.dumps({
        "providers": ["sdpa_math"], "settings": {"cpu_reps": 1},
        "groups": [{"variants": [HELD], "shapes": [list(s) for s in shapes], "heads": [1],
                    "head_dim": [8], "dtype": ["float32"], "passes": list(passes)}]}))
    return path


def _bench(*args) -> list[str]:
    return [sys.executable, "-m", "bench", "run", *map(str, args), "--no-progress"]


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("FLEXLAB_TEST_GATE", "FLEXLAB_TEST_SLEEP"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _wait_for_holder(out: Path, proc: subprocess.Popen, timeout: float = 60) -> dict:
    """The lock file's holder once it is ``proc`` (which is then inside the run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            info = json.loads((out / "run.lock").read_text())
            if info.get("pid") == proc.pid:
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"{proc.pid} never took the lock of {out}")


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_a_second_run_or_resume_on_a_busy_folder_is_refused_naming_the_holder(tmp_path):
    config = _config(tmp_path / "grid.json", shapes=([1, 16], [1, 24]))
    out, gate = tmp_path / "out", tmp_path / "gate"
    first = subprocess.Popen(_bench("--config", config, "--out", out), cwd=ROOT, text=True,
                             env=_env(FLEXLAB_TEST_GATE=gate), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        holder = _wait_for_holder(out, first)
        assert holder["host"] == socket.gethostname() and holder["started_utc"].endswith("Z")
        second = subprocess.run(_bench("--config", config, "--out", out), cwd=ROOT, env=_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        line = _one_error_line(second.stderr)
        assert f"pid {first.pid} on host {holder['host']}" in line and holder["started_utc"] in line
        # --resume and --force are refused the same way, before they touch the folder.
        grid = build_grid(load_config(config), "grid")
        for kwargs in ({"resume": True}, {"force": True}):
            with pytest.raises(runner.RunDirBusy, match=f"pid {first.pid}"):
                runner.run(grid, out, progress=False, log=lambda m: None, **kwargs)
        # The refused writers changed nothing: the lock still names the first run, its files stay.
        assert json.loads((out / "run.lock").read_text())["pid"] == first.pid
        assert (out / "config.json").exists() and (out / "rows.jsonl").exists()
    finally:
        gate.touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    data = json.loads((out / "results.json").read_text())
    case_ids = [e["case_id"] for e in runner.read_jsonl(out / "rows.jsonl")]
    assert data["complete"] and data["cases_done"] == data["cases_total"] == 2
    assert len(case_ids) == len(set(case_ids)) == 2 and len(data["envs"]) == 1


def test_two_resumes_at_once_lose_no_rows(tmp_path):
    config = _config(tmp_path / "grid.json", shapes=([1, 16], [1, 24], [1, 32]))
    out, gate = tmp_path / "out", tmp_path / "gate"
    grid = build_grid(load_config(config), "grid")
    runner.run(grid, out, progress=False, log=lambda m: None)
    lines = (out / "rows.jsonl").read_text().splitlines()
    (out / "rows.jsonl").write_text(lines[0] + "\n")  # an unfinished run: one case of three
    kept = runner.read_jsonl(out / "rows.jsonl")
    assert len(kept) == 1
    first = subprocess.Popen(_bench("--config", config, "--out", out, "--resume"), cwd=ROOT, text=True,
                             env=_env(FLEXLAB_TEST_GATE=gate), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        _wait_for_holder(out, first)
        second = subprocess.run(_bench("--config", config, "--out", out, "--resume"), cwd=ROOT,
                                env=_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"pid {first.pid}" in _one_error_line(second.stderr)
    finally:
        gate.touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    entries = runner.read_jsonl(out / "rows.jsonl")
    assert [e["case_id"] for e in entries][:1] == [kept[0]["case_id"]] and entries[0] == kept[0]
    assert sorted(e["case_id"] for e in entries) == sorted(c.case_id for c in grid.cases)
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] and data["cases_done"] == 3 and len(data["envs"]) == 2


def _check_parses(out: Path, seed: int) -> list[dict]:
    """What a killed run leaves must parse: rows.jsonl's finished cases (each once), results.json
    and results.csv where they exist."""
    entries = runner.read_jsonl(out / "rows.jsonl")
    ids = [e["case_id"] for e in entries]
    assert len(ids) == len(set(ids)), (seed, ids)
    if (out / "results.json").exists():
        data = json.loads((out / "results.json").read_text())
        assert data["cases_done"] <= data["cases_total"], seed
    if (out / "results.csv").exists():
        with open(out / "results.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert not rows or list(rows[0]) == runner.COLUMNS, seed
    return entries


def test_sigkill_at_random_points_then_resume_loses_and_duplicates_nothing(tmp_path):
    seed = int(os.environ.get("FLEXLAB_FAULT_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    shapes = ([1, 16], [1, 24], [1, 32])
    config = _config(tmp_path / "grid.json", shapes=shapes, passes=("fwd", "fwd_bwd"))
    out = tmp_path / "out"
    finished: dict[str, dict] = {}
    for attempt in range(3):
        proc = subprocess.Popen(_bench("--config", config, "--out", out, "--resume"), cwd=ROOT,
                                env=_env(FLEXLAB_TEST_SLEEP=0.1), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_holder(out, proc)
            # Anywhere from the run's checks through its cases, appends and final writes (the
            # six cases take about a second; a run that ends first is fine).
            time.sleep(rng.uniform(0.0, 1.8))
        except AssertionError:
            pass  # it already finished (nothing left to kill)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        entries = _check_parses(out, seed)
        for e in entries:  # a finished case is never rewritten or lost
            assert finished.setdefault(e["case_id"], e) == e, (seed, attempt, e["case_id"])
        assert set(finished) <= {e["case_id"] for e in entries}, (seed, attempt)
    last = subprocess.run(_bench("--config", config, "--out", out, "--resume"), cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert last.returncode == 0, (seed, last.stderr[-3000:])
    entries = _check_parses(out, seed)
    for e in entries:
        assert finished.setdefault(e["case_id"], e) == e, seed
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] and data["cases_done"] == data["cases_total"] == 6, seed
    keys = [(r["case_id"], r["provider"], r["metric"]) for r in data["rows"]]
    assert len(keys) == len(set(keys)), seed
    assert {r["case_id"] for r in data["rows"]} == set(finished), seed
    with open(out / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(data["rows"]), seed
    assert not list(out.glob("*.tmp")), seed
