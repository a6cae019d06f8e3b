"""Widgets and panels the pages share: shape controls, inline errors, the Playground's tabs.

Everything here reads widgets and draws results; the work happens in :mod:`app.services`.
"""
from __future__ import annotations

import streamlit as st

from app import plots, services
from app.usercode import CodeProblem

SHAPE_KEY = "playground_shape"


# ---------------------------------------------------------------------------------------------
# Shape and head
# ---------------------------------------------------------------------------------------------

def shape_controls() -> dict:
    """Sidebar controls for B, Hq, Hkv, Q_LEN, KV_LEN, D, dtype and BLOCK_SIZE (kept per session)."""
    lim = services.limits()
    saved = st.session_state.setdefault(SHAPE_KEY, services.default_shape())
    side = st.sidebar
    side.header("Shape")
    if lim.cpu_mode:
        side.caption(f"CPU mode: Q_LEN, KV_LEN ≤ {lim.max_len}; B·Hq ≤ {lim.max_bh}; D ≤ {lim.max_d}.")
    c1, c2, c3 = side.columns(3)
    shape = {
        "B": c1.number_input("B", 1, lim.max_bh, _clip(saved["B"], 1, lim.max_bh), key="shape_B"),
        "Hq": c2.number_input("Hq", 1, lim.max_bh, _clip(saved["Hq"], 1, lim.max_bh), key="shape_Hq",
                              help="query heads"),
        "Hkv": c3.number_input("Hkv", 1, lim.max_bh, _clip(saved["Hkv"], 1, lim.max_bh),
                               key="shape_Hkv", help="key/value heads; Hq must be a multiple"),
    }
    c1, c2 = side.columns(2)
    shape["Q_LEN"] = c1.number_input("Q_LEN", 1, lim.max_len, _clip(saved["Q_LEN"], 1, lim.max_len),
                                     key="shape_Q_LEN")
    shape["KV_LEN"] = c2.number_input("KV_LEN", 1, lim.max_len,
                                      _clip(saved["KV_LEN"], 1, lim.max_len), key="shape_KV_LEN")
    c1, c2 = side.columns(2)
    d_choices = [d for d in (16, 32, 64, 128, 256) if d <= lim.max_d]
    shape["D"] = c1.selectbox("D", d_choices, index=_index(d_choices, saved["D"]), key="shape_D",
                              help="head dim")
    shape["BLOCK_SIZE"] = c2.selectbox("BLOCK_SIZE", lim.block_sizes,
                                       index=_index(lim.block_sizes, saved["BLOCK_SIZE"]),
                                       key="shape_BLOCK_SIZE")
    shape["dtype"] = side.selectbox("dtype", services.DTYPES,
                                    index=_index(services.DTYPES, saved["dtype"]), key="shape_dtype",
                                    help="dtype of Benchmark and Gradients (Check tests every dtype)")
    shape = {k: (int(v) if k not in ("dtype",) else v) for k, v in shape.items()}
    st.session_state[SHAPE_KEY] = shape
    return shape


def _clip(value: int, low: int, high: int) -> int:
    return max(low, min(high, int(value)))


def _index(options, value) -> int:
    options = list(options)
    return options.index(value) if value in options else 0


index_of = _index


def param_controls(variant, key_prefix: str) -> dict:
    """A slider, checkbox or select box per variant parameter, from its schema."""
    values = {}
    for p in variant.params:
        key = f"{key_prefix}_{p.name}"
        if p.type == "bool":
            values[p.name] = st.checkbox(p.name, value=bool(p.default), help=p.help, key=key)
        elif p.type == "choice":
            values[p.name] = st.selectbox(p.name, list(p.choices), index=_index(p.choices, p.default),
                                          help=p.help, key=key)
        elif p.type == "int" and p.high - p.low > 512:
            # A linear slider over a range like [1, 131072] cannot pick small values: offer
            # powers of two (and the bounds and default) instead.
            values[p.name] = int(st.select_slider(p.name, _geometric(int(p.low), int(p.high),
                                                                     int(p.default)),
                                                  value=int(p.default), help=p.help, key=key))
        elif p.type == "int":
            values[p.name] = int(st.slider(p.name, int(p.low), int(p.high), int(p.default),
                                           help=p.help, key=key))
        else:
            values[p.name] = float(st.slider(p.name, float(p.low), float(p.high), float(p.default),
                                             help=p.help, key=key))
    if not variant.params:
        st.caption("This variant has no parameters.")
    return values


def _geometric(low: int, high: int, default: int) -> list[int]:
    values = {low, high, default}
    power = 1
    while power <= high:
        if power >= low:
            values.add(power)
        power *= 2
    return sorted(values)


