"""The workbench's glue below the pages: long masks drawn in bounded memory, every gallery variant
previews and opens in the Playground, tables write numbers in full, log axes label within a
decade, benchmark rows summarise into forward/backward latency, and the exported report holds
only current results, with its images."""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import torch

pytest.importorskip("streamlit")  # the GPU machine has no streamlit: these tests are CPU-side

from app import plots  # noqa: E402
from app.services import bench, common, export, gallery, playground, tables  # noqa: E402
from app.tasks import views  # noqa: E402

SHAPE = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 64, "KV_LEN": 64, "D": 16, "dtype": "float32",
         "BLOCK_SIZE": 16}


def test_long_masks_are_pooled_in_slabs_with_exact_counts(monkeypatch):
    # 1000 x 700 pools by (4, 3) to at most 256 pixels a side; slabs of 1000 positions force many
    # slabs, and both ragged edges.
    monkeypatch.setattr(views, "CHUNK_POSITIONS", 1000)
    L, S = 1000, 700
    rng = np.random.default_rng(0)
    offset = int(rng.integers(-50, 50))

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    view = views.mask_pooled(mask_mod, 0, 0, L, S)
    dense = np.arange(L)[:, None] + offset >= np.arange(S)[None, :]
    assert view["kept"] == int(dense.sum()) == sum(max(0, min(q + offset + 1, S)) for q in range(L))
    assert view["pool"] == (4, 3)
    expected, _ = views.pool(dense.astype(np.float64))
    np.testing.assert_allclose(view["frac"], expected, atol=1e-6)


def _variant_names() -> list[str]:
    import variants

    return variants.names()


@pytest.mark.parametrize("name", _variant_names())
def test_every_gallery_variant_previews_and_opens(name):
    v = gallery.variant(name)
    view = common.call("gallery_view", name=name, params=v.defaults(), q_len=96, heads=2, h=1,
                       block_size=32)
    L, S = view["Q_LEN"], view["KV_LEN"]
    assert 0 <= view["mask"]["kept"] <= L * S == view["mask"]["total"]
    blocks = view["blocks"]
    q_blocks, kv_blocks = -(-L // 32), -(-S // 32)
    assert blocks["full"] + blocks["partial"] + blocks["empty"] >= q_blocks * kv_blocks
    # Score mods get their bias heatmap; masks alone do not.
    assert (view["scores"] is not None) == (v.kind in ("score", "both"))
    # "Open in Playground" gives code the worker accepts at the Playground's shape.
    shape = {**SHAPE, "KV_LEN": v.default_kv_len(64)}
    source = gallery.variant_source(name, v.defaults(), shape)
    result = common.call("prepare", code=source, shape=shape, seed=0)
    assert result["ok"], result


def test_the_alibi_bias_heatmap_is_the_slope_times_the_distance():
    view = common.call("gallery_view", name="alibi", params={}, q_len=64, heads=4, h=2,
                       block_size=32)
    v = gallery.variant("alibi")
    mods = v.make(B=1, H=4, Q_LEN=64, KV_LEN=64)
    q, k = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    expected = mods.score_mod(torch.zeros(64, 64), 0, torch.tensor(2), q, k).numpy()
    np.testing.assert_allclose(view["scores"]["pooled"], expected, rtol=1e-5, atol=1e-5)


def test_attention_probabilities_are_the_softmax_of_the_modded_scores():
    # ALiBi-like bias under a causal mask at 24 x 40 (a rectangle: rows and keys differ), head 1.
    code = ("import torch\nslopes = torch.tensor([0.5, 0.25])\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n"
            "    return score - slopes[h] * (q_idx - kv_idx).abs()\n\n\n"
            "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx + 16 >= kv_idx\n")
    shape = {**SHAPE, "Q_LEN": 24, "KV_LEN": 40}
    view = common.call("probs_view", code=code, shape=shape, seed=5, b=0, h=1)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(24, 16, generator=g, dtype=torch.float64)
    k = torch.randn(40, 16, generator=g, dtype=torch.float64)
    i, j = torch.meshgrid(torch.arange(24), torch.arange(40), indexing="ij")
    scores = (q @ k.T / 4.0).float().double() - 0.25 * (i - j).abs()
    keep = i + 16 >= j
    expected = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=1)
    got = np.asarray(view["pooled"], dtype=np.float64)
    assert view["pool"] == (1, 1) and np.isnan(got[~keep.numpy()]).all()
    np.testing.assert_allclose(got[keep.numpy()], expected[keep].numpy(), rtol=1e-5, atol=1e-7)
    assert view["max"] == pytest.approx(float(expected[keep].max()), rel=1e-5)


