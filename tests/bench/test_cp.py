"""bench.cp's cp-tiny config and the bench.cp_train example, each as 2 gloo processes under torchrun."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cp
from bench.runner import load_results

ROOT = Path(__file__).resolve().parents[2]
# PYTHONFAULTHANDLER: a rank that aborts prints where (its Python stack, or none: in teardown).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: A progress line of a finished measurement: "[i/N] <variant> S=<S> <provider> world=<W>: <ms> ms, ..."
DONE = re.compile(r"^\[(\d+)/(\d+)\] (\S+) S=(\d+) (\S+) world=(\d+): ([0-9.e+-]+) ms, ", re.M)


def _torchrun(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _rows_of(rows, variant, seq, provider):
    return {r["metric"]: r for r in rows if (r["variant"], int(r["q_len"]), r["provider"]) == (variant, seq, provider)}


def test_cp_tiny_writes_checked_scaling_rows(tmp_path):
    proc = _torchrun("-m", "bench.cp", "--config", "cp-tiny", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = load_results(tmp_path / "results.csv")["rows"]
    assert cp.is_cp_results(rows)
    correct = [r for r in rows if r["metric"] == "out_correct"]
    # Every variant and strategy was checked against float64, and passed.
    assert {(r["variant"], r["provider"]) for r in correct} == {
        (v, f"flexlab_cp_{s}") for v in cp.VARIANTS for s in ("allgather", "ring")}
    assert all(r["value"] == 1.0 and r["status"] == "ok" for r in correct)
    table = cp.scaling_table(rows)
    two = [e for e in table if e["gpus"] == 2 and e["provider"].startswith("flexlab_cp")]
    one = [e for e in table if e["gpus"] == 1]
    assert len(two) == 6 and len(one) == 6  # one device at S/2 (weak scaling) and at S
    for e in two:
        assert e["tflops"] > 0 and e["scaling_eff"] > 0 and 0 <= e["comm_hidden_ms"] <= e["comm_ms"]
        # The efficiency compares with one device at S/2, measured before it.
        base = next(o for o in one if (o["variant"], o["seq"]) == (e["variant"], 64))
        assert e["scaling_eff"] == pytest.approx(e["tflops"] / base["tflops"], rel=1e-9)
    # Both ranks measured the single-device rows, each on its own device.
    for r in rows:
        if r["provider"] == "flexlab" and r["metric"] == "time_ms":
            assert r["note"].startswith("median ms of each rank's device: ") and r["note"].count(",") == 1
            assert _rows_of(rows, r["variant"], int(r["q_len"]), "flexlab")["reps"]["value"] == 2
    torch_rows = [r for r in rows if r["provider"] == "torch_cp"]
    assert torch_rows and all(r["status"] == "skipped" and "CUDA" in r["note"] for r in torch_rows)
    assert json.loads((tmp_path / "results.json").read_text())["complete"] is True


def test_progress_lines_come_as_each_measurement_ends_with_its_rows_already_written(tmp_path):
    """Stopped right after its first progress line, a run has already written that measurement."""
    args = [*TORCHRUN, "-m", "bench.cp", "--config", "cp-tiny", "--variants", "causal", "--out", str(tmp_path)]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=err, text=True)
        seen, match = [], None
        try:
            for line in proc.stdout:
                seen.append(line)
                match = DONE.match(line)
                if match:
                    break
            rows = load_results(tmp_path / "results.csv")["rows"] if match else []
            complete = json.loads((tmp_path / "results.json").read_text())["complete"] if match else None
        finally:
            proc.terminate()  # torchrun stops its workers
            proc.wait(timeout=120)
    assert match, "".join(seen) + (tmp_path / "stderr.txt").read_text()[-3000:]
    # The plan: one device at S/2, the two strategies, torch_cp (skipped on the CPU), one device at S.
    assert match.group(1, 2, 3, 4, 5, 6) == ("1", "5", "causal", "64", "flexlab", "1"), "".join(seen)
    assert any(line.startswith("[1/5] causal S=64 flexlab world=1: started") for line in seen), seen
    first = _rows_of(rows, "causal", 64, "flexlab")
    assert first["time_ms"]["status"] == "ok"
    assert float(first["time_ms"]["value"]) == pytest.approx(float(match.group(7)), rel=1e-3)
    assert complete is False


def test_max_minutes_stops_every_rank_between_measurements(tmp_path):
    proc = _torchrun("-m", "bench.cp", "--config", "cp-tiny", "--variants", "causal,sliding_window",
                     "--providers", "flexlab_cp_ring", "--max-minutes", "0", "--out", str(tmp_path))
    # Both ranks left cleanly (torchrun reports a rank's failure in its exit status).
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = DONE.findall(proc.stdout)
    assert [d[:6] for d in done] == [("1", "2", "causal", "128", "flexlab_cp_ring", "2")], proc.stdout
    assert "stopped: not measured: --max-minutes 0 reached" in proc.stdout
    rows = load_results(tmp_path / "results.csv")["rows"]
    assert {r["provider"] for r in rows} == {"flexlab_cp_ring"}  # --providers chose it alone
    assert _rows_of(rows, "causal", 128, "flexlab_cp_ring")["time_ms"]["status"] == "ok"
    skipped = _rows_of(rows, "sliding_window", 128, "flexlab_cp_ring")
    assert set(skipped) == {"status"} and skipped["status"]["status"] == "skipped"
    assert "--max-minutes 0" in skipped["status"]["note"]
    assert json.loads((tmp_path / "results.json").read_text())["complete"] is False


def test_plan_measures_the_reference_first_and_each_length_once():
    cfg = dataclasses.replace(cp.CONFIGS["cp-tiny"], seqs=(128, 256), variants=("causal",),
                              providers=("torch_cp", "flexlab", "flexlab_cp_ring"))
    assert [t.label() for t in cp.plan(cfg, 2)] == [
        "causal S=64 flexlab world=1", "causal S=128 torch_cp world=2", "causal S=128 flexlab_cp_ring world=2",
        "causal S=128 flexlab world=1",  # S=128 is also S/2 of S=256: measured once
        "causal S=256 torch_cp world=2", "causal S=256 flexlab_cp_ring world=2", "causal S=256 flexlab world=1"]
    no_single = dataclasses.replace(cfg, providers=("flexlab_cp_allgather",))
    assert [t.label() for t in cp.plan(no_single, 4)] == [
        "causal S=128 flexlab_cp_allgather world=4", "causal S=256 flexlab_cp_allgather world=4"]


@pytest.mark.parametrize("option, value", [("--providers", "flexlab,nccl"), ("--variants", "causal,full"),
                                           ("--timeout-s", "0")])
def test_bad_options_are_refused_naming_the_option(option, value, capsys):
    with pytest.raises(SystemExit) as exc:
        cp.main(["--config", "cp-tiny", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert option in err and value.split(",")[-1] in err
    if option == "--providers":
        assert all(p in err for p in cp.PROVIDERS)


def test_cp_train_runs_two_gloo_processes():
    proc = _torchrun("-m", "bench.cp_train", "--steps", "3", "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", proc.stdout, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), proc.stdout
    assert losses[-1] < losses[0], f"the loss should fall on a repeated batch: {losses}"
    cp_loss, single = map(float, re.search(r"context-parallel loss (\S+), one process (\S+),",
                                           proc.stdout).groups())
    assert abs(cp_loss - single) <= 1e-4 * abs(single), proc.stdout


def test_summary_of_a_cp_run_is_its_scaling_table(tmp_path):
    from bench.report import summary_markdown

    rows = cp._Rows(cp.CONFIGS["cp"], "run")
    for provider, world, ms, extra in (("flexlab", 1, 100.0, ()), ("flexlab_cp_ring", 2, 60.0,
                                       (("comm_ms", 4.0), ("compute_ms", 58.0), ("comm_hidden_ms", 2.0),
                                        ("scaling_eff", 0.83), ("speedup_vs_torch_cp", 1.25))),
                                       ("torch_cp", 2, 75.0, ())):
        rows.add("causal", 65536, world, provider, "time_ms", ms, "ms")
        rows.add("causal", 65536, world, provider, "world_size", world, "count")
        for metric, value in extra:
            rows.add("causal", 65536, world, provider, metric, value, "ms")
    rows.add("sliding_window", 65536, 2, "torch_cp", "status", None, "", status="skipped",
             note="needs CUDA")
    cp._write_results(tmp_path, "cp", rows.rows, {}, True)
    text = summary_markdown(tmp_path)
    lines = text.splitlines()
    assert lines[0].startswith("| mask | S | provider | GPUs | ms | TFLOP/s per GPU | efficiency | ÷ torch CP")
    ring = next(line for line in lines if "flexlab_cp_ring" in line)
    assert [c.strip() for c in ring.strip("|").split("|")] == [
        "causal", "65536", "flexlab_cp_ring", "2", "60", "", "0.83", "1.25×", "58", "2.0 of 4.0"]
    assert "- sliding_window S=65536 torch_cp: skipped, needs CUDA" in lines
