"""AppTest of the workbench: every page renders; the Playground's flows run on the CPU at tiny
shapes; each kind of bad input shows its message with the user's line number."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from app import editor  # noqa: E402

ENTRY = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
# Small enough for Triton's interpreter: a few hundred inner-loop steps per kernel call. Hq=2 with
# Hkv=1 exercises grouped-query attention; 16-blocks give a 4 x 4 block map.
TINY = {"B": 1, "Hq": 2, "Hkv": 1, "Q_LEN": 64, "KV_LEN": 64, "D": 16, "dtype": "float32",
        "BLOCK_SIZE": 16}

CAUSAL = """\
def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
"""

LEARNABLE = """\
import torch

bias = torch.linspace(-1.0, 1.0, H).requires_grad_()


def score_mod(score, b, h, q_idx, kv_idx):
    return score + bias[h] * (q_idx - kv_idx) / Q_LEN


def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
"""


def playground(code: str | None = None, shape: dict | None = None, plain: bool = False) -> AppTest:
    at = AppTest.from_file(ENTRY, default_timeout=240)
    at.session_state["playground_shape"] = dict(shape or TINY)
    if code is not None:
        at.session_state[editor.CODE_KEY] = code
    at.session_state[editor.PLAIN_KEY] = plain
    return at.run()


def texts(at: AppTest, kind: str) -> list[str]:
    return [e.value for e in getattr(at, kind)]


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def error_text(at: AppTest) -> str:
    return "\n".join(texts(at, "error"))


# ---- every page --------------------------------------------------------------------------------

@pytest.mark.parametrize("page", ["app_pages/gallery.py", "app_pages/benchmarks.py",
                                  "app_pages/environment.py"])
def test_page_renders(page):
    at = AppTest.from_file(ENTRY, default_timeout=240)
    at.session_state["playground_shape"] = dict(TINY)
    at.switch_page(page).run()
    no_exception(at)
    assert at.title and at.title[0].value in {"Gallery", "Benchmarks", "Environment"}


def test_playground_template_renders_in_cpu_mode():
    at = playground()
    no_exception(at)
    assert at.title[0].value == "Playground"
    # CPU mode says so, with its limits, and labels timings as not representative.
    assert any("CPU mode" in t and "not representative" in t for t in texts(at, "info"))
    assert not at.error, error_text(at)
    from app.templates import TEMPLATE

    assert at.session_state[editor.CODE_KEY] == TEMPLATE
    assert len(at.get("plotly_chart")) >= 3  # mask, block map, scores


def test_environment_lists_providers_and_reasons():
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.switch_page("app_pages/environment.py").run()
    no_exception(at)
    providers = at.table[0].value
    assert "flexlab" in set(providers["provider"])
    unavailable = providers[providers["available"] == "no"]
    # Every provider that cannot run here says why.
    assert all(reason.strip() for reason in unavailable["detail / why not"])


# ---- Playground flows ---------------------------------------------------------------------------

def test_visualise_shows_exact_counts_and_block_map():
    at = playground(CAUSAL)
    no_exception(at)
    assert not at.error, error_text(at)
    L = TINY["Q_LEN"]
    kept = L * (L + 1) // 2
    captions = " ".join(texts(at, "caption"))
    assert f"Kept {kept:,} of {L * L:,} positions" in captions
    # 64 / 16 = 4 blocks a side: 6 full below the diagonal, 4 partial on it, 6 empty above, for
    # each of the Hq = 2 heads the BlockMask stores.
    markdown = " ".join(texts(at, "markdown"))
    assert "**full**: 12" in markdown and "**partial**: 8" in markdown and "**empty**: 12" in markdown
    assert any("q_idx >= kv_idx" in c.value for c in at.code)  # the Triton source


def test_plain_editor_edits_reach_the_views():
    at = playground(plain=True)
    area = at.text_area[0]
    area.input(CAUSAL).run()
    at.button(key="pg_run").click().run()
    no_exception(at)
    assert at.session_state[editor.CODE_KEY] == CAUSAL
    L = TINY["Q_LEN"]
    assert f"Kept {L * (L + 1) // 2:,} of {L * L:,}" in " ".join(texts(at, "caption"))


def test_check_passes_for_every_dtype():
    at = playground(LEARNABLE)
    at.button(key="pg_check_btn").click().run()
    no_exception(at)
    assert not at.error, error_text(at)
    assert "Check passed for float32, float16, bfloat16." in texts(at, "success")
    table = at.dataframe[0].value
    assert list(table["result"]) == ["pass", "pass", "pass"]
    assert float(table["max |err|"][0]) < 1e-4  # float32 against float64


def test_gradients_compare_with_float64():
    at = playground(LEARNABLE)
    at.button(key="pg_grad_btn").click().run()
    no_exception(at)
    assert not at.error, error_text(at)
    table = next(d.value for d in at.dataframe if "tensor" in d.value.columns)
    for source in ("flexcore", "sdpa_math"):
        rows = table[table["source"] == source]
        assert {"dQ", "dK", "dV", "dbias"} <= set(rows["tensor"]), source
    assert all(float(v) < 1e-3 for v in table["max_abs"])  # float32 gradients against float64


def test_export_holds_the_experiment():
    from app import services

    at = playground(CAUSAL)
    at.button(key="pg_check_btn").click().run()
    no_exception(at)
    at.button(key="pg_export_btn").click().run()
    no_exception(at)
    labels = [b.proto.label for b in at.get("download_button")]
    assert {"Download .json", "Download .md", "Download .html"} <= set(labels)
    results = {"check": at.session_state["pg_results_check"]}
    files = services.export(CAUSAL, TINY, results)
    record = json.loads(files["json"])
    assert record["code"] == CAUSAL and record["shape"] == TINY
    assert [r["dtype"] for r in record["results"]["check"]] == ["float32", "float16", "bfloat16"]
    assert "q_idx >= kv_idx" in files["md"].decode() and "<table" in files["html"].decode()


def test_benchmark_runs_every_available_provider_and_feeds_the_benchmarks_page():
    at = playground(CAUSAL)
    at.button(key="pg_bench_btn").click().run()
    no_exception(at)
    assert not at.error, error_text(at)
    assert any("not representative" in w for w in texts(at, "warning"))
    table = next(d.value for d in at.dataframe if "provider" in d.value.columns)
    ran = set(table["provider"])
    assert {"flexlab", "sdpa_math"} <= ran
    # The run is a bench results folder: the Benchmarks page finds it, plots it and reports it.
    at.switch_page("app_pages/benchmarks.py").run()
    no_exception(at)
    at.multiselect(key="bm_found").select("workbench/playground").run()
    no_exception(at)
    assert at.get("plotly_chart")
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Download report.html" in labels and "Download report.md" in labels


def test_gallery_opens_a_variant_in_the_playground():
    at = AppTest.from_file(ENTRY, default_timeout=240)
    at.session_state["playground_shape"] = dict(TINY)
    at.switch_page("app_pages/gallery.py").run()
    no_exception(at)
    at.selectbox(key="gallery_variant").select("sliding_window").run()
    no_exception(at)
    assert len(at.get("plotly_chart")) == 2  # mask and block map
    at.button(key="gallery_open").click().run()
    no_exception(at)
    code = at.session_state[editor.CODE_KEY]
    assert "def mask_mod" in code or "mask_mod =" in code
    assert at.title[0].value == "Playground"
    assert not at.error, error_text(at)


# ---- bad input: each shows its message with the user's line; the code is kept -------------------

BAD = {
    "syntax": ("def mask_mod(b, h, q_idx, kv_idx)\n    return q_idx >= kv_idx\n",
               "Syntax error", 1),
    "exception": ("def score_mod(score, b, h, q_idx, kv_idx):\n    scale = 1 / 0\n    return score\n",
                  "ZeroDivisionError", 2),
    "top_level_exception": ("import torch\nweights = torch.ones(3) @ torch.ones(4)\n",
                            "RuntimeError", 2),
    "unsupported_op": ("def score_mod(score, b, h, q_idx, kv_idx):\n"
                       "    return torch.special.i0(score)\n", "Unsupported operation", 2),
    "control_flow": ("def score_mod(score, b, h, q_idx, kv_idx):\n    if q_idx > kv_idx:\n"
                     "        return score\n    return score * 2\n", "control flow", 2),
    "signature": ("def mask_mod(b, h, q_idx):\n    return q_idx >= 0\n", "signature", 1),
    "captured_out_of_range": ("import torch\nbias = torch.zeros(1)\n\n\n"
                              "def score_mod(score, b, h, q_idx, kv_idx):\n"
                              "    return score + bias[h]\n", "out of range", 6),
    "exit_call": ("import sys\n\nsys.exit(3)\n", "exit()", 3),
    "endless_loop": ("def mask_mod(b, h, q_idx, kv_idx):\n    while True:\n        pass\n",
                     "did not finish", 2),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_shown_inline_with_its_line(case):
    code, title, lineno = BAD[case]
    at = playground(code)
    no_exception(at)
    message = error_text(at)
    assert title.lower() in message.lower(), message
    assert f"line {lineno}" in message, message
    assert at.session_state[editor.CODE_KEY] == code  # the editor keeps the user's text


def test_impossible_shape_is_explained():
    at = playground(CAUSAL, {**TINY, "Hq": 3, "Hkv": 2})
    no_exception(at)
    message = error_text(at)
    assert "Impossible shape" in message and "multiple of Hkv" in message
    assert at.session_state[editor.CODE_KEY] == CAUSAL


def test_missing_mod_is_explained():
    at = playground("x = 1\n")
    no_exception(at)
    assert "No mod defined" in error_text(at)


def test_cpu_mode_refuses_shapes_beyond_its_limits():
    at = playground(CAUSAL, {**TINY, "B": 4, "Hq": 4, "Hkv": 4})
    no_exception(at)
    message = error_text(at)
    assert "Shape too large for CPU mode" in message and "B·Hq = 16" in message


def test_an_unexpected_failure_is_an_error_box_not_a_traceback(monkeypatch):
    from app import services

    def broken():
        raise RuntimeError("environment capture exploded")

    monkeypatch.setattr(services, "environment", broken)
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.switch_page("app_pages/environment.py").run()
    no_exception(at)
    assert "environment capture exploded" in error_text(at)


def test_benchmarks_page_runs_the_tiny_preset_with_progress_and_report():
    at = AppTest.from_file(ENTRY, default_timeout=240)
    at.switch_page("app_pages/benchmarks.py").run()
    assert at.selectbox(key="bm_preset").value == "tiny"  # the only preset offered in CPU mode
    at.button(key="bm_run").click().run()
    no_exception(at)
    assert not at.error, error_text(at)
    assert any(s.startswith("tiny:") and "rows written" in s for s in texts(at, "success"))
    assert at.get("plotly_chart")
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Download report.html" in labels and "Download report.md" in labels
    # The same results uploaded as files (JSON and CSV) load through bench's loader and are
    # compared side by side with the run.
    from app import services

    run = at.session_state["bm_runs"]["tiny (this machine)"]
    folder = Path(run["path"])
    for name in ("results.json", "results.csv"):
        uploaded = services.load_uploaded(name, (folder / name).read_bytes())
        assert len(uploaded["rows"]) == len(run["rows"])
        at.session_state["bm_runs"][f"{name} (uploaded)"] = uploaded
    at.run()
    no_exception(at)
    assert len(at.multiselect(key="bm_chosen").value) == 3
    assert at.get("plotly_chart")


def test_gallery_parameters_drive_the_preview():
    at = AppTest.from_file(ENTRY, default_timeout=240)
    at.switch_page("app_pages/gallery.py").run()
    at.selectbox(key="gallery_variant").select("sliding_window").run()
    window = 16
    at.select_slider(key="gallery_sliding_window_window_size").set_value(window).run()
    no_exception(at)
    L = at.select_slider(key="gallery_q_len").value
    # Each query sees the last `window` keys, itself included.
    kept = sum(min(q + 1, window) for q in range(L))
    assert f"Kept {kept:,} of {L * L:,} positions" in " ".join(texts(at, "caption"))


def test_edits_survive_a_page_switch_and_an_editor_switch():
    at = playground(plain=True)
    at.text_area[0].input(CAUSAL).run()
    at.switch_page("app_pages/gallery.py").run()
    at.switch_page("app_pages/playground.py").run()
    no_exception(at)
    assert at.session_state[editor.CODE_KEY] == CAUSAL
    assert at.text_area[0].value == CAUSAL
    at.toggle(key=editor.PLAIN_KEY).set_value(False).run()  # to the Ace editor
    at.toggle(key=editor.PLAIN_KEY).set_value(True).run()   # and back
    no_exception(at)
    assert at.session_state[editor.CODE_KEY] == CAUSAL
    assert at.text_area[0].value == CAUSAL