def test_code_creates_its_tensors_on_the_workbench_device():
    # In GPU mode a captured tensor written without device= must land on the GPU; "meta" stands
    # in for it here. A device the code names is kept.
    from app.usercode import run_code

    code = ("import torch\nbias = torch.zeros(H)\nhost = torch.zeros(2, device='cpu')\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + bias[h]\n")
    shape = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 8, "KV_LEN": 8, "D": 8, "device": "meta"}
    mods = run_code(code, shape)
    assert mods.captured["bias"].device.type == "meta"
    assert mods.captured["host"].device.type == "cpu"
    assert torch.empty(1).device.type == "cpu"  # the default is restored afterwards


def test_code_runs_in_an_importable_module():
    # torch.compile imports the module a function's __module__ names (the torch flex provider).
    import importlib

    from app.usercode import run_code

    code = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    shape = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 8, "KV_LEN": 8, "D": 8}
    mods = run_code(code, shape)
    module = importlib.import_module(mods.mask_mod.__module__)
    assert module.mask_mod is mods.mask_mod and module.Q_LEN == 8


# ---- honest tables and axes ---------------------------------------------------------------------

@pytest.mark.parametrize("value, kind, text", [
    (440.0144, "", "440.01"), (12345.678, "", "12,345.68"), (1234567.0, "", "1,234,567"),
    (3.14159, "", "3.142"), (0.012345, "", "0.0123"), (2.5e-05, "", "2.500e-05"), (0, "", "0"),
    (3.1e-07, "err", "3.100e-07"), (None, "", "—"), (float("nan"), "", "nan"),
    (5 * 2**20, "bytes", "5.0 MiB"), (12, "", "12"), (True, "", "yes"),
])
def test_numbers_are_written_in_full(value, kind, text):
    assert tables.fmt(value, kind) == text


def test_log_axes_label_values_within_a_decade():
    ticks = plots.log_ticks([0.03, 0.4, 7.0])  # three decades: 1, 2 and 5 of each
    for v in (0.05, 0.1, 0.2, 0.5, 1, 2, 5):
        assert v in ticks
    assert [plots.tick_text(t) for t in (0.05, 0.5, 20, 5000)] == ["0.05", "0.5", "20", "5,000"]
    narrow = plots.log_ticks([1.2, 3.4])  # less than a decade: denser labels
    assert {1.5, 2, 3, 4} <= set(narrow)
    wide = plots.log_ticks([0.2, 1337])  # four decades: 1 and 3 of each, a dozen labels at most
    assert {0.3, 1, 3, 10, 30, 100, 300, 1000} <= set(wide) and len(wide) <= 12
    fig = plots.latency_bars([{"provider": "flexcore", "pass": "forward", "ms": 0.4},
                              {"provider": "sdpa_math", "pass": "forward", "ms": 7.0}], "t")
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.title.text == "median latency (ms)"
    assert "0.5" in fig.layout.yaxis.ticktext and "2" in fig.layout.yaxis.ticktext
    assert fig.layout.xaxis.title.text == "provider"


def _row(provider, pass_, metric, value, status="ok", note="", kv_len=64):
    return {"provider": provider, "pass": pass_, "metric": metric, "value": value,
            "status": status, "note": note, "kv_len": kv_len, "variant": "v.py",
            "case_id": f"v.py|{pass_}|{kv_len}"}


def test_benchmark_rows_give_forward_backward_and_both():
    rows = [_row("flexlab", "fwd", "time_ms", 2.0), _row("flexlab", "fwd_bwd", "time_ms", 7.5),
            _row("flexlab", "fwd", "peak_mem_bytes", 3 * 2**20),
            _row("flexlab", "fwd", "tflops", 440.0144),
            _row("flexlab", "fwd", "out_correct", 1), _row("sdpa_math", "fwd", "time_ms", 4.0),
            _row("sdpa_flash", "fwd", "status", None, "skipped", "needs a CUDA GPU"),
            _row("baseline", "fwd", "out_max_abs", 1e-7)]
    summary = playground.benchmark_summary(rows)
    flex = next(s for s in summary if s["provider"] == "flexlab" and s["pass"] == "fwd")
    assert (flex["label"], flex["ms"], flex["peak_bytes"], flex["correct"]) == ("flexcore", 2.0,
                                                                                3 * 2**20, True)
    latency = {(r["provider"], r["pass"]): r["ms"] for r in playground.latency_rows(summary)}
    assert latency == {("flexcore", "forward"): 2.0, ("sdpa_math", "forward"): 4.0,
                       ("flexcore", "backward"): 5.5, ("flexcore", "forward+backward"): 7.5}
    header, body = tables.benchmark_table(summary)
    assert ["flexcore", "forward", "2.000"] == body[0][:3] and "440.01" in body[0]
    assert playground.not_timed(rows) == [{"provider": "sdpa_flash", "pass": "forward", "S": 64,
                                           "status": "skipped", "reason": "needs a CUDA GPU"}]


