"""Playground: write a score_mod / mask_mod, see its mask, block map, scores and Triton code;
check it against float64, benchmark it, compare gradients, export the experiment."""
from __future__ import annotations

import streamlit as st

from app import editor, plots, services, ui
from app.templates import TEMPLATE

st.title("Playground")
lim = services.limits()
if lim.cpu_mode:
    st.info(lim.describe(), icon=":material/computer:")

# ---- shape controls ---------------------------------------------------------------------------
shape = ui.shape_controls()
code = editor.ensure_code(TEMPLATE)

# ---- editor -----------------------------------------------------------------------------------
left, right = st.columns([3, 2], gap="medium")
with left:
    st.markdown("**Code** — define `score_mod(score, b, h, q_idx, kv_idx)` and/or "
                "`mask_mod(b, h, q_idx, kv_idx)`.")
    problem = st.session_state.get("playground_problem")
    annotations = ui.annotations(problem) if problem is not None else None
    code = editor.code_editor(annotations)
    row = st.columns([1, 1, 2])
    run_clicked = row[0].button("Visualise", type="primary", icon=":material/play_arrow:", key="pg_run",
                                help="Check the code in a child process, then draw its mask, "
                                     "block map and scores")
    if row[1].button("Reset to template", key="pg_template"):
        editor.set_code(TEMPLATE)
        ui.clear_playground_results()
        st.rerun()
    row[2].toggle("Plain text editor", key=editor.PLAIN_KEY,
                  help="Use a plain text area instead of the syntax-highlighting editor")

# The code and shape every view below works on: set by the buttons, kept across reruns.
active = ui.active_experiment(code, shape, run_clicked)
prepared = None
if active is not None:
    with st.spinner("Checking the code in a child process…"):
        prepared = services.prepare(active["code"], active["shape"])
    problem = None if prepared["ok"] else prepared["problem"]
    if problem != st.session_state.get("playground_problem"):
        # Draw again so that the editor marks the offending line in its gutter.
        st.session_state["playground_problem"] = problem
        st.rerun()
    if active["code"] != code or active["shape"] != shape:
        left.warning("The code or shape changed since the last run: press **Visualise** "
                     "(or Check, Benchmark, Gradients) to update the views.", icon=":material/edit:")

with left:
    if prepared is not None and not prepared["ok"]:
        ui.show_problem(prepared["problem"])

with right:
    if prepared is None:
        st.caption("Press **Visualise** to see the mask, the block map and the scores.")
    elif prepared["ok"]:
        ui.mismatch_warning(active["code"], active["shape"])
        b, h = ui.head_picker(active["shape"])
        try:
            view = services.mask_view(active["code"], active["shape"], b, h)
            st.plotly_chart(plots.mask_heatmap(view, f"Mask of (b={b}, h={h})"),
                            key="pg_mask_fig", width="stretch")
            st.caption(f"Kept {view['kept']:,} of {view['total']:,} positions "
                       f"({100 * view['kept'] / view['total']:.2f} %), exact."
                       + ("" if view["has_mask"] else " No mask_mod: every position is kept."))
        except services.Unavailable as e:
            st.warning(f"Mask heatmap unavailable: {e}")
        except Exception as e:  # noqa: BLE001 - the user's mod may still fail on real indices
            ui.show_problem(services.as_problem(e, active["code"], "while drawing the mask"))

if prepared is not None and prepared["ok"]:
    a_code, a_shape = active["code"], active["shape"]
    b, h = st.session_state.get("pg_b", 0), st.session_state.get("pg_h", 0)
    tabs = st.tabs(["Block map", "Scores", "Triton code", "Check", "Benchmark", "Gradients",
                    "Export"])
    with tabs[0]:
        ui.block_map_panel(a_code, a_shape, b, h)
    with tabs[1]:
        ui.scores_panel(a_code, a_shape, b, h)
    with tabs[2]:
        for kind in ("score", "mask"):
            source = prepared.get(f"{kind}_source")
            if source:
                st.markdown(f"`{kind}_mod` lowers to:")
                st.code(source, language="python")
        if prepared.get("lowering"):
            st.warning(f"Lowering {prepared['lowering']}")
        st.caption("flexcore inserts these functions into its attention kernel template: the score "
                   "hook runs on every computed block, the mask hook only on partial blocks.")
    with tabs[3]:
        ui.check_panel(a_code, a_shape, b, h)
    with tabs[4]:
        ui.benchmark_panel(a_code, a_shape)
    with tabs[5]:
        ui.gradients_panel(a_code, a_shape)
    with tabs[6]:
        ui.export_panel(a_code, a_shape)