def clear_playground_results() -> None:
    """Forget the Playground's runs (after its code was replaced)."""
    for key in [k for k in st.session_state if k.startswith(("pg_results_", "pg_bench_",
                                                             "pg_check_req", "pg_grad_req"))
                and not k.endswith("_btn")]:
        del st.session_state[key]
    st.session_state.pop(_ACTIVE_KEY, None)
    st.session_state.pop("playground_problem", None)


def head_picker(shape: dict) -> tuple[int, int]:
    """Which (b, h) the heatmaps show."""
    c1, c2 = st.columns(2)
    b = c1.number_input("batch b", 0, shape["B"] - 1, min(st.session_state.get("pg_b", 0), shape["B"] - 1),
                        key="pg_b")
    h = c2.number_input("head h", 0, shape["Hq"] - 1, min(st.session_state.get("pg_h", 0), shape["Hq"] - 1),
                        key="pg_h")
    return int(b), int(h)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def show_problem(problem: CodeProblem) -> None:
    """An inline error box with the user's line."""
    where = problem.where()
    text = f"**{problem.title}**"
    if where:
        text += f" — line {problem.lineno}"
    text += f"\n\n{problem.message}"
    if problem.line:
        text += f"\n\n```python\n{problem.lineno:>4} | {problem.line.rstrip()}\n```"
    if problem.op:
        text += f"\n\nOperation: `{problem.op}`"
    if problem.kind == "unavailable":
        st.warning(text, icon=":material/construction:")
    else:
        st.error(text, icon=":material/error:")


def annotations(problem: CodeProblem) -> list[dict]:
    if problem.lineno is None:
        return []
    return [{"row": problem.lineno - 1, "column": 0, "type": "error",
             "text": f"{problem.title}: {problem.message}"}]


def unavailable(feature: str, reason: str) -> None:
    st.warning(f"**{feature} is unavailable here.** {reason}", icon=":material/construction:")


# ---------------------------------------------------------------------------------------------
# The Playground's experiment and panels
# ---------------------------------------------------------------------------------------------

_ACTIVE_KEY = "playground_active"
#: Buttons that run the current code (their state is known at the start of the rerun).
_RUN_BUTTONS = ("pg_run", "pg_check_btn", "pg_bench_btn", "pg_grad_btn")


_PENDING_KEY = "playground_pending_click"


def active_experiment(code: str, shape: dict, run_clicked: bool) -> dict | None:
    """The (code, shape) the views show: updated by any run button, and on the first visit."""
    pressed = [k for k in _RUN_BUTTONS[1:] if st.session_state.get(k)]
    if run_clicked or pressed or _ACTIVE_KEY not in st.session_state:
        st.session_state[_ACTIVE_KEY] = {"code": code, "shape": dict(shape)}
    if pressed:
        # Remembered across an st.rerun() (which resets buttons) until its panel handles it.
        st.session_state[_PENDING_KEY] = pressed[0]
    return st.session_state[_ACTIVE_KEY]


def clicked(button_key: str) -> bool:
    """Whether this run button was pressed (in this run, or just before a rerun)."""
    pending = st.session_state.get(_PENDING_KEY) == button_key
    if pending:
        del st.session_state[_PENDING_KEY]
    return bool(st.session_state.get(button_key)) or pending


def mismatch_warning(code: str, shape: dict) -> None:
    try:
        from app.usercode import code_shape_mismatch

        mismatch = code_shape_mismatch(services.load_mods(code, shape), shape)
    except Exception:  # noqa: BLE001 - informative only
        return
    if mismatch:
        st.warning("The code sets its own shape names: " + ", ".join(mismatch) + ". Its captured "
                   "tensors follow the code; attention runs with the controls' shape.",
                   icon=":material/straighten:")


def block_map_panel(code: str, shape: dict, b: int, h: int) -> None:
    try:
        view = services.block_view(code, shape, b, h)
    except services.Unavailable as e:
        unavailable("The block map", str(e))
        return
    except Exception as e:  # noqa: BLE001
        show_problem(services.as_problem(e, code, "while building the block mask"))
        return
    c1, c2 = st.columns([3, 2])
    c1.plotly_chart(plots.block_map(view, f"Block map of (b={b}, h={h}), BLOCK_SIZE "
                                          f"{view['block_size'][0]}×{view['block_size'][1]}"),
                    key="pg_block_fig", width="stretch")
    total = view["full"] + view["partial"] + view["empty"]
    c2.metric("Sparsity (blocks skipped)", f"{view['sparsity']:.1f} %")
    c2.markdown(f"- **full**: {view['full']:,} (computed, no mask_mod)\n"
                f"- **partial**: {view['partial']:,} (computed, then masked)\n"
                f"- **empty**: {view['empty']:,} (skipped)\n\n"
                f"of {total:,} blocks over all (b, h).")
    if "flops_dense" in view:
        saved = view["flops_dense"] - view["flops_sparse"]
        c2.metric("FLOPs saved (forward)", _flops(saved),
                  f"{100 * saved / view['flops_dense']:.1f} % of dense" if view["flops_dense"] else None)
        c2.caption(f"{_flops(view['flops_sparse'])} computed instead of "
                   f"{_flops(view['flops_dense'])}: 2·B·Hq·Q_LEN·KV_LEN·(D + Dv) times the fraction "
                   "of blocks computed (bench.flops).")
    else:
        c2.caption(view.get("flops_error", ""))


