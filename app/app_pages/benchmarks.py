"""Benchmarks: run a bench preset here, or load result files; compare them; export a report."""
from __future__ import annotations

import streamlit as st

from app import plots, services, ui
from app.services import bench, tables
from bench import cp as cp_bench

st.title("Benchmarks")
lim = services.limits()
runs: dict = st.session_state.setdefault("bm_runs", {})

run_col, load_col = st.columns(2, gap="large")
with run_col:
    st.subheader("Run a preset on this machine")
    presets = bench.presets()
    allowed = [p for p in presets if not lim.cpu_mode or p == "tiny"] or list(presets)
    preset = st.selectbox("Preset", allowed, key="bm_preset",
                          format_func=lambda p: f"{p} — {presets[p]}" if presets[p] else p)
    if lim.cpu_mode:
        st.caption("CPU mode: only the `tiny` preset runs here in reasonable time (the others "
                   "are GPU grids). CPU timings are **not representative**.")
    if st.button("Run preset", type="primary", key="bm_run"):
        bar = st.progress(0.0, text=f"Running {preset}…")
        try:
            data = bench.run_preset(preset, lambda f, msg: bar.progress(min(1.0, f), text=msg))
            runs[f"{preset} (this machine)"] = data
            st.success(f"{preset}: {len(data['rows'])} rows written to {data['path']}")
        except services.ActionFailed as e:
            ui.show_failure(e)
        bar.empty()

with load_col:
    st.subheader("Load result files")
    uploads = st.file_uploader("results.json or results.csv from `python -m bench run`",
                               type=["json", "csv"], accept_multiple_files=True, key="bm_upload")
    for f in uploads or []:
        data = f.getvalue()
        # Told apart by content: a second results.json is another run, not the same one.
        label = f"{f.name} ({bench.content_key(data)})"
        if label not in runs:
            try:
                runs[label] = bench.load_uploaded(f.name, data)
            except ValueError as e:
                st.error(f"{f.name} could not be loaded.", icon=":material/error:")
                st.code(str(e), language=None, wrap_lines=True)
    found = bench.discovered_results()
    if found:
        pick = st.multiselect("…or runs found under results/ and bench/results/", list(found),
                              key="bm_found")
        for label in pick:
            if label not in runs:
                try:
                    runs[label] = bench.load_results_path(found[label])
                except Exception as e:  # noqa: BLE001 - a folder that is not bench's results
                    st.error(f"{label} could not be loaded.", icon=":material/error:")
                    st.code(str(e), language=None, wrap_lines=True)

if not runs:
    st.info("Run a preset or load result files to see plots.", icon=":material/bar_chart:")
    st.stop()

st.divider()
# Runs that just arrived (run, upload, found) join the comparison; removed ones stay removed.
seen = st.session_state.setdefault("bm_seen", [])
arrived = [label for label in runs if label not in seen]
if arrived:
    kept = [c for c in st.session_state.get("bm_chosen", []) if c in runs]
    st.session_state["bm_chosen"] = kept + arrived
    seen.extend(arrived)
chosen = st.multiselect("Compare", list(runs), key="bm_chosen")
if not chosen:
    st.stop()
metric = st.radio("Metric", ["time_ms", "tflops"], horizontal=True, key="bm_metric",
                  format_func=lambda m: {"time_ms": "median latency (ms)", "tflops": "TFLOP/s"}[m])
table = [r for label in chosen for r in bench.timing_table(runs[label], label)
         if r["metric"] == metric]
if lim.cpu_mode and any("this machine" in c for c in chosen):
    st.caption("Runs made on this machine are CPU timings: not representative.")
label = {"time_ms": "median latency (ms)", "tflops": "TFLOP/s"}[metric]
if table:
    cases = sorted({r["case"] for r in table})
    case = st.selectbox("Case", ["all cases"] + cases, key="bm_case")
    if case == "all cases":
        fig = plots.case_bars(table, f"{label}, every case", label, log_x=metric == "time_ms",
                              side_by_side=len(chosen) > 1)
        shown = table
    else:
        shown = [r for r in table if r["case"] == case]
        fig = plots.value_bars(shown, "provider", "value", f"{label}: {case}", "provider", label,
                               color="file", log=metric == "time_ms", color_title="results")
    st.plotly_chart(fig, key="bm_fig", width="stretch")
    # One row per case, one column per (results, provider): numbers written in full.
    columns = list(dict.fromkeys((r["file"], r["provider"]) for r in shown))
    by_case: dict[str, dict] = {}
    for r in shown:
        by_case.setdefault(r["case"], {})[(r["file"], r["provider"])] = r["value"]
    header = ["case"] + [p if len(chosen) == 1 else f"{p} ({f})" for f, p in columns]
    body = [[c] + [tables.fmt(vals.get(col)) for col in columns] for c, vals in by_case.items()]
    st.markdown(f"**{label}**")
    ui.table((header, body))