def test_sweep_rows_pair_latency_and_throughput_per_length():
    rows = [_row("flexlab", "fwd", "time_ms", 1.0, kv_len=64), _row("flexlab", "fwd", "tflops", 0.5,
                                                                    kv_len=64),
            _row("flexlab", "fwd", "time_ms", 3.0, kv_len=128), _row("baseline", "fwd", "time_ms", 9,
                                                                     kv_len=64)]
    assert playground.sweep_rows(rows) == [
        {"provider": "flexcore", "S": 64, "ms": 1.0, "tflops": 0.5},
        {"provider": "flexcore", "S": 128, "ms": 3.0, "tflops": None}]


def test_fingerprints_follow_code_shape_dtype_and_seed():
    code = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    base = common.fingerprint(code, SHAPE, 0)
    assert base == common.fingerprint(code, dict(reversed(list(SHAPE.items()))), 0)
    for changed in (common.fingerprint(code + "\n", SHAPE, 0),
                    common.fingerprint(code, {**SHAPE, "Q_LEN": 32}, 0),
                    common.fingerprint(code, {**SHAPE, "dtype": "bfloat16"}, 0),
                    common.fingerprint(code, SHAPE, 1)):
        assert changed != base


def test_the_report_holds_current_results_and_images_and_leaves_stale_ones_out(monkeypatch):
    monkeypatch.setattr(export, "provenance", lambda: {"commit": "abc"})
    code = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    fp = common.fingerprint(code, SHAPE, 0)
    check = export.make_record("check", fp, {"rows": [{
        "dtype": "float32", "passed": True, "max_abs": 3.1e-07, "threshold": 1.0e-05,
        "torch_max_abs": 2.0e-07, "mean_abs": 1e-8}], "heatmaps": {}})
    stale = export.make_record("grad", "0" * 16, {"rows": [], "notes": []})
    mask = {"pooled": np.tril(np.ones((64, 64))), "pool": (1, 1)}
    blocks = {"map": np.array([[2, 0], [1, 2]]), "block_size": (32, 32)}
    images = {"mask": export.mask_png(mask, "mask"), "block_map": export.block_png(blocks, "blocks")}
    files = export.report("causal test", code, SHAPE, 0, fp, {"check": check, "grad": stale},
                          images, {"commit": "abc", "device": "cpu"})
    page = files["html"].decode()
    assert "Check against float64" in page and "3.100e-07" in page
    assert "Gradients against float64" not in page.split("Left out")[0]
    assert "stale" in page and page.count("data:image/png;base64,") == 2
    with zipfile.ZipFile(io.BytesIO(files["zip"])) as z:
        assert {"report.md", "mask.png", "block_map.png", "experiment.json"} <= set(z.namelist())
        assert z.read("mask.png")[:8] == b"\x89PNG\r\n\x1a\n"
        record = json.loads(z.read("experiment.json"))
        assert record["fingerprint"] == fp and list(record["results"]) == ["check"]
        assert "![mask](mask.png)" in z.read("report.md").decode()


def test_uploads_are_told_apart_by_content():
    a, b = b'{"rows": []}', b'{"rows": [] }'
    assert bench.content_key(a) != bench.content_key(b)
    first, second = bench.load_uploaded("results.json", a), bench.load_uploaded("results.json", b)
    assert first["path"] != second["path"]


def test_published_runs_are_offered():
    found = bench.discovered_results()
    published = [label for label in found if label.startswith("bench/results/")]
    on_disk = sorted(p.parent.name for p in bench.PUBLISHED_DIR.rglob("results.json"))
    assert len(published) == len(on_disk)
