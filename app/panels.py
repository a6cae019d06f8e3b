"""The Playground's tabs: views of the code, and actions whose results the experiment keeps.

Every panel takes the experiment it works on (``Run``: code, shape, seed, (b, h)) and the
fingerprint of the editor's current state, against which kept results are marked stale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import streamlit as st

from app import experiments, plots, services, ui
from app.services import export, playground, tables

#: Buttons that run the current code (their state is known at the start of the rerun).
RUN_BUTTONS = ("pg_run", "pg_check_btn", "pg_grad_btn", "pg_bench_btn", "pg_sweep_btn",
               "pg_compare_btn", "pg_export_btn")
ACTIVE_KEY = "playground_active"
#: The Playground's open tab (a widget key).
TAB_KEY = "pg_tab"
PENDING_KEY = "playground_pending_click"


@dataclass(frozen=True)
class Run:
    """What the views and actions work on."""

    code: str
    shape: dict
    seed: int
    b: int = 0
    h: int = 0

    @property
    def fingerprint(self) -> str:
        return services.fingerprint(self.code, self.shape, self.seed)

    @property
    def name(self) -> str:
        mine = experiments.current()
        return mine["name"] if mine else "playground"


def active_experiment(code: str, shape: dict, seed: int, run_clicked: bool) -> dict:
    """The (code, shape, seed) the views show: updated by any run button, and on the first visit."""
    pressed = [k for k in RUN_BUTTONS[1:] if st.session_state.get(k)]
    if run_clicked or pressed or ACTIVE_KEY not in st.session_state:
        st.session_state[ACTIVE_KEY] = {"code": code, "shape": dict(shape), "seed": seed}
    if pressed:
        # Remembered across an st.rerun() (which resets buttons) until its panel handles it.
        st.session_state[PENDING_KEY] = pressed[0]
    return st.session_state[ACTIVE_KEY]


def clicked(button_key: str) -> bool:
    """Whether this run button was pressed (in this run, or just before a rerun)."""
    pending = st.session_state.get(PENDING_KEY) == button_key
    if pending:
        del st.session_state[PENDING_KEY]
    return bool(st.session_state.get(button_key)) or pending


#: ``progress(fraction, text)``: what a long action reports while it runs.
Progress = Callable[[float, str], None]


def action(kind: str, run: Run, fingerprint: str, *, key: str, label: str, help: str | None,
           busy: str, work: Callable[[Progress | None], dict], params: dict, intro: str,
           ready: bool = True, progress: bool = False) -> dict | None:
    """An action's button, run, keep and stale cycle; the record to show, or None.

    Draws the button ``key``; when it was pressed (and ``ready``), runs ``work`` under a spinner
    (or a progress bar fed to ``work`` when ``progress``) and keeps its data with the experiment
    as ``kind`` with ``params``; a failure shows as an error box. Then returns the kept record,
    marked when it was computed from other code, shape or seed than ``fingerprint``'s, or shows
    ``intro`` when there is none.
    """
    st.button(label, type="primary", key=key, help=help)
    if clicked(key) and ready:
        try:
            if progress:
                bar = st.progress(0.0, text=busy)
                try:
                    data = work(lambda f, msg: bar.progress(min(1.0, max(0.0, f)), text=msg or busy))
                finally:
                    bar.empty()
            else:
                with st.spinner(busy):
                    data = work(None)
            rec = export.make_record(kind, run.fingerprint, data, params)
            experiments.record(kind, rec, run.code, run.shape, run.seed)
        except services.ActionFailed as e:
            ui.show_failure(e)
    rec = experiments.results().get(kind)
    if rec is None:
        st.caption(intro)
        return None
    ui.stale_note(rec, fingerprint)
    return rec


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------

def block_map_panel(run: Run) -> None:
    try:
        view = playground.block_view(run.code, run.shape, run.seed, run.b, run.h)
    except services.ActionFailed as e:
        ui.show_failure(e)
        return
    c1, c2 = st.columns([3, 2])
    c1.plotly_chart(plots.block_map(view, f"Block map of (b={run.b}, h={run.h}), BLOCK_SIZE "
                                          f"{view['block_size'][0]}×{view['block_size'][1]}"),
                    key="pg_block_fig", width="stretch")
    total = view["full"] + view["partial"] + view["empty"]
    c2.metric("Sparsity (blocks skipped)", f"{view['sparsity']:.1f} %")
    c2.markdown(f"- **full**: {view['full']:,} (computed, no mask_mod)\n"
                f"- **partial**: {view['partial']:,} (computed, then masked)\n"
                f"- **empty**: {view['empty']:,} (skipped)\n\n"
                f"of {total:,} blocks over all (b, h).")
    saved = view["flops_dense"] - view["flops_sparse"]
    c2.metric("FLOPs saved (forward)", _flops(saved),
              f"{100 * saved / view['flops_dense']:.1f} % of dense" if view["flops_dense"] else None)
    c2.caption(f"{_flops(view['flops_sparse'])} computed instead of {_flops(view['flops_dense'])}: "
               "4·B·Hq·Q_LEN·KV_LEN·D times the fraction of blocks computed (bench.flops).")


def _flops(value: float) -> str:
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} FLOP"


def scores_panel(run: Run) -> None:
    zero = st.radio("Input scores", ["zeros (shows the score_mod's bias)", "random q·kᵀ-like"],
                    horizontal=True, key="pg_score_input").startswith("zeros")
    c1, c2 = st.columns(2)
    with c1:
        try:
            view = playground.score_view(run.code, run.shape, run.seed, run.b, run.h, zero)
        except services.ActionFailed as e:
            ui.show_failure(e)
        else:
            if not view["has_score_mod"]:
                st.caption("No score_mod: scores pass through unchanged.")
            what = "bias (score_mod of zero scores)" if zero else "scores after score_mod"
            st.plotly_chart(plots.value_heatmap(view, f"{what.capitalize()}, (b={run.b}, "
                                                      f"h={run.h})", "bias" if zero else "score"),
                            key="pg_score_fig", width="stretch")
            st.caption(f"Kept values range from {tables.fmt(view['min'])} to "
                       f"{tables.fmt(view['max'])}; evaluated through the generated Triton code; "
                       "masked positions are blank.")
    with c2:
        try:
            probs = playground.probs_view(run.code, run.shape, run.seed, run.b, run.h)
        except services.ActionFailed as e:
            ui.show_failure(e)
            return
    c2.plotly_chart(plots.probability_heatmap(probs, f"Attention probabilities (after softmax), "
                                                     f"(b={run.b}, h={run.h})"),
                    key="pg_probs_fig", width="stretch")
    c2.caption("softmax over keys of score_mod(q·kᵀ/√D) with q, k drawn from the seed, on a log "
               f"scale; kept probabilities range from {tables.fmt(probs['min'])} to "
               f"{tables.fmt(probs['max'])}"
               + (f"; {probs['empty_rows']:,} rows keep no key (blank)." if probs["empty_rows"]
                  else "."))


def triton_panel(prepared: dict) -> None:
    for kind in ("score", "mask"):
        source = prepared.get(f"{kind}_source")
        if source:
            st.markdown(f"`{kind}_mod` lowers to:")
            st.code(source, language="python")
    st.caption("flexcore inserts these functions into its attention kernel template: the score "
               "hook runs on every computed block, the mask hook only on partial blocks.")


# ---------------------------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------------------------

def check_panel(run: Run, fingerprint: str) -> None:
    dtypes = st.multiselect("dtypes", services.DTYPES, default=list(services.DTYPES),
                            key="pg_check_dtypes")
    rec = action("check", run, fingerprint, key="pg_check_btn", label="Check",
                 help="Run flexcore and compare with the float64 reference",
                 busy="Running flexcore and the float64 reference…", ready=bool(dtypes),
                 work=lambda _: playground.check(run.code, run.shape, run.seed, dtypes, run.b,
                                                 run.h),
                 params={"dtypes": dtypes, "b": run.b, "h": run.h},
                 intro="Check runs flexcore's kernel on random inputs (from the seed) in each dtype "
                       "and compares it with the float64 reference. It passes when its error is at "
                       "most twice the eager reference's own error in that dtype, plus a small "
                       "epsilon.")
    if rec is None:
        return
    rows = rec["data"]["rows"]
    if rows and all(r["passed"] for r in rows):
        st.success("Check passed for " + ", ".join(r["dtype"] for r in rows) + ".",
                   icon=":material/check_circle:")
    elif rows:
        st.error("Check failed for " + ", ".join(r["dtype"] for r in rows if not r["passed"]) + ".",
                 icon=":material/cancel:")
    ui.table(tables.check_table(rows))
    heatmaps = rec["data"].get("heatmaps") or {}
    if heatmaps:
        which = st.selectbox("Error heatmap of", list(heatmaps), key="pg_check_heat")
        p = rec["params"]
        st.plotly_chart(plots.error_heatmap(heatmaps[which], f"|flexcore − float64| of "
                                                             f"(b={p['b']}, h={p['h']}), {which}"),
                        key="pg_err_fig", width="stretch")


def gradients_panel(run: Run, fingerprint: str) -> None:
    rec = action("grad", run, fingerprint, key="pg_grad_btn", label="Gradients",
                 help="Compare dQ, dK, dV and captured-tensor gradients with float64",
                 busy="Computing gradients…",
                 work=lambda _: playground.gradients(run.code, run.shape, run.seed),
                 params={"dtype": run.shape["dtype"]},
                 intro="Compares dQ, dK, dV and the gradients of captured tensors with "
                       "`requires_grad` against float64, for flexcore and the providers that can "
                       f"express the variant, in {run.shape['dtype']}. A gradient passes when its "
                       "error is at most twice the eager reference's own error in that dtype, plus "
                       "a small epsilon (as Check).")
    if rec is None:
        return
    data = rec["data"]
    rows = data["rows"]
    judged = [r for r in rows if r.get("passed") is not None]
    failed = [f"{r['source']} {r['tensor']}" for r in judged if not r["passed"]]
    if judged and not failed:
        st.success(f"Every gradient passed ({len(judged)} compared, {rec['params']['dtype']}).",
                   icon=":material/check_circle:")
    elif failed:
        st.error("Gradients over the threshold: " + ", ".join(failed) + ".", icon=":material/cancel:")
    if rows:
        st.plotly_chart(plots.gradient_errors(rows, f"max |grad − float64 grad|, "
                                                    f"{rec['params']['dtype']}"),
                        key="pg_grad_fig", width="stretch")
        ui.table(tables.gradient_table(rows))
    if data["notes"]:
        st.markdown("**Not compared**")
        st.code("\n".join(data["notes"]), language=None, wrap_lines=True)


def benchmark_panel(run: Run, fingerprint: str) -> None:
    lim = services.limits()
    if lim.cpu_mode:
        st.warning("CPU mode: these timings are of Triton's interpreter and eager CPU kernels and are "
                   "**not representative** of GPU performance.", icon=":material/timer:")
    names = {"forward": "fwd", "forward+backward": "fwd_bwd"}
    chosen = st.multiselect("Passes", list(names), default=list(names), key="pg_bench_passes",
                            help="The backward alone is shown as (forward+backward − forward).")
    passes = [names[c] for c in chosen]
    rec = action("bench", run, fingerprint, key="pg_bench_btn", label="Benchmark",
                 help="Time flexcore and every provider available on this machine",
                 busy="Benchmarking…", ready=bool(passes), progress=True,
                 work=lambda progress: playground.benchmark(run.code, run.shape, run.seed, run.name,
                                                            passes, run.fingerprint, progress),
                 params={"passes": passes},
                 intro="Times flexcore against every provider available here (SDPA backends, "
                       "FlashAttention, torch flex_attention): forward, backward and "
                       "forward+backward latency and peak memory, in the sidebar's dtype.")
    if rec is None:
        return
    rows = rec["data"]["rows"]
    summary = playground.benchmark_summary(rows)
    note = playground.cpu_note()
    latency = playground.latency_rows(summary)
    if latency:
        st.plotly_chart(plots.latency_bars(latency, f"Median latency{note}"), key="pg_bench_ms",
                        width="stretch")
        st.caption("The backward alone is forward+backward − forward of the same provider; it is "
                   "left out where timing noise makes that difference negative.")
        timed = [{"provider": s["label"], "pass": tables.PASS_NAMES.get(s["pass"], s["pass"]),
                  "tflops": s["tflops"], "peak_mib": (s["peak_bytes"] or 0) / 2**20}
                 for s in summary if s["ms"] is not None]
        c1, c2 = st.columns(2)
        c1.plotly_chart(plots.value_bars(timed, "provider", "tflops", f"Throughput{note}",
                                         "provider", "TFLOP/s", color="pass"),
                        key="pg_bench_tf", width="stretch")
        c2.plotly_chart(plots.value_bars(timed, "provider", "peak_mib", "Peak memory of one call"
                                         + (" (process RSS on the CPU)" if note else ""),
                                         "provider", "peak memory (MiB)", color="pass"),
                        key="pg_bench_mem", width="stretch")
        ui.table(tables.benchmark_table(summary))
    _not_timed(rows, "Not timed here: {n} (provider, pass) pairs, with the reasons")


def _not_timed(rows: list[dict], title: str) -> None:
    """The (provider, case) pairs of bench's rows that did not run, with bench's reasons, under
    an expander titled ``title`` (``{n}``: how many)."""
    others = playground.not_timed(rows)
    if others:
        with st.expander(title.format(n=len(others))):
            ui.table((list(others[0]), [[str(v) for v in r.values()] for r in others]))


def sweep_panel(run: Run, fingerprint: str) -> None:
    lim = services.limits()
    try:
        available = [p for p in playground.providers() if p["available"]]
    except services.ActionFailed as e:
        ui.show_failure(e)
        return
    labels = {services.provider_label(p["name"]): p["name"] for p in available
              if p["name"] != "flexlab_paged"}
    c1, c2, c3 = st.columns([2, 1, 2])
    lengths = c1.multiselect("S = Q_LEN = KV_LEN", list(lim.sweep_lengths),
                             default=list(lim.sweep_lengths), key="pg_sweep_lengths")
    pass_ = c2.radio("Pass", ["forward", "forward+backward"], key="pg_sweep_pass")
    default = [n for n in labels if n in ("flexcore", "sdpa_math", "torch_flex", "sdpa_flash",
                                          "sdpa_cudnn")]
    chosen = c3.multiselect("Providers", list(labels), default=default, key="pg_sweep_providers")
    p = "fwd" if pass_ == "forward" else "fwd_bwd"
    providers = [labels[c] for c in chosen]
    rec = action("sweep", run, fingerprint, key="pg_sweep_btn", label="Run the sweep",
                 help="Latency and TFLOP/s of each provider at each sequence length",
                 busy="Sweeping…", ready=bool(lengths and chosen), progress=True,
                 work=lambda progress: playground.sweep(run.code, run.shape, run.seed, run.name,
                                                        lengths, p, providers, run.fingerprint,
                                                        progress),
                 params={"pass": pass_, "lengths": sorted(lengths), "providers": chosen},
                 intro="Runs the variant at each sequence length (B, heads and D from the sidebar; "
                       "the code runs again at each length, so captured tensors sized from Q_LEN "
                       "and KV_LEN follow).")
    if rec is None:
        return
    rows = playground.sweep_rows(rec["data"]["rows"])
    note = playground.cpu_note()
    if rows:
        c1, c2 = st.columns(2)
        c1.plotly_chart(plots.sweep_lines(rows, "ms", f"Latency against S, {rec['params']['pass']}"
                                          f"{note}"), key="pg_sweep_ms", width="stretch")
        c2.plotly_chart(plots.sweep_lines(rows, "tflops", f"TFLOP/s against S, "
                                          f"{rec['params']['pass']}{note}"),
                        key="pg_sweep_tf", width="stretch")
        ui.table(tables.sweep_table(rows))
    _not_timed(rec["data"]["rows"], "Not timed: {n} (provider, length) pairs, with the reasons")


def compare_panel(run: Run, fingerprint: str) -> None:
    source = st.radio("Compare with", ["a gallery variant", "a saved experiment"], horizontal=True,
                      key="pg_compare_source")
    other_code = other_label = None
    if source == "a gallery variant":
        names = [v["name"] for v in services.gallery.variant_catalog()]
        name = st.selectbox("Variant (default parameters, at this shape)", names,
                            index=ui.index_of(names, "causal"), key="pg_compare_variant")
        v = services.gallery.variant(name)
        other_code = services.gallery.variant_source(name, v.defaults(), run.shape)
        other_label = name
    else:
        mine = experiments.current()
        listed = [e for e in experiments.store().list() if not mine or e["id"] != mine["id"]]
        if not listed:
            st.caption("No other saved experiment yet.")
            return
        pick = st.selectbox("Experiment", [e["id"] for e in listed], key="pg_compare_exp",
                            format_func=lambda i: next(e["name"] for e in listed if e["id"] == i))
        other = experiments.store().get(pick)
        other_code, other_label = other.code, other.name
    time_it = st.checkbox("Time both (flexcore, forward)", value=True, key="pg_compare_time")
    key = services.fingerprint(other_code, run.shape, run.seed)
    rec = action("compare", run, fingerprint, key="pg_compare_btn", label="Compare", help=None,
                 busy="Comparing…", progress=True,
                 work=lambda progress: playground.compare(
                     run.code, other_code, "this experiment", other_label, run.shape, run.seed,
                     run.b, run.h, time_it, f"{run.fingerprint}-{key}", progress),
                 params={"other": other_label, "other_code": other_code, "b": run.b, "h": run.h},
                 intro="Sets the experiment beside another mod at the same shape and seed: masks, "
                       "block sparsity, where the masks differ, how far the outputs are apart, and "
                       "flexcore's latency of each.")
    if rec is None:
        return
    data = rec["data"]
    a, b_ = data["labels"]
    p = rec["params"]
    st.markdown(f"**{ui.plain_text(a)}** and **{ui.plain_text(b_)}**, (b={p['b']}, h={p['h']})")
    cols = st.columns(2)
    for i, col in enumerate(cols):
        col.plotly_chart(plots.mask_heatmap(data["masks"][i], f"Mask: {data['labels'][i]}"),
                         key=f"pg_cmp_mask_{i}", width="stretch")
        col.plotly_chart(plots.block_map(data["blocks"][i], f"Block map: {data['labels'][i]}, "
                                         f"{data['blocks'][i]['sparsity']:.1f} % skipped"),
                         key=f"pg_cmp_blocks_{i}", width="stretch")
    ui.table(tables.compare_table(data))
    d = data["mask_difference"]
    c1, c2 = st.columns(2)
    c1.plotly_chart(plots.mask_difference(d, "Where the masks differ", data["labels"]),
                    key="pg_cmp_diff", width="stretch")
    c1.caption(f"Both keep {d['both']:,} positions; only {a} keeps {d['only_a']:,}; only {b_} "
               f"keeps {d['only_b']:,} (of {d['total']:,}).")
    o = data["outputs"]
    c2.plotly_chart(plots.error_heatmap(o["heatmap"], f"|out({a}) − out({b_})|, flexcore, "
                                                      f"{run.shape['dtype']}", "|difference|"),
                    key="pg_cmp_out", width="stretch")
    c2.caption(f"Outputs on the same q, k, v: max |difference| {tables.fmt(o['max_abs'], 'err')}, "
               f"mean {tables.fmt(o['mean_abs'], 'err')}, relative (Frobenius) "
               f"{tables.fmt(o['rel_fro'], 'err')}.")


def export_panel(run: Run, fingerprint: str, editor_state: tuple) -> None:
    """The report of the editor's current code: only results computed from it are included."""
    code, shape, seed = editor_state
    results = experiments.results()
    current = [export.TITLES[k] for k in export.TITLES
               if export.is_current(results.get(k), fingerprint)]
    stale = [export.TITLES[k] for k in export.TITLES
             if results.get(k) and not export.is_current(results.get(k), fingerprint)]
    st.caption("The report holds the code, shape, seed, mask and block-map images"
               + "".join(f", {t}" for t in current) + ". Results computed from other code, shape "
               "or seed are left out" + (f" (now: {', '.join(stale)})." if stale else "."))
    st.button("Prepare the report", key="pg_export_btn")
    if clicked("pg_export_btn"):
        prepared = playground.prepare(code, shape, seed)
        if not prepared["ok"]:
            ui.show_problem(prepared["problem"], prepared.get("log_tail", ""))
        else:
            try:
                with st.spinner("Drawing the images and writing the report…"):
                    mask = playground.mask_view(code, shape, seed, 0, 0)
                    blocks = playground.block_view(code, shape, seed, 0, 0)
                    images = {"mask": export.mask_png(mask, "Mask of (b=0, h=0)"),
                              "block_map": export.block_png(blocks, "Block map of (b=0, h=0)")}
                    files = export.report(run.name, code, shape, seed, fingerprint, results, images,
                                          services.provenance())
                st.session_state["pg_export"] = {"fingerprint": fingerprint, "files": files}
            except services.ActionFailed as e:
                ui.show_failure(e)
    prepared = st.session_state.get("pg_export")
    if not prepared:
        return
    if prepared["fingerprint"] != fingerprint:
        st.warning("The report prepared earlier is stale: the code, shape or seed changed since. "
                   "It cannot be downloaded; prepare it again.", icon=":material/history:")
        return
    stem = ui.file_stem(run.name)
    c1, c2, _ = st.columns([1, 1, 3])
    c1.download_button("Download .html", prepared["files"]["html"], file_name=f"{stem}.html",
                       mime="text/html", key="pg_dl_html")
    c2.download_button("Download .zip", prepared["files"]["zip"], file_name=f"{stem}.zip",
                       mime="application/zip", key="pg_dl_zip",
                       help="report.md with the mask and block-map PNGs beside it, and the "
                            "experiment as JSON")