else:
    st.warning("No successful timings in the chosen results.")

cp_runs = [label for label in chosen if cp_bench.is_cp_results(runs[label].get("rows", []))]
if cp_runs:
    st.subheader("Context parallel: scaling with the number of GPUs")
    st.caption("From `python -m bench.cp` (torchrun): per-GPU forward+backward TFLOP/s with "
               "density-scaled FLOPs, and the efficiency against one GPU at the same tokens per GPU.")
    cp_label = st.selectbox("Results", cp_runs, key="bm_cp_run") if len(cp_runs) > 1 else cp_runs[0]
    cp_table = cp_bench.scaling_table(runs[cp_label]["rows"])
    cp_variants = sorted({e["variant"] for e in cp_table})
    if cp_variants:
        cp_variant = st.selectbox("Mask", cp_variants, key="bm_cp_variant")
        shown_cp = [e for e in cp_table if e["variant"] == cp_variant]
        for cp_metric in plots.CP_METRICS:
            st.plotly_chart(plots.cp_scaling(shown_cp, cp_metric, f"{cp_variant}: "
                                             f"{plots.CP_METRICS[cp_metric]}"),
                            key=f"bm_cp_{cp_metric}", width="stretch")
        header = ["provider", "global S", "GPUs", "per-GPU TFLOP/s", "efficiency", "median ms",
                  "comm ms", "comm hidden ms"]
        body = [[e["provider"], f"{e['seq']:,}", str(e["gpus"])]
                + [tables.fmt(e.get(k)) for k in ("tflops", "scaling_eff", "time_ms", "comm_ms",
                                                   "comm_hidden_ms")] for e in shown_cp]
        ui.table((header, body))
    else:
        st.warning("These context-parallel results hold no successful timings.")

skipped = [r for label in chosen for r in bench.status_table(runs[label], label)]
if skipped:
    with st.expander(f"Did not run: {len(skipped)} (provider, case) pairs, with the reasons"):
        st.dataframe(skipped, hide_index=True, width="stretch",
                     column_config={"reason": st.column_config.TextColumn("reason", width="large")})

with st.expander("Every row", expanded=False):
    for label in chosen:
        st.markdown(f"**{ui.plain_text(label)}** — {len(runs[label].get('rows', [])):,} rows")
        st.dataframe(runs[label].get("rows", []), hide_index=True, width="stretch",
                     column_config={"value": st.column_config.NumberColumn("value", format="%.6g",
                                                                           width="medium"),
                                    "case_id": st.column_config.TextColumn("case_id",
                                                                           width="large")})

st.subheader("Report")
paths = [runs[label].get("path") for label in chosen]
report_key = (tuple(paths), tuple(chosen))
if all(paths):
    if st.button("Prepare bench's report of the chosen runs", key="bm_report"):
        try:
            with st.spinner("Writing the report…"):
                st.session_state["bm_report_files"] = (report_key,
                                                       bench.report_files(paths, chosen))
        except Exception as e:  # noqa: BLE001 - bench's report refused these results
            st.error("The report failed.", icon=":material/error:")
            st.code(f"{type(e).__name__}: {e}", language=None, wrap_lines=True)
    prepared = st.session_state.get("bm_report_files")
    if prepared and prepared[0] == report_key:
        files = prepared[1]
        cols = st.columns(len(files))
        for col, (ext, data) in zip(cols, sorted(files.items())):
            col.download_button(f"Download report.{ext}", data, file_name=f"bench-report.{ext}",
                                mime="text/html" if ext == "html" else "text/markdown",
                                key=f"bm_dl_{ext}")
    elif prepared:
        st.caption("The report prepared earlier is of other runs; prepare it again.")
