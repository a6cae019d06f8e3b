"""Playground: write a score_mod / mask_mod, see its mask, block map, scores and Triton code;
check it against float64, compare gradients, benchmark it, sweep S, set it beside another mod,
export the experiment. Every experiment is saved, and the URL names it."""
from __future__ import annotations

import streamlit as st

from app import editor, experiments, panels, plots, services, ui
from app.services import playground
from app.templates import TEMPLATE

st.title("Playground")
lim = services.limits()
if lim.cpu_mode:
    st.info(lim.describe(), icon=":material/computer:")

# ---- the experiment: from the URL or this session, before any widget is drawn ------------------
experiments.sync_with_url()
notice = st.session_state.pop(experiments.NOTICE_KEY, None)
if notice:
    st.warning(notice[0], icon=":material/info:")
    st.code(notice[1], language=None, wrap_lines=True)
code = editor.ensure_code(TEMPLATE)
seed = ui.seed_control()
shape = ui.shape_controls()

# ---- editor -----------------------------------------------------------------------------------
left, right = st.columns([3, 2], gap="medium")
with left:
    mine = experiments.current()
    title = ui.plain_text(mine["name"]) if mine else "New experiment (not saved yet)"
    st.markdown(f"**{title}** — define `score_mod(score, b, h, q_idx, kv_idx)` and/or "
                "`mask_mod(b, h, q_idx, kv_idx)`.")
    problem = st.session_state.get("playground_problem")
    annotations = ui.annotations(problem) if problem is not None else None
    code = editor.code_editor(annotations)
    row = st.columns([1, 1, 2])
    run_clicked = row[0].button("Visualise", type="primary", icon=":material/play_arrow:", key="pg_run",
                                help="Check the code in the worker process, then draw its mask, "
                                     "block map and scores")
    if row[1].button("Reset to template", key="pg_template"):
        editor.set_code(TEMPLATE)
        st.rerun()
    row[2].toggle("Plain text editor", key=editor.PLAIN_KEY,
                  help="Use a plain text area instead of the syntax-highlighting editor")

experiments.autosave(code, shape, seed, force=run_clicked)
ui.experiments_sidebar(code, shape, seed)
with left:
    ui.conflict_banner(code, shape, seed)
fingerprint = services.fingerprint(code, shape, seed)

# The code, shape and seed every view below works on: set by the buttons, kept across reruns.
active = panels.active_experiment(code, shape, seed, run_clicked)
a_fp = services.fingerprint(active["code"], active["shape"], active["seed"])
crash = st.session_state.get("playground_crash")
if crash is not None and (crash["fingerprint"] != a_fp or run_clicked):
    st.session_state.pop("playground_crash")
    crash = None
if crash is not None:
    # The worker died on this code: not again on every rerun, only when asked (Visualise).
    prepared = {"ok": False, "problem": crash["problem"], "log_tail": crash["log_tail"]}
else:
    with st.spinner("Checking the code in the worker process…"):
        prepared = playground.prepare(active["code"], active["shape"], active["seed"])
    if not prepared["ok"] and prepared.get("transient"):
        st.session_state["playground_crash"] = {"fingerprint": a_fp,
                                                "problem": prepared["problem"],
                                                "log_tail": prepared.get("log_tail", "")}
problem = None if prepared["ok"] else prepared["problem"]
if problem != st.session_state.get("playground_problem"):
    # Draw again so that the editor marks the offending line in its gutter.
    st.session_state["playground_problem"] = problem
    st.rerun()
if (active["code"], active["shape"], active["seed"]) != (code, shape, seed):
    left.warning("The code, shape or seed changed since the last run: press **Visualise** "
                 "(or run an action) to update the views.", icon=":material/edit:")

with left:
    if not prepared["ok"]:
        ui.show_problem(prepared["problem"], prepared.get("log_tail", ""))
        if prepared["problem"].kind == "worker":
            st.info("Press **Visualise** to run the code again.", icon=":material/restart_alt:")

with right:
    if prepared["ok"]:
        if prepared.get("mismatch"):
            st.warning("The code sets its own shape names: " + ", ".join(prepared["mismatch"])
                       + ". Its captured tensors follow the code; attention runs with the "
                         "controls' shape.", icon=":material/straighten:")
        b, h = ui.head_picker(active["shape"])
        try:
            view = playground.mask_view(active["code"], active["shape"], active["seed"], b, h)
            st.plotly_chart(plots.mask_heatmap(view, f"Mask of (b={b}, h={h})"),
                            key="pg_mask_fig", width="stretch")
            st.caption(f"Kept {view['kept']:,} of {view['total']:,} positions "
                       f"({100 * view['kept'] / view['total']:.2f} %), exact."
                       + ("" if view["has_mask"] else " No mask_mod: every position is kept."))
        except services.ActionFailed as e:
            ui.show_failure(e)

if prepared["ok"]:
    run = panels.Run(active["code"], active["shape"], active["seed"],
                     int(st.session_state.get("pg_b", 0)), int(st.session_state.get("pg_h", 0)))
    views = {
        "Block map": lambda: panels.block_map_panel(run),
        "Scores": lambda: panels.scores_panel(run),
        "Triton code": lambda: panels.triton_panel(prepared),
        "Check": lambda: panels.check_panel(run, fingerprint),
        "Gradients": lambda: panels.gradients_panel(run, fingerprint),
        "Benchmark": lambda: panels.benchmark_panel(run, fingerprint),
        "Sweep": lambda: panels.sweep_panel(run, fingerprint),
        "Compare": lambda: panels.compare_panel(run, fingerprint),
        "Export": lambda: panels.export_panel(run, fingerprint, (code, shape, seed)),
    }
    # Only the open tab runs (its views may call the worker); switching tabs reruns the page.
    tabs = st.tabs(list(views), key=panels.TAB_KEY, on_change="rerun")
    for tab, draw in zip(tabs, views.values()):
        if tab.open:
            with tab:
                draw()
