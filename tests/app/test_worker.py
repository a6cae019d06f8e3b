"""The worker process that runs the user's code and every kernel: crashes, kills, prints and
endless loops stay in it; it restarts and serves the next request; the code's random tensors are
the same in every action; on a GPU machine a device-side assert restarts only the worker."""
from __future__ import annotations


import pytest
import torch

from app.client import RemoteError, Worker, WorkerFailed, describe_exit

SHAPE = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 64, "KV_LEN": 64, "D": 16, "dtype": "float32",
         "BLOCK_SIZE": 16}
CAUSAL = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker") / "worker.log")
    w.start()
    yield w
    w.stop()


def prepare(worker, code, shape=SHAPE, timeout=60):
    return worker.call("prepare", {"code": code, "shape": shape, "seed": 0}, timeout)


@pytest.mark.parametrize("code, words, signal_name", [
    ("import os\nos.kill(os.getpid(), 9)\n", "was killed (SIGKILL)", "SIGKILL"),
    ("import ctypes\nctypes.string_at(0)\n", "segmentation fault", "SIGSEGV"),
])
def test_a_dead_worker_is_reported_restarted_and_serves_the_next_request(worker, code, words,
                                                                         signal_name):
    pid = worker.proc.pid
    with pytest.raises(WorkerFailed) as info:
        prepare(worker, code)
    assert words in info.value.message and "restarted" in info.value.message
    if signal_name == "SIGSEGV":  # faulthandler's report names the user's line
        tail = info.value.log_tail
        assert "Segmentation fault" in tail and '"<playground>", line 2' in tail
    assert worker.alive() and worker.proc.pid != pid
    assert worker.last_failure and words.split(" (")[0] in worker.last_failure
    result = prepare(worker, CAUSAL)
    assert result["ok"] and "q_idx >= kv_idx" in result["mask_source"]


def test_user_prints_do_not_break_the_protocol(worker):
    code = ("print('hello')\nimport sys\nsys.stdout.write('x' * 100000)\n\n"
            "def mask_mod(b, h, q_idx, kv_idx):\n    print(q_idx)\n    return q_idx >= kv_idx\n")
    assert prepare(worker, code)["ok"]


def test_endless_loop_is_stopped_with_its_line_and_the_worker_lives_on(worker):
    pid = worker.proc.pid
    with pytest.raises(RemoteError) as info:
        prepare(worker, "import torch\n\nn = 0\nwhile True:\n    n += 1\n")
    problem = info.value.problem
    assert problem["kind"] == "timeout" and problem["lineno"] in (4, 5)
    assert worker.proc.pid == pid  # stopped by the time limit, not by a restart
    assert prepare(worker, CAUSAL)["ok"]


def test_a_worker_that_overruns_its_deadline_is_stopped_and_restarted(worker):
    pid = worker.proc.pid
    # time.sleep in C with signals blocked: the code's own time limit cannot interrupt it.
    code = ("import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
            "time.sleep(60)\n")
    with pytest.raises(WorkerFailed, match="did not finish prepare within 3 s"):
        prepare(worker, code, timeout=3)
    assert worker.proc.pid != pid
    assert prepare(worker, CAUSAL)["ok"]


def test_an_unseeded_randn_is_the_same_tensor_in_every_action(worker):
    code = ("import torch\nbias = torch.randn(H, requires_grad=True)\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + bias[h]\n")
    first = worker.call("score_view", {"code": code, "shape": SHAPE, "seed": 3, "b": 0, "h": 1,
                                       "zero_scores": True}, 60)
    again = worker.call("score_view", {"code": code, "shape": SHAPE, "seed": 3, "b": 0, "h": 1,
                                       "zero_scores": True}, 60)
    other = worker.call("score_view", {"code": code, "shape": SHAPE, "seed": 4, "b": 0, "h": 1,
                                       "zero_scores": True}, 60)
    expected = float(torch.randn(2, generator=torch.Generator().manual_seed(3))[1])
    assert first["min"] == first["max"] == again["min"] == pytest.approx(expected, abs=1e-6)
    assert other["min"] != first["min"]


def test_a_benchmark_in_the_worker_runs_the_code_once_and_reports_progress(worker, tmp_path):
    # The code counts its own runs in a file (the worker is another process): Visualise's check
    # and the benchmark after it share one run; bench's progress reaches the end.
    log = tmp_path / "runs.txt"
    code = f"open({str(log)!r}, 'a').write('run\\n')\n" + CAUSAL
    shape = {**SHAPE, "Q_LEN": 32, "KV_LEN": 32}
    assert prepare(worker, code, shape)["ok"]
    fractions = []
    result = worker.call("benchmark", {"code": code, "shape": shape, "seed": 0, "title": "count",
                                       "passes": ["fwd"], "out_dir": str(tmp_path / "bench")},
                         300, lambda fraction, text: fractions.append(fraction))
    assert log.read_text().splitlines() == ["run"]
    assert fractions and fractions == sorted(fractions) and fractions[-1] == 1.0
    sdpa = {r["metric"]: r["value"] for r in result["rows"] if r["provider"] == "sdpa_math"}
    assert sdpa["out_correct"] == 1 and sdpa["time_ms"] > 0


def test_exit_statuses_are_described_in_words():
    assert "SIGKILL" in describe_exit(-9) and "segmentation fault" in describe_exit(-11)
    assert describe_exit(3) == "exited with status 3"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_device_side_assert_restarts_only_the_worker(worker):
    code = ("import torch\nidx = torch.tensor([5], device='cuda')\n"
            "bias = torch.zeros(2, device='cuda')\nx = bias[idx].sum().item()\n\n"
            "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n")
    pid = worker.proc.pid
    with pytest.raises((RemoteError, WorkerFailed)):
        prepare(worker, code)
    assert worker.proc.pid != pid  # the poisoned CUDA context went with the old process
    assert prepare(worker, CAUSAL)["ok"]
