"""Benchmarks: run a bench preset here, or load result files; compare them; export a report."""
from __future__ import annotations

import streamlit as st

from app import plots, services, ui

st.title("Benchmarks")
lim = services.limits()
runs: dict = st.session_state.setdefault("bm_runs", {})

run_col, load_col = st.columns(2, gap="large")
with run_col:
    st.subheader("Run a preset on this machine")
    try:
        presets = services.presets()
    except services.Unavailable as e:
        ui.unavailable("Running presets", str(e))
        presets = {}
    if presets:
        allowed = [p for p in presets if not lim.cpu_mode or p == "tiny"] or list(presets)
        preset = st.selectbox("Preset", allowed, key="bm_preset",
                              format_func=lambda p: f"{p} — {presets[p]}" if presets[p] else p)
        if lim.cpu_mode:
            st.caption("CPU mode: only the `tiny` preset runs here in reasonable time (the others "
                       "are GPU grids). CPU timings are **not representative**.")
        if st.button("Run preset", type="primary", key="bm_run"):
            bar = st.progress(0.0, text=f"Running {preset}…")
            try:
                data = services.run_preset(preset, lambda f, msg: bar.progress(min(1.0, f), text=msg))
                runs[f"{preset} (this machine)"] = data
                st.success(f"{preset}: {len(data['rows'])} rows written to {data['path']}")
            except services.Unavailable as e:
                ui.unavailable("Running presets", str(e))
            except Exception as e:  # noqa: BLE001 - a failed run is reported, the page stays
                st.error(f"The run failed: {type(e).__name__}: {e}", icon=":material/error:")
            bar.empty()

with load_col:
    st.subheader("Load result files")
    uploads = st.file_uploader("results.json or results.csv from `python -m bench run`",
                               type=["json", "csv"], accept_multiple_files=True, key="bm_upload")
    for f in uploads or []:
        label = f"{f.name} (uploaded)"
        if label not in runs:
            try:
                runs[label] = services.load_uploaded(f.name, f.getvalue())
            except services.Unavailable as e:
                ui.unavailable("Loading results", str(e))
            except Exception as e:  # noqa: BLE001
                st.error(str(e), icon=":material/error:")
    found = services.discovered_results()
    if found:
        pick = st.multiselect("…or runs found under results/", list(found), key="bm_found")
        for label in pick:
            if label not in runs:
                try:
                    runs[label] = services.load_results_path(found[label])
                except Exception as e:  # noqa: BLE001
                    st.error(f"{label}: {e}", icon=":material/error:")

if not runs:
    st.info("Run a preset or load result files to see plots.", icon=":material/bar_chart:")
    st.stop()

st.divider()
# Runs that just arrived (run, upload, found) join the comparison; removed ones stay removed.
seen = st.session_state.setdefault("bm_seen", [])
arrived = [label for label in runs if label not in seen]
if arrived:
    st.session_state["bm_chosen"] = [c for c in st.session_state.get("bm_chosen", []) if c in runs] + arrived
    seen.extend(arrived)
chosen = st.multiselect("Compare", list(runs), key="bm_chosen")
if not chosen:
    st.stop()
metric = st.radio("Metric", ["time_ms", "tflops"], horizontal=True, key="bm_metric",
                  format_func=lambda m: {"time_ms": "median latency (ms)", "tflops": "TFLOP/s"}[m])
table = [r for label in chosen for r in services.timing_table(runs[label], label)
         if r["metric"] == metric]
if lim.cpu_mode and any("this machine" in c for c in chosen):
    st.caption("Runs made on this machine are CPU timings: not representative.")
if table:
    cases = sorted({r["case"] for r in table})
    case = st.selectbox("Case", ["all cases"] + cases, key="bm_case")
    label = {"time_ms": "median latency, ms", "tflops": "TFLOP/s"}[metric]
    if case == "all cases":
        fig = plots.case_bars(table, f"{label}, every case", label, log_x=metric == "time_ms",
                              side_by_side=len(chosen) > 1)
    else:
        rows = [r for r in table if r["case"] == case]
        fig = plots.bars(rows, "provider", "value", f"{label}: {case}", color="file", text="value")
    st.plotly_chart(fig, key="bm_fig", width="stretch")
    st.dataframe(table if case == "all cases" else rows, hide_index=True, width="stretch")
else:
    st.warning("No successful timings in the chosen results.")

skipped = [r for label in chosen for r in services.status_table(runs[label], label)]
if skipped:
    with st.expander(f"Did not run: {len(skipped)} (provider, case) pairs, with the reasons"):
        st.dataframe(skipped, hide_index=True, width="stretch")

with st.expander("Every row", expanded=False):
    for label in chosen:
        st.markdown(f"**{label}** — {len(runs[label].get('rows', []))} rows")
        st.dataframe(runs[label].get("rows", []), hide_index=True, width="stretch")

st.subheader("Report")
paths = [runs[label].get("path") for label in chosen]
if all(paths):
    try:
        files = services.report_files(paths, chosen)
        cols = st.columns(len(files))
        for col, (ext, data) in zip(cols, sorted(files.items())):
            col.download_button(f"Download report.{ext}", data, file_name=f"bench-report.{ext}",
                                mime="text/html" if ext == "html" else "text/markdown",
                                key=f"bm_dl_{ext}")
    except services.Unavailable as e:
        ui.unavailable("Report export", str(e))
    except Exception as e:  # noqa: BLE001
        st.error(f"The report failed: {type(e).__name__}: {e}", icon=":material/error:")
