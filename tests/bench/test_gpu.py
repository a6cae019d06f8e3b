"""The runner on a CUDA GPU: every provider that runs must pass its correctness checks."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device (run them with -m gpu on the GPU machine)")
    from bench import runner
    from bench.grid import build_grid

    config = {
        "providers": ["flexlab", "torch_flex", "sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn",
                      "flash_attn", "torch_flex_flash"],
        "settings": {"rep_ms": 20, "warmup_ms": 5, "min_reps": 5, "max_reps": 20},
        "groups": [
            # 1000 is not a block multiple; 8 query heads on 2 KV heads.
            {"variants": ["noop", "causal", "alibi_causal", "softcap_causal(softcap=30)",
                          "document(num_documents=3)", "relative_bias(max_distance=64)"],
             "shapes": [[2, 1000]], "heads": [[8, 2]], "head_dim": [64], "dtype": ["bfloat16"],
             "passes": ["fwd", "fwd_bwd"]},
            {"variants": ["noop", "alibi", "sliding_window(window_size=256)"], "shapes": [[2, 1, 4096]],
             "heads": [[8, 2]], "head_dim": [128], "dtype": ["bfloat16"], "passes": ["decode"]},
        ],
    }
    out = tmp_path_factory.mktemp("gpu_run")
    path = runner.run(build_grid(config, "gpu"), out, progress=False)
    return json.loads(path.read_text())["rows"]


def _get(rows, variant, provider, metric, pass_=None):
    return [r for r in rows if r["variant"] == variant and r["provider"] == provider
            and r["metric"] == metric and (pass_ is None or r["pass"] == pass_)]


def test_no_provider_errors(gpu_run):
    errors = [(r["case_id"], r["provider"], r["note"]) for r in gpu_run if r["status"] == "error"]
    assert not errors, errors


def test_every_provider_that_ran_is_correct(gpu_run):
    # A backend may refuse only the gradient comparison (e.g. SDPA efficient with a bias that
    # requires grad at a length that is not a multiple of 16): that row says "unsupported".
    checked = [r for r in gpu_run if r["metric"].endswith("_correct") and r["status"] != "unsupported"]
    assert any(r["provider"] == "flexlab" for r in checked)
    fails = [(r["case_id"], r["provider"], r["metric"], r["value"], r["note"]) for r in checked
             if r["value"] != 1]
    assert not fails, fails


def test_baselines_ran_where_expected(gpu_run):
    for variant in ("noop", "causal", "alibi_causal", "softcap_causal(softcap=30)", "document(num_documents=3)",
                    "relative_bias(max_distance=64)"):
        for pass_ in ("fwd", "fwd_bwd"):
            assert len(_get(gpu_run, variant, "torch_flex", "time_ms", pass_)) == 1, (variant, pass_)
    # SDPA flash: no mask and causal only.
    assert len(_get(gpu_run, "causal", "sdpa_flash", "time_ms")) == 2
    status = _get(gpu_run, "alibi_causal", "sdpa_flash", "status")
    assert status and status[0]["status"] == "unsupported"
    # A softcap cannot be a dense bias.
    status = _get(gpu_run, "softcap_causal(softcap=30)", "sdpa_cudnn", "status")
    assert status and "additive" in status[0]["note"]
    for variant in ("noop", "alibi", "sliding_window(window_size=256)"):
        rows = _get(gpu_run, variant, "torch_flex", "gbps", "decode")
        assert rows and rows[0]["value"] > 0, variant


def test_decode_is_timed_in_cuda_graphs_with_the_eager_time_beside(gpu_run):
    for provider in ("flexlab", "torch_flex", "sdpa_cudnn"):
        for variant in ("noop", "alibi"):
            timed = _get(gpu_run, variant, provider, "time_ms", "decode")
            if not timed:
                continue
            assert timed[0]["note"].startswith("cuda_graph"), (provider, variant, timed[0]["note"])
            eager = _get(gpu_run, variant, provider, "time_ms_eager", "decode")
            assert eager and eager[0]["value"] > 0, (provider, variant)
    assert _get(gpu_run, "noop", "flexlab", "time_ms", "decode")
    forward = _get(gpu_run, "causal", "flexlab", "time_ms", "fwd")
    assert forward and forward[0]["note"].startswith("cuda_events")


def test_graph_timing_measures_the_gpu_and_reports_capture_failures():
    from bench.timing import GraphCaptureError, time_call

    dev = torch.device("cuda")
    x = torch.randn(4096, 4096, device=dev)
    timing = time_call(lambda i: x @ x, 2, dev, warmup_ms=5, rep_ms=20, cuda_graph=True)
    assert timing.method == "cuda_graph" and timing.median_ms > 0

    def syncs(i):
        y = x @ x
        torch.cuda.synchronize()  # not allowed while capturing
        return y

    with pytest.raises(GraphCaptureError):
        time_call(syncs, 2, dev, warmup_ms=5, rep_ms=20, cuda_graph=True)
    # The device is still usable after the failed capture.
    assert time_call(syncs, 2, dev, warmup_ms=5, rep_ms=20).method == "cuda_events"


def test_learnable_bias_gradient_is_compared(gpu_run):
    rows = _get(gpu_run, "relative_bias(max_distance=64)", "torch_flex", "dtable_correct")
    assert rows and rows[0]["value"] == 1


def _provider_rows(rows, provider):
    return {(r["case_id"], r["metric"]): r for r in rows if r["provider"] == provider}


def _compiled_flexcore_ok_or_explained(rows, what):
    """flexlab_compiled rows: correct, or an error whose note gives torch.compile's reason."""
    for (case, metric), r in _provider_rows(rows, "flexlab_compiled").items():
        if metric == "status":
            assert r["status"] == "error" and f"torch.compile(fullgraph=True, backend=inductor) of {what} failed" \
                in r["note"], r
        elif metric.endswith("_correct"):
            assert r["value"] == 1, r


