"""The workbench in GPU mode (run with -m gpu on the device): the Playground's flows at GPU shapes,
the providers of a GPU machine, and the Environment page naming the GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from tests.app.test_pages import CAUSAL, ENTRY, LEARNABLE, error_text, no_exception, playground, texts  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A shape the interpreter could not run in minutes: GPU mode must take it.
GPU_SHAPE = {"B": 2, "Hq": 8, "Hkv": 2, "Q_LEN": 2048, "KV_LEN": 2048, "D": 64, "dtype": "bfloat16",
             "BLOCK_SIZE": 128}


def test_playground_is_in_gpu_mode_at_gpu_shapes():
    at = playground(CAUSAL, GPU_SHAPE)
    no_exception(at)
    assert not at.error, error_text(at)
    assert not any("CPU mode" in t for t in texts(at, "info") + texts(at, "warning"))
    L = GPU_SHAPE["Q_LEN"]
    assert f"Kept {L * (L + 1) // 2:,} of {L * L:,} positions" in " ".join(texts(at, "caption"))
    assert len(at.get("plotly_chart")) >= 3


def test_check_passes_for_every_dtype_on_the_gpu():
    at = playground(LEARNABLE, GPU_SHAPE)
    at.button(key="pg_check_btn").click().run()
    no_exception(at)
    assert not at.error, error_text(at)
    table = at.dataframe[0].value
    assert list(table["result"]) == ["pass", "pass", "pass"], table


def test_gradients_on_the_gpu_compare_with_float64_and_torch_flex():
    at = playground(LEARNABLE, GPU_SHAPE)
    at.button(key="pg_grad_btn").click().run()
    no_exception(at)
    assert not at.error, error_text(at)
    table = next(d.value for d in at.dataframe if "tensor" in d.value.columns)
    rows = table[table["source"] == "flexcore"]
    assert {"dQ", "dK", "dV", "dbias"} <= set(rows["tensor"])
    assert "torch_flex" in set(table["source"]), set(table["source"])


def test_benchmark_on_the_gpu_times_the_gpu_providers():
    at = playground(CAUSAL, GPU_SHAPE)
    at.button(key="pg_bench_btn").click().run()
    no_exception(at)
    assert not at.error, error_text(at)
    assert not any("not representative" in w for w in texts(at, "warning"))
    table = next(d.value for d in at.dataframe if "provider" in d.value.columns)
    assert {"flexlab", "torch_flex", "sdpa_flash", "sdpa_cudnn"} <= set(table["provider"]), table
    assert at.get("plotly_chart")


def test_environment_names_the_gpu():
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.switch_page("app_pages/environment.py").run()
    no_exception(at)
    success = " ".join(texts(at, "success"))
    assert "GPU mode" in success and torch.cuda.get_device_name() in success
    providers = at.table[0].value
    available = set(providers[providers["available"] == "yes"]["provider"])
    assert {"flexlab", "torch_flex", "sdpa_cudnn"} <= available
