"""The Benchmarks page plots context-parallel results (bench.cp) against the number of GPUs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from bench import cp  # noqa: E402
from tests.app.helpers import ENTRY, chart_titles, no_exception, problem_text, table  # noqa: E402


def _write_cp_results(folder: Path) -> None:
    """A cp run as bench.cp writes it: one GPU at S/2 and S, two GPUs with both strategies."""
    cfg = cp.CONFIGS["cp-tiny"]
    rows = cp._Rows(cfg, "run0")
    for seq, ms in ((64, 10.0), (128, 30.0)):
        rows.timing("causal", seq, 1, "flexlab", [ms], 0.625)
    for provider, ms in (("flexlab_cp_allgather", 20.0), ("flexlab_cp_ring", 25.0)):
        tflops = rows.timing("causal", 128, 2, provider, [ms], 0.5625,
                             [("comm_ms", 4.0, "ms"), ("comm_hidden_ms", 3.0, "ms")])
        base = cp.scaling_table(rows.rows)[0]["tflops"]  # one GPU at S=64
        rows.add("causal", 128, 2, provider, "scaling_eff", tflops / base, "rel")
    rows.add("causal", 128, 2, "torch_cp", "status", None, "", "skipped", "needs CUDA")
    cp.write(folder, "cp-tiny", rows.rows, "cpu")


def test_benchmarks_page_plots_cp_scaling():
    folder = Path(os.environ["FLEXLAB_RESULTS_DIR"]) / "cp-tiny"
    _write_cp_results(folder)
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.switch_page("app_pages/benchmarks.py").run()
    no_exception(at)
    at.multiselect(key="bm_found").set_value(["cp-tiny"]).run()
    no_exception(at)
    assert not at.error, problem_text(at)
    titles = chart_titles(at)
    assert "causal: per-GPU TFLOP/s (forward+backward)" in titles, titles
    assert any(t.startswith("causal: scaling efficiency") for t in titles), titles
    scaling = table(at, "per-GPU TFLOP/s")
    assert sorted(set(scaling["provider"])) == ["flexlab", "flexlab_cp_allgather", "flexlab_cp_ring"]
    assert set(scaling["GPUs"]) == {"1", "2"}
    # Efficiency = per-GPU TFLOP/s at 2 GPUs over one GPU's at S/2 (same tokens per GPU).
    ring = scaling[(scaling["provider"] == "flexlab_cp_ring")].iloc[0]
    flops = 2.0 * 1 * 2 * 128 * 128 * 32 * 0.5625 * 3.5
    per_gpu = flops / 2 / 25e-3 / 1e12
    one = 2.0 * 1 * 2 * 64 * 64 * 32 * 0.625 * 3.5 / 10e-3 / 1e12
    assert float(ring["efficiency"]) == pytest.approx(per_gpu / one, rel=1e-3)


def test_efficiency_chart_draws_one_line_per_strategy():
    from app import plots

    table_ = [{"variant": "causal", "seq": 128, "provider": "flexlab", "gpus": 1, "tflops": 1.0},
              {"variant": "causal", "seq": 128, "provider": "flexlab_cp_ring", "gpus": 2, "tflops": 0.8,
               "scaling_eff": 0.8},
              {"variant": "causal", "seq": 128, "provider": "flexlab_cp_allgather", "gpus": 2,
               "tflops": 0.9, "scaling_eff": 0.9}]
    fig = plots.cp_scaling(table_, "tflops", "t")
    # Each flexlab line starts at the single-GPU point.
    assert sorted((d.name, tuple(d.x), tuple(d.y)) for d in fig.data) == [
        ("flexlab_cp_allgather, S=128", (1, 2), (1.0, 0.9)), ("flexlab_cp_ring, S=128", (1, 2), (1.0, 0.8))]
