"""The checker process that runs the user's code first: crashes, prints and endless loops stay
in it; on a GPU machine its workers use CUDA, and a device-side assert kills only the worker."""
from __future__ import annotations

import pytest

from app import sandbox

SHAPE = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 64, "KV_LEN": 64, "D": 16, "device": "cpu"}
CAUSAL = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"


@pytest.fixture(scope="module", autouse=True)
def _stop_checker():
    yield
    sandbox.shutdown()


def test_checker_survives_a_crash_in_native_code():
    code = "import ctypes\nctypes.string_at(0)\n"
    result = sandbox.check_code(code, SHAPE, timeout_s=10)
    assert not result["ok"] and "crash" in result["problem"]["message"]
    # The next request is served normally.
    ok = sandbox.check_code(CAUSAL, SHAPE, timeout_s=10)
    assert ok["ok"] and "q_idx >= kv_idx" in ok["mask_source"]


def test_user_prints_do_not_break_the_checker():
    code = ("print('hello')\n\ndef mask_mod(b, h, q_idx, kv_idx):\n    print(q_idx)\n"
            "    return q_idx >= kv_idx\n")
    result = sandbox.check_code(code, SHAPE, timeout_s=10)
    assert result["ok"], result


def test_endless_loop_at_top_level_is_stopped_with_its_line():
    code = "import torch\n\nn = 0\nwhile True:\n    n += 1\n"
    result = sandbox.check_code(code, SHAPE, timeout_s=2)
    problem = result["problem"]
    assert problem["kind"] == "timeout" and problem["lineno"] in (4, 5)




@pytest.mark.gpu
def test_workers_use_the_gpu_and_a_device_assert_kills_only_the_worker():
    import torch

    assert torch.cuda.is_available()
    shape = {**SHAPE, "device": "cuda"}
    code = ("import torch\nbias = torch.randn(H, device='cuda')\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + bias[h]\n")
    result = sandbox.check_code(code, shape, timeout_s=30)
    assert result["ok"], result
    # bias has one entry but H = 2 heads read it: out of range on the GPU.
    bad = code.replace("torch.randn(H,", "torch.randn(1,")
    result = sandbox.check_code(bad, shape, timeout_s=30)
    assert not result["ok"]
    assert sandbox.check_code(CAUSAL, shape, timeout_s=30)["ok"]
