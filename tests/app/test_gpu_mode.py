"""The workbench in GPU mode (run with -m gpu on the device): the Playground's flows at GPU shapes,
the providers of a GPU machine, and the Environment page naming the GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from tests.app.helpers import (CAUSAL, ENTRY, LEARNABLE, UNSEEDED, click, no_exception,  # noqa: E402
                                  open_tab, playground, problem_text, table, texts)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A shape the interpreter could not run in minutes: GPU mode must take it.
GPU_SHAPE = {"B": 2, "Hq": 8, "Hkv": 2, "Q_LEN": 2048, "KV_LEN": 2048, "D": 64, "dtype": "bfloat16",
             "BLOCK_SIZE": 128}


def test_playground_is_in_gpu_mode_at_gpu_shapes():
    at = playground(CAUSAL, GPU_SHAPE)
    no_exception(at)
    assert not at.error, problem_text(at)
    assert not any("CPU mode" in t for t in texts(at, "info") + texts(at, "warning"))
    L = GPU_SHAPE["Q_LEN"]
    assert f"Kept {L * (L + 1) // 2:,} of {L * L:,} positions" in " ".join(texts(at, "caption"))
    open_tab(at, "Scores")
    assert len(at.get("plotly_chart")) == 3 and not at.error, problem_text(at)


def test_check_passes_for_every_dtype_on_the_gpu():
    at = click(playground(LEARNABLE, GPU_SHAPE), "pg_check_btn")
    assert not at.error, problem_text(at)
    assert list(table(at, "max |err|")["result"]) == ["pass", "pass", "pass"]


def test_gradients_on_the_gpu_compare_with_float64_and_torch_flex():
    at = click(playground(UNSEEDED, GPU_SHAPE), "pg_grad_btn")
    assert not at.error, problem_text(at)
    rows = table(at, "tensor")
    flex = rows[rows["source"] == "flexcore"]
    assert {"dQ", "dK", "dV", "dbias"} <= set(flex["tensor"])
    assert "torch_flex" in set(rows["source"]), set(rows["source"])
    assert set(flex["result"]) == {"pass"}, rows


def test_benchmark_on_the_gpu_times_the_gpu_providers():
    at = click(playground(CAUSAL, GPU_SHAPE), "pg_bench_btn")
    assert not at.error, problem_text(at)
    assert not any("not representative" in w for w in texts(at, "warning"))
    rows = table(at, "median ms")
    assert {"flexcore", "torch_flex", "sdpa_flash", "sdpa_cudnn"} <= set(rows["provider"]), rows
    assert {"forward", "forward+backward"} <= set(rows["pass"])
    assert all(cell.endswith("MiB") and cell != "0.0 MiB" for cell in rows["peak memory"])


def test_environment_names_the_gpu():
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.switch_page("app_pages/environment.py").run()
    no_exception(at)
    success = " ".join(texts(at, "success"))
    assert "GPU mode" in success and torch.cuda.get_device_name() in success
    providers = at.table[0].value
    available = set(providers[providers["available"] == "yes"]["provider"])
    assert {"flexcore", "torch_flex", "sdpa_cudnn"} <= available
