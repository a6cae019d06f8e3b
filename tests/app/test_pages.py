"""AppTest of the workbench: every page renders; the Playground's flows run on the CPU at tiny
shapes and are kept as experiments; each kind of bad input shows its message, as text, with the
user's line number."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from app import editor, experiments  # noqa: E402
from tests.app.helpers import (CAUSAL, ENTRY, LEARNABLE, TINY, UNSEEDED,  # noqa: E402
                               chart_titles, click, no_exception, open_tab, playground,
                               problem_text, table, texts)


# ---- every page --------------------------------------------------------------------------------

@pytest.mark.parametrize("page", ["app_pages/gallery.py", "app_pages/benchmarks.py",
                                  "app_pages/environment.py"])
def test_page_renders(page):
    at = AppTest.from_file(ENTRY, default_timeout=240)
    at.switch_page(page).run()
    no_exception(at)
    assert at.title and at.title[0].value in {"Gallery", "Benchmarks", "Environment"}
    assert not at.error, problem_text(at)


def test_playground_template_renders_in_cpu_mode_and_is_not_saved_untouched():
    at = playground()
    no_exception(at)
    assert at.title[0].value == "Playground"
    # CPU mode says so, with its limits, and labels timings as not representative.
    assert any("CPU mode" in t and "not representative" in t for t in texts(at, "info"))
    assert not at.error, problem_text(at)
    from app.templates import TEMPLATE

    assert at.session_state[editor.CODE_KEY] == TEMPLATE
    assert len(at.get("plotly_chart")) == 2  # mask and block map (the open tab)
    open_tab(at, "Scores")
    assert len(at.get("plotly_chart")) == 3  # mask, scores and probabilities
    assert not at.error, problem_text(at)
    assert "exp" not in at.query_params and experiments.store().list() == []


def test_environment_lists_providers_and_states_the_rights_code_runs_with():
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.switch_page("app_pages/environment.py").run()
    no_exception(at)
    providers = at.table[0].value
    assert "flexcore" in set(providers["provider"])
    unavailable = providers[providers["available"] == "no"]
    # Every provider that cannot run here says why.
    assert all(reason.strip() for reason in unavailable["detail / why not"])
    words = " ".join(texts(at, "markdown"))
    assert "your user's own rights" in words and "Jupyter kernel" in words


# ---- Playground flows ---------------------------------------------------------------------------

def test_visualise_shows_exact_counts_block_map_and_probabilities():
    at = playground(CAUSAL)
    no_exception(at)
    assert not at.error, problem_text(at)
    L = TINY["Q_LEN"]
    kept = L * (L + 1) // 2
    captions = " ".join(texts(at, "caption"))
    assert f"Kept {kept:,} of {L * L:,} positions" in captions
    # 64 / 16 = 4 blocks a side: 6 full below the diagonal, 4 partial on it, 6 empty above, for
    # each of the Hq = 2 heads the BlockMask stores.
    markdown = " ".join(texts(at, "markdown"))
    assert "**full**: 12" in markdown and "**partial**: 8" in markdown and "**empty**: 12" in markdown
    open_tab(at, "Triton code")
    assert any("q_idx >= kv_idx" in c.value for c in at.code)  # the Triton source
    open_tab(at, "Scores")
    # Causal attention: the first query sees only the first key, with probability 1.
    assert "to 1.000" in " ".join(texts(at, "caption"))


def test_plain_editor_edits_reach_the_views():
    at = playground(plain=True)
    at.text_area[0].input(CAUSAL).run()
    click(at, "pg_run")
    assert at.session_state[editor.CODE_KEY] == CAUSAL
    L = TINY["Q_LEN"]
    assert f"Kept {L * (L + 1) // 2:,} of {L * L:,}" in " ".join(texts(at, "caption"))


def test_check_passes_for_every_dtype_and_is_kept_with_the_experiment():
    at = click(playground(LEARNABLE), "pg_check_btn")
    assert not at.error, problem_text(at)
    assert "Check passed for float32, float16, bfloat16." in texts(at, "success")
    rows = table(at, "max |err|")
    assert list(rows["result"]) == ["pass", "pass", "pass"]
    assert float(rows["max |err|"][0]) < 1e-4  # float32 against float64
    saved = experiments.store().get(at.query_params["exp"])
    assert saved.code == LEARNABLE and saved.results["check"]["data"]["rows"][0]["passed"]


def test_gradients_of_an_unseeded_random_tensor_match_float64():
    at = click(playground(UNSEEDED), "pg_grad_btn")
    assert not at.error, problem_text(at)
    rows = table(at, "tensor")
    for source in ("flexcore", "sdpa_math", "eager reference (float32)"):
        got = rows[rows["source"] == source]
        assert {"dQ", "dK", "dV", "dbias"} <= set(got["tensor"]), source
    assert set(rows["result"]) == {"pass"}, rows
    assert all(float(v) < 1e-4 for v in rows["max |err|"])  # float32 gradients against float64
    assert any(s.startswith("Every gradient passed") for s in texts(at, "success"))


NAN_MOD = "def score_mod(score, b, h, q_idx, kv_idx):\n    return score * float('nan')\n"


def test_a_nan_result_fails_check_and_gradients_though_the_eager_reference_is_nan_too():
    # The eager reference in the tested dtype is NaN as well, so its threshold is inf: the result
    # still fails, never passes.
    at = playground(NAN_MOD)
    at.session_state["pg_check_dtypes"] = ["float32"]
    at = click(at, "pg_check_btn")
    assert not texts(at, "success"), texts(at, "success")
    assert "Check failed for float32." in texts(at, "error")
    assert list(table(at, "max |err|")["result"]) == ["FAIL"]
    at = click(at, "pg_grad_btn")
    rows = table(at, "tensor")
    flex = rows[rows["source"] == "flexcore"]
    assert len(flex) and set(flex["result"]) == {"FAIL"}, rows
    assert not any(s.startswith("Every gradient passed") for s in texts(at, "success"))


def test_a_reload_restores_the_code_and_results():
    at = click(playground(CAUSAL, {**TINY, "Q_LEN": 32, "KV_LEN": 48}), "pg_check_btn")
    exp_id = at.query_params["exp"]
    again = playground(exp=exp_id, shape=TINY)  # a new session: only the URL is shared
    no_exception(again)
    assert again.session_state[editor.CODE_KEY] == CAUSAL
    assert again.session_state[experiments.SHAPE_KEY]["KV_LEN"] == 48
    open_tab(again, "Check")
    assert "Check passed for float32, float16, bfloat16." in texts(again, "success")
    assert not any("Stale" in w for w in texts(again, "warning"))


def test_results_of_other_code_are_marked_stale_and_left_out_of_the_export():
    at = click(playground(CAUSAL, plain=True), "pg_check_btn")
    click(at, "pg_export_btn")
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Download .html" in labels and "Download .zip" in labels
    at.text_area[0].input(CAUSAL.replace(">=", ">")).run()
    no_exception(at)
    assert "The report prepared earlier is stale" in " ".join(texts(at, "warning"))
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Download .html" not in labels  # the old report cannot be downloaded as current
    open_tab(at, "Check")
    assert "Stale: these results were computed from other code" in " ".join(texts(at, "warning"))
    click(at, "pg_export_btn")  # prepared again: for the new code, without the stale Check
    assert "Download .html" in [b.proto.label for b in at.get("download_button")]
    page = at.session_state["pg_export"]["files"]["html"].decode()
    included, _, left_out = page.partition("Left out")
    assert "Check against float64" not in included and "Check against float64" in left_out


def test_benchmark_times_forward_backward_and_feeds_the_benchmarks_page():
    shape = {**TINY, "Q_LEN": 32, "KV_LEN": 32}
    at = click(playground(CAUSAL, shape), "pg_bench_btn")
    assert not at.error, problem_text(at)
    assert any("not representative" in w for w in texts(at, "warning"))
    rows = table(at, "median ms")
    assert {"flexcore", "sdpa_math"} <= set(rows["provider"])
    assert {"forward", "forward+backward"} <= set(rows["pass"])
    assert all(cell.endswith("MiB") for cell in rows["peak memory"])
    latency = next(c.proto.spec for c in at.get("plotly_chart") if "Median latency" in c.proto.spec)
    assert '"name":"backward"' in latency.replace(" ", "")  # fwd+bwd − fwd, per provider
    # The run is a bench results folder: the Benchmarks page finds it and plots it.
    at.switch_page("app_pages/benchmarks.py").run()
    no_exception(at)
    found = [o for o in at.multiselect(key="bm_found").options if o.startswith("workbench/playground")]
    assert found
    at.multiselect(key="bm_found").select(found[0]).run()
    no_exception(at)
    assert at.get("plotly_chart")
    click(at, "bm_report")
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Download report.html" in labels and "Download report.md" in labels


def test_sweep_plots_latency_and_tflops_against_s():
    at = open_tab(playground(CAUSAL, {**TINY, "Q_LEN": 32, "KV_LEN": 32}), "Sweep")
    at.multiselect(key="pg_sweep_lengths").set_value([32, 64]).run()
    at.multiselect(key="pg_sweep_providers").set_value(["flexcore"]).run()
    click(at, "pg_sweep_btn")
    assert not at.error, problem_text(at)
    rows = table(at, "S")
    assert list(rows["S"]) == ["32", "64"] and set(rows["provider"]) == {"flexcore"}
    titles = chart_titles(at)
    assert any(t.startswith("Latency against S") for t in titles)
    assert any(t.startswith("TFLOP/s against S") for t in titles)


def test_two_mods_side_by_side():
    window = CAUSAL.replace("return q_idx >= kv_idx",
                            "return (q_idx >= kv_idx) & (q_idx - kv_idx < 16)")
    at = open_tab(playground(window), "Compare")
    at.selectbox(key="pg_compare_variant").select("causal").run()
    at.checkbox(key="pg_compare_time").uncheck().run()
    click(at, "pg_compare_btn")
    assert not at.error, problem_text(at)
    rows = table(at, "measure")
    L = TINY["Q_LEN"]
    causal_kept = L * (L + 1) // 2
    window_kept = sum(min(q + 1, 16) for q in range(L))
    kept = dict(zip(rows["measure"], zip(rows["this experiment"], rows["causal"])))
    assert kept["kept positions of (b, h)"][0].startswith(f"{window_kept:,} of")
    assert kept["kept positions of (b, h)"][1].startswith(f"{causal_kept:,} of")
    captions = " ".join(texts(at, "caption"))
    assert f"only causal keeps {causal_kept - window_kept:,}" in captions
    assert "max |difference|" in captions
    assert "Where the masks differ" in chart_titles(at)


def test_gallery_opens_a_variant_as_a_new_experiment():
    at = AppTest.from_file(ENTRY, default_timeout=240)
    at.session_state[experiments.SHAPE_KEY] = dict(TINY)
    at.switch_page("app_pages/gallery.py").run()
    at.selectbox(key="gallery_variant").select("alibi_causal").run()
    no_exception(at)
    assert len(at.get("plotly_chart")) == 3  # mask, bias and block map
    click(at, "gallery_open")
    code = at.session_state[editor.CODE_KEY]
    assert "def score_mod" in code or "score_mod =" in code
    assert at.title[0].value == "Playground"
    assert not at.error, problem_text(at)
    saved = experiments.store().get(at.query_params["exp"])
    assert saved.code == code and saved.name.startswith("alibi_causal(")


def test_sidebar_renames_duplicates_exports_imports_and_deletes_with_confirmation():
    at = playground(CAUSAL)
    first = at.query_params["exp"]
    at.text_input(key=f"exp_rename_{first}").input("my causal").run()
    click(at, "exp_rename_btn")
    assert experiments.store().get(first).name == "my causal"
    click(at, "exp_duplicate")
    copy = at.query_params["exp"]
    assert copy != first and experiments.store().get(copy).name == "my causal (copy)"
    exported = experiments.store().export_json(first)
    click(at, "exp_delete")
    assert experiments.store().get(copy)  # only asked, nothing deleted yet
    click(at, "exp_delete_yes")
    assert {e["id"] for e in experiments.store().list()} == {first}
    at.file_uploader(key="exp_import").upload("exp.json", exported.encode(), "application/json").run()
    no_exception(at)
    imported = at.query_params["exp"]
    assert imported not in (first, copy) and at.session_state[editor.CODE_KEY] == CAUSAL
    at.run()  # the file stays in the uploader: it is not imported twice
    assert len(experiments.store().list()) == 2


def test_two_tabs_do_not_overwrite_each_other():
    tab_a = playground(CAUSAL, plain=True)
    exp_id = tab_a.query_params["exp"]
    tab_b = playground(exp=exp_id, plain=True)
    tab_a.text_area[0].input(CAUSAL + "# tab A\n").run()
    tab_b.text_area[0].input(CAUSAL + "# tab B\n").run()
    no_exception(tab_b)
    assert "changed in another tab" in problem_text(tab_b)
    assert experiments.store().get(exp_id).code.endswith("# tab A\n")
    click(tab_b, "conflict_keep")
    new_id = tab_b.query_params["exp"]
    assert new_id != exp_id and experiments.store().get(new_id).code.endswith("# tab B\n")
    assert experiments.store().get(exp_id).code.endswith("# tab A\n")


def test_a_worker_crash_is_reported_and_the_next_action_works():
    at = playground("import os\nos.kill(os.getpid(), 9)\n", plain=True)
    message = problem_text(at)
    assert "The worker process died" in message and "was killed (SIGKILL)" in message
    assert "restarted" in message
    at.run()  # a rerun does not run the crashing code again
    assert "The worker process died" in problem_text(at)
    at.text_area[0].input(CAUSAL).run()
    click(at, "pg_run")
    assert not at.error, problem_text(at)
    L = TINY["Q_LEN"]
    assert f"Kept {L * (L + 1) // 2:,} of" in " ".join(texts(at, "caption"))


def test_error_text_is_shown_as_text():
    code = "raise ValueError('__init__ :x: $x^2$ **bold**')\n"
    at = playground(code)
    assert any("__init__ :x: $x^2$ **bold**" in c for c in texts(at, "code"))
    assert not any("__init__" in e for e in texts(at, "error"))  # not in a Markdown element


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
    message = problem_text(at)
    assert title.lower() in message.lower(), message
    assert f"line {lineno}" in message, message
    assert at.session_state[editor.CODE_KEY] == code  # the editor keeps the user's text


def test_impossible_shape_is_explained():
    at = playground(CAUSAL, {**TINY, "Hq": 3, "Hkv": 2})
    no_exception(at)
    message = problem_text(at)
    assert "Impossible shape" in message and "multiple of Hkv" in message
    assert at.session_state[editor.CODE_KEY] == CAUSAL


def test_missing_mod_is_explained():
    at = playground("x = 1\n")
    no_exception(at)
    assert "No mod defined" in problem_text(at)


def test_cpu_mode_refuses_shapes_beyond_its_limits():
    at = playground(CAUSAL, {**TINY, "B": 4, "Hq": 4, "Hkv": 4})
    no_exception(at)
    message = problem_text(at)
    assert "Shape too large for CPU mode" in message and "B·Hq = 16" in message


def test_an_unexpected_failure_is_an_error_box_not_a_traceback(monkeypatch):
    from app import services

    def broken():
        raise RuntimeError("worker info exploded")

    monkeypatch.setattr(services, "worker_info", broken)
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.switch_page("app_pages/environment.py").run()
    no_exception(at)
    assert "worker info exploded" in problem_text(at)


# ---- network binding ------------------------------------------------------------------------------

@pytest.fixture
def address():
    from streamlit import config

    before = config.get_option("server.address")
    yield lambda value: config.set_option("server.address", value)
    config.set_option("server.address", before)


def test_another_address_is_refused_without_the_flag(address, monkeypatch):
    monkeypatch.delenv("FLEXLAB_ALLOW_REMOTE", raising=False)
    address("0.0.0.0")
    at = AppTest.from_file(ENTRY, default_timeout=60).run()
    no_exception(at)
    assert "loopback interface (127.0.0.1) only" in problem_text(at)
    assert not at.title  # no page is served


def test_another_address_with_the_flag_shows_a_warning_on_every_page(address, monkeypatch):
    monkeypatch.setenv("FLEXLAB_ALLOW_REMOTE", "1")
    address("0.0.0.0")
    for page in ("app_pages/playground.py", "app_pages/gallery.py"):
        at = AppTest.from_file(ENTRY, default_timeout=120)
        at.session_state[experiments.SHAPE_KEY] = dict(TINY)
        at.switch_page(page).run()
        no_exception(at)
        assert any("Anyone who can reach its port can run Python" in w for w in texts(at, "warning"))


# ---- the Benchmarks page --------------------------------------------------------------------------

def test_benchmarks_page_runs_the_tiny_preset_with_progress_and_report():
    at = AppTest.from_file(ENTRY, default_timeout=300)
    at.switch_page("app_pages/benchmarks.py").run()
    assert at.selectbox(key="bm_preset").value == "tiny"  # the only preset offered in CPU mode
    click(at, "bm_run")
    assert not at.error, problem_text(at)
    assert any(s.startswith("tiny:") and "rows written" in s for s in texts(at, "success"))
    assert at.get("plotly_chart")
    click(at, "bm_report")
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Download report.html" in labels and "Download report.md" in labels
    # The same results uploaded twice under the same name (JSON and CSV) load through bench's
    # loader and are compared side by side with the run: one label per content.
    from app.services import bench

    run = at.session_state["bm_runs"]["tiny (this machine)"]
    folder = Path(run["path"])
    for name in ("results.json", "results.csv"):
        data = (folder / name).read_bytes()
        uploaded = bench.load_uploaded(name, data)
        assert len(uploaded["rows"]) == len(run["rows"])
        at.session_state["bm_runs"][f"{name} ({bench.content_key(data)})"] = uploaded
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


def test_the_exported_json_is_the_experiment():
    at = click(playground(CAUSAL), "pg_check_btn")
    data = json.loads(experiments.store().export_json(at.query_params["exp"]))
    assert data["code"] == CAUSAL and data["shape"]["Q_LEN"] == TINY["Q_LEN"]
    assert data["results"]["check"]["fingerprint"]