def _flops(value: float) -> str:
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} FLOP"


def scores_panel(code: str, shape: dict, b: int, h: int) -> None:
    zero = st.radio("Input scores", ["zeros (shows the score_mod's bias)", "random q·kᵀ-like"],
                    horizontal=True, key="pg_score_input").startswith("zeros")
    try:
        view = services.score_view(code, shape, b, h, zero)
    except services.Unavailable as e:
        unavailable("The score heatmap", str(e))
        return
    except Exception as e:  # noqa: BLE001
        show_problem(services.as_problem(e, code, "while evaluating the mods"))
        return
    if not view["has_score_mod"]:
        st.caption("No score_mod: scores pass through unchanged.")
    st.plotly_chart(plots.score_heatmap(view, f"Scores after score_mod, (b={b}, h={h})"),
                    key="pg_score_fig", width="stretch")
    st.caption(f"Kept scores range from {view['min']:.4g} to {view['max']:.4g}; evaluated through "
               "the generated Triton code.")


def check_panel(code: str, shape: dict, b: int, h: int) -> None:
    dtypes = st.multiselect("dtypes", services.DTYPES, default=list(services.DTYPES),
                            key="pg_check_dtypes")
    st.button("Check", type="primary", key="pg_check_btn",
              help="Run flexcore and compare with the float64 reference")
    if clicked("pg_check_btn"):
        st.session_state["pg_check_req"] = {"code": code, "shape": shape, "dtypes": tuple(dtypes),
                                             "b": b, "h": h}
    req = st.session_state.get("pg_check_req")
    if req is None:
        st.caption("Check runs flexcore's kernel on random inputs in each dtype and compares it "
                   "with the float64 reference. It passes when its error is at most twice torch's "
                   "own error in that dtype (plus a small epsilon).")
        return
    if (req["code"], req["shape"]) != (code, shape):
        st.caption("Results below are for an earlier version of the code or shape.")
    try:
        with st.spinner("Running flexcore and the float64 reference…"):
            result = services.check(req["code"], req["shape"], req["dtypes"], req["b"], req["h"])
    except services.Unavailable as e:
        unavailable("Check", str(e))
        return
    if "problem" in result:
        show_problem(result["problem"])
        return
    st.session_state["pg_results_check"] = result["rows"]
    rows = result["rows"]
    if rows and all(r["passed"] for r in rows):
        st.success("Check passed for " + ", ".join(r["dtype"] for r in rows) + ".",
                   icon=":material/check_circle:")
    elif rows:
        st.error("Check failed for " + ", ".join(r["dtype"] for r in rows if not r["passed"]) + ".",
                 icon=":material/cancel:")
    st.dataframe([{"dtype": r["dtype"], "result": "pass" if r["passed"] else "FAIL",
                   "max |err|": f"{r['max_abs']:.3e}", "mean |err|": f"{r['mean_abs']:.3e}",
                   "torch max |err|": f"{r['torch_max_abs']:.3e}",
                   "threshold": f"{r['threshold']:.3e}"} for r in rows],
                 hide_index=True, width="stretch")
    if result["heatmaps"]:
        which = st.selectbox("Error heatmap of", list(result["heatmaps"]), key="pg_check_heat")
        st.plotly_chart(plots.error_heatmap(result["heatmaps"][which],
                                            f"|flexcore − float64| of (b={req['b']}, h={req['h']}), "
                                            f"{which}"), key="pg_err_fig", width="stretch")


