"""The worker's timing tasks hand the Playground's mods to bench in memory: the code runs once per
(code, shape, seed) whatever the actions, bench's rows carry the experiment's label and the
learnable tensor's own name, progress reaches the end, and nothing is generated as a file."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

from app import tasks
from app.tasks import mods as task_mods
from app.tasks import timing
from bench.providers import PROVIDERS

SHAPE = {"B": 1, "Hq": 2, "Hkv": 1, "Q_LEN": 32, "KV_LEN": 32, "D": 16, "dtype": "float32",
         "BLOCK_SIZE": 16}


def counting_code(path: Path) -> str:
    """Code with a learnable captured tensor that appends a line to ``path`` each time it runs."""
    return (f"open({str(path)!r}, 'a').write('run\\n')\n"
            "import torch\n\n"
            "bias = torch.linspace(-1.0, 1.0, H).requires_grad_()\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n"
            "    return score + bias[h] * (q_idx - kv_idx) / Q_LEN\n\n\n"
            "def mask_mod(b, h, q_idx, kv_idx):\n"
            "    return q_idx >= kv_idx\n")


def runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def sdpa_only(monkeypatch):
    """A fresh cache of the code's runs, and SDPA math as the only provider (quick on the CPU)."""
    monkeypatch.setattr(task_mods, "_CACHE", collections.OrderedDict())
    monkeypatch.setattr(timing, "PROVIDERS", {"sdpa_math": PROVIDERS["sdpa_math"]})


def test_the_code_runs_once_per_shape_across_actions(tmp_path, sdpa_only):
    log = tmp_path / "runs.txt"
    code = counting_code(log)
    fractions = []

    def progress(fraction, text):
        fractions.append(fraction)

    def act(task, **kwargs):
        return tasks.run(task, {"code": code, "shape": SHAPE, "seed": 0, **kwargs}, progress)

    bench = act("benchmark", title="my | experiment", passes=["fwd", "fwd_bwd"],
                out_dir=str(tmp_path / "bench"))
    assert runs(log) == 1
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    rows = bench["rows"]
    assert {r["variant"] for r in rows} == {"my_experiment"}  # '|' would split bench's case ids
    verdicts = {(r["pass"], r["metric"]): r for r in rows if r["provider"] == "sdpa_math"}
    assert verdicts[("fwd", "out_correct")]["value"] == 1
    assert verdicts[("fwd_bwd", "dbias_correct")]["value"] == 1  # the code's own tensor name
    # Later actions on the same (code, shape, seed) share that run; a new length or seed runs
    # the code once more, and only once.
    act("prepare")
    act("benchmark", title="again", passes=["fwd"], out_dir=str(tmp_path / "again"))
    assert runs(log) == 1
    fractions.clear()
    sweep = act("sweep", title="sweep", lengths=[32, 48, 48], pass_="fwd",
                providers=["sdpa_math"], out_dir=str(tmp_path / "sweep"))
    assert runs(log) == 2
    assert sorted({r["kv_len"] for r in sweep["rows"]}) == [32, 48]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    tasks.run("benchmark", {"code": code, "shape": SHAPE, "seed": 1, "title": "seed 1",
                            "passes": ["fwd"], "out_dir": str(tmp_path / "seed1")}, progress)
    assert runs(log) == 3
    # bench got the mods in memory: no variant file was written anywhere.
    assert not list(tmp_path.rglob("*.py"))
    assert (tmp_path / "bench" / "results.json").exists()


def test_the_sweep_reports_the_code_problem_at_a_new_length_before_timing(tmp_path, sdpa_only):
    # The code indexes a tensor sized for 32 positions: fine at 32, out of range at 48. The
    # problem surfaces as the user's, with its line, not as a bench row.
    code = ("import torch\nbias = torch.zeros(32)\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n"
            "    return score + bias[q_idx]\n\n\n"
            "x = bias[Q_LEN - 1]\n")
    with pytest.raises(Exception) as info:
        tasks.run("sweep", {"code": code, "shape": SHAPE, "seed": 0, "title": "t",
                            "lengths": [32, 48], "pass_": "fwd", "providers": ["sdpa_math"],
                            "out_dir": str(tmp_path / "s")}, lambda f, t: None)
    problem = tasks.problem_of(info.value, code, "in sweep")
    assert problem.lineno == 9 and "index" in problem.message.lower()
    assert not (tmp_path / "s").exists()