def test_small_preset_rows_are_unpinned_and_correct(tmp_path):
    from bench import runner
    from bench.grid import build_grid, load_config

    grid = build_grid(load_config("small"), "small", passes=["fwd_bwd"],
                      overrides={"shapes": [[1, 1024]], "heads": [8], "head_dim": [64]},
                      settings={"rep_ms": 20, "warmup_ms": 5, "min_reps": 5, "max_reps": 20})
    assert len(grid.cases) == 3 and grid.settings.pin_host is False
    rows = json.loads(runner.run(grid, tmp_path / "small", progress=False).read_text())["rows"]
    for provider in ("flexlab", "torch_flex"):
        mine = _provider_rows(rows, provider)
        correct = [r for (_, m), r in mine.items() if m.endswith("_correct")]
        assert correct and all(r["value"] == 1 for r in correct), provider
        times = [r for (_, m), r in mine.items() if m == "time_ms"]
        assert len(times) == 3 and all("host threads on core" not in r["note"] for r in times)
    _compiled_flexcore_ok_or_explained(rows, "flexcore.flex_attention")


def test_train_step_rows_on_the_gpu(tmp_path):
    from bench import runner
    from bench.grid import build_grid

    # A realistic block at a quarter of the preset's size: d_model 512, 4k tokens.
    grid = build_grid({"providers": ["flexlab", "flexlab_compiled", "torch_flex"],
                       "settings": {"rep_ms": 20, "warmup_ms": 5, "min_reps": 5, "max_reps": 20,
                                    "pin_host": False},
                       "groups": [{"variants": ["causal", "alibi_causal"], "shapes": [[2, 2048]],
                                   "heads": [[8, 4]], "head_dim": [64], "dtype": ["bfloat16"],
                                   "passes": ["train_step"]}]}, "train")
    rows = json.loads(runner.run(grid, tmp_path / "train", progress=False).read_text())["rows"]
    for provider in ("flexlab", "torch_flex"):
        mine = _provider_rows(rows, provider)
        assert not [(c, r["note"]) for (c, m), r in mine.items() if m == "status"], provider
        for case in {c for c, _ in mine}:
            for key in ("out", "dx", "dparams"):
                assert mine[(case, f"{key}_correct")]["value"] == 1, (provider, case, key)
            tokens = mine[(case, "tokens_per_s")]["value"]
            assert tokens == pytest.approx(2 * 2048 / (mine[(case, "time_ms")]["value"] * 1e-3))
    _compiled_flexcore_ok_or_explained(rows, "the block")