def benchmark_panel(code: str, shape: dict) -> None:
    lim = services.limits()
    if lim.cpu_mode:
        st.warning("CPU mode: these timings are of Triton's interpreter and eager CPU kernels and are "
                   "**not representative** of GPU performance.", icon=":material/timer:")
    st.button("Benchmark", type="primary", key="pg_bench_btn",
              help="Time flexcore and every provider available on this machine")
    if clicked("pg_bench_btn"):
        bar = st.progress(0.0, text="Benchmarking…")
        try:
            result = services.benchmark(code, shape,
                                        progress=lambda f, msg: bar.progress(min(1.0, f), text=msg))
        except services.Unavailable as e:
            result = {"unavailable": str(e)}
        bar.empty()
        st.session_state["pg_bench_result"] = {"code": code, "shape": shape, "result": result}
    stored = st.session_state.get("pg_bench_result")
    if stored is None:
        st.caption("Times flexcore against every provider available here (SDPA backends, "
                   "FlashAttention, torch flex_attention), forward pass, in the sidebar's dtype.")
        return
    if (stored["code"], stored["shape"]) != (code, shape):
        st.caption("Results below are for an earlier version of the code or shape.")
    result = stored["result"]
    if "unavailable" in result:
        unavailable("Benchmark", result["unavailable"])
        return
    if "problem" in result:
        show_problem(result["problem"])
        return
    st.session_state["pg_bench_path"] = result.get("path")
    ran = [r for r in result["rows"] if r.get("ms") is not None]
    st.session_state["pg_results_bench"] = ran
    label = " (CPU: not representative)" if lim.cpu_mode else ""
    if ran:
        c1, c2 = st.columns(2)
        c1.plotly_chart(plots.bars(ran, "provider", "ms", f"Median latency, ms{label}", log_y=True,
                                   text="ms"), key="pg_bench_ms", width="stretch")
        if any(r.get("tflops") is not None for r in ran):
            c2.plotly_chart(plots.bars(ran, "provider", "tflops", f"TFLOP/s{label}", text="tflops"),
                            key="pg_bench_tf", width="stretch")
        st.dataframe([{"provider": r["provider"], "median ms": f"{r['ms']:.4g}",
                       "TFLOP/s": "" if r["tflops"] is None else f"{r['tflops']:.4g}",
                       "max |out − float64|": "" if r["out_max_abs"] is None
                       else f"{r['out_max_abs']:.3e}", "how": r["note"]} for r in ran],
                     hide_index=True, width="stretch")
    others = [r for r in result["rows"] if r.get("ms") is None]
    if others:
        st.markdown("**Not timed here**\n\n" + "\n".join(
            f"- `{r['provider']}` ({r['status']}): {r['note'] or 'no reason given'}" for r in others))


def gradients_panel(code: str, shape: dict) -> None:
    st.button("Gradients", type="primary", key="pg_grad_btn",
              help="Compare dQ, dK, dV and captured-tensor gradients with float64")
    if clicked("pg_grad_btn"):
        st.session_state["pg_grad_req"] = {"code": code, "shape": shape}
    req = st.session_state.get("pg_grad_req")
    if req is None:
        st.caption("Compares dQ, dK, dV and the gradients of captured tensors with "
                   "`requires_grad` against float64, for flexcore and the providers that can "
                   f"express the variant, in {shape['dtype']}.")
        return
    try:
        with st.spinner("Computing gradients…"):
            result = services.gradients(req["code"], req["shape"], req["shape"]["dtype"])
    except services.Unavailable as e:
        unavailable("Gradients", str(e))
        return
    if "problem" in result:
        show_problem(result["problem"])
        return
    st.session_state["pg_results_grad"] = result["rows"]
    for note in result["notes"]:
        if note.startswith("flexcore"):
            st.warning(note, icon=":material/construction:")
    if result["rows"]:
        st.plotly_chart(plots.bars(result["rows"], "tensor", "max_abs",
                                   f"max |grad − float64 grad|, {req['shape']['dtype']}",
                                   color="source", log_y=True), key="pg_grad_fig", width="stretch")
        st.dataframe([{**r, **{k: f"{r[k]:.3e}" for k in ("max_abs", "mean_abs", "rel_fro")}}
                      for r in result["rows"]], hide_index=True, width="stretch")
    others = [n for n in result["notes"] if not n.startswith("flexcore")]
    if others:
        st.markdown("**Not compared**\n\n" + "\n".join(f"- {n}" for n in others))


def export_panel(code: str, shape: dict) -> None:
    results = {k: st.session_state[f"pg_results_{k}"] for k in ("check", "bench", "grad")
               if f"pg_results_{k}" in st.session_state}
    included = {"check": "Check", "grad": "Gradients", "bench": "Benchmark (with bench's report)"}
    st.caption("The export holds the code, the shape" + "".join(
        f", {included[k]}" for k in included if k in results) + ". Run Check, Benchmark or "
        "Gradients to add their results.")
    if st.button("Prepare the report", key="pg_export_btn"):
        try:
            files = services.export(code, shape, results, st.session_state.get("pg_bench_path"))
        except services.Unavailable as e:
            unavailable("bench's report", str(e))
            files = {"json": services.export_json(code, shape, results)}
        st.session_state["pg_export_files"] = files
    files = st.session_state.get("pg_export_files")
    if not files:
        return
    mime = {"json": "application/json", "md": "text/markdown", "html": "text/html"}
    cols = st.columns([1, 1, 1, 3])
    for col, ext in zip(cols, [e for e in ("html", "md", "json") if e in files]):
        col.download_button(f"Download .{ext}", files[ext], file_name=f"flexlab-experiment.{ext}",
                            mime=mime[ext], key=f"pg_dl_{ext}")
