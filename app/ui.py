"""Widgets the pages share: shape and seed controls, the experiments sidebar, problems as text,
result tables, and the remote-binding banner.

Everything here reads widgets and draws results; the work happens in :mod:`app.services`.
"""
from __future__ import annotations

import re

import streamlit as st

from app import experiments, services
from app.names import file_safe
from app.services import tables
from app.usercode import CodeProblem

SHAPE_KEY = experiments.SHAPE_KEY


# ---------------------------------------------------------------------------------------------
# Shape, seed and head
# ---------------------------------------------------------------------------------------------

def shape_controls() -> dict:
    """Sidebar controls for B, Hq, Hkv, Q_LEN, KV_LEN, D, dtype and BLOCK_SIZE (kept per session)."""
    lim = services.limits()
    saved = {**services.default_shape(), **st.session_state.get(SHAPE_KEY, {})}
    side = st.sidebar
    side.subheader("Shape")
    if lim.cpu_mode:
        side.caption(f"CPU mode: Q_LEN, KV_LEN ≤ {lim.max_len}; B·Hq ≤ {lim.max_bh}; "
                     f"D ≤ {lim.max_d}.")
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
    shape["D"] = c1.selectbox("D", d_choices, index=index_of(d_choices, saved["D"]), key="shape_D",
                              help="head dim")
    shape["BLOCK_SIZE"] = c2.selectbox("BLOCK_SIZE", lim.block_sizes,
                                       index=index_of(lim.block_sizes, saved["BLOCK_SIZE"]),
                                       key="shape_BLOCK_SIZE")
    shape["dtype"] = side.selectbox("dtype", services.DTYPES,
                                    index=index_of(services.DTYPES, saved["dtype"]),
                                    key="shape_dtype",
                                    help="dtype of Benchmark, Gradients, Sweep and Compare (Check "
                                         "tests every dtype you pick)")
    shape = {k: (int(v) if k != "dtype" else v) for k, v in shape.items()}
    st.session_state[SHAPE_KEY] = shape
    return shape


def seed_control() -> int:
    """The seed of the inputs and of the code's own random tensors (fixed unless changed)."""
    value = st.sidebar.number_input(
        "Seed", 0, 2**31 - 1, experiments.seed(), key="seed_input",
        help="Seeds q, k, v and torch's generator before your code runs, so `torch.randn` in "
             "your code gives the same captured tensors to the reference and every candidate.")
    st.session_state[experiments.SEED_KEY] = int(value)
    return int(value)


def _clip(value: int, low: int, high: int) -> int:
    return max(low, min(high, int(value)))


def index_of(options, value) -> int:
    options = list(options)
    return options.index(value) if value in options else 0


def param_controls(variant, key_prefix: str) -> dict:
    """A slider, checkbox or select box per variant parameter, from its schema."""
    values = {}
    for p in variant.params:
        key = f"{key_prefix}_{p.name}"
        if p.type == "bool":
            values[p.name] = st.checkbox(p.name, value=bool(p.default), help=p.help, key=key)
        elif p.type == "choice":
            values[p.name] = st.selectbox(p.name, list(p.choices), index=index_of(p.choices, p.default),
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


def head_picker(shape: dict) -> tuple[int, int]:
    """Which (b, h) the heatmaps show."""
    c1, c2 = st.columns(2)
    b = c1.number_input("batch b", 0, shape["B"] - 1,
                        min(st.session_state.get("pg_b", 0), shape["B"] - 1), key="pg_b")
    h = c2.number_input("head h", 0, shape["Hq"] - 1,
                        min(st.session_state.get("pg_h", 0), shape["Hq"] - 1), key="pg_h")
    return int(b), int(h)


# ---------------------------------------------------------------------------------------------
# The experiments sidebar
# ---------------------------------------------------------------------------------------------

def experiments_sidebar(code: str, shape: dict, seed: int) -> None:
    """List, open, create, duplicate, rename, delete, import and export experiments."""
    side = st.sidebar
    side.subheader("Experiment")
    store = experiments.store()
    listed = store.list()
    mine = experiments.current()
    ids = [e["id"] for e in listed]
    names = {e["id"]: e["name"] for e in listed}
    if mine is None:
        side.caption("Not saved yet: saved at your first edit or run.")
    if ids:
        choice = side.selectbox(
            "Open", [None, *ids] if mine is None else ids,
            index=0 if mine is None or mine["id"] not in ids else ids.index(mine["id"]),
            format_func=lambda i: "—" if i is None else f"{names[i]}  ·  {i}",
            key=f"exp_open_{mine['id'] if mine else 'draft'}")
        if choice is not None and (mine is None or choice != mine["id"]):
            experiments.load(store.get(choice))
            st.rerun()
    c1, c2 = side.columns(2)
    if c1.button("New", key="exp_new", icon=":material/add:", width="stretch"):
        from app.templates import TEMPLATE

        experiments.open_new(TEMPLATE, experiments.default_name(), shape)
        st.rerun()
    if mine is not None:
        if c2.button("Duplicate", key="exp_duplicate", icon=":material/content_copy:",
                     width="stretch"):
            experiments.load(store.duplicate(mine["id"]))
            st.rerun()
        with side.expander("Rename, delete, export"):
            name = st.text_input("Name", mine["name"], key=f"exp_rename_{mine['id']}")
            if st.button("Rename", key="exp_rename_btn") and name != mine["name"]:
                experiments.rename(name)
                st.rerun()
            st.download_button("Export as JSON", lambda: store.export_json(mine["id"]),
                               file_name=f"{file_stem(mine['name'])}.json",
                               mime="application/json", key="exp_export", icon=":material/download:")
            confirm_key = f"exp_confirm_{mine['id']}"
            if not st.session_state.get(confirm_key):
                if st.button("Delete…", key="exp_delete", icon=":material/delete:"):
                    st.session_state[confirm_key] = True
                    st.rerun()
            else:
                st.warning(f"Delete “{plain_text(mine['name'])}” and its results for good?")
                d1, d2 = st.columns(2)
                if d1.button("Delete", type="primary", key="exp_delete_yes"):
                    store.delete(mine["id"])
                    experiments.start_draft()
                    st.rerun()
                if d2.button("Cancel", key="exp_delete_no"):
                    del st.session_state[confirm_key]
                    st.rerun()
    upload = side.file_uploader("Import an experiment (JSON)", type=["json"], key="exp_import")
    if upload is not None:
        error = experiments.import_upload(upload.getvalue())
        if error:
            side.error("The import failed.", icon=":material/error:")
            side.code(error, language=None, wrap_lines=True)
        elif experiments.current() is not None and experiments.current() != mine:
            st.rerun()


def file_stem(name: str) -> str:
    """``name`` as a download's file name stem."""
    return file_safe(name, "experiment", sep="-", keep="._-")


def conflict_banner(code: str, shape: dict, seed: int) -> None:
    """When a save was refused (another tab saved first): say so and offer both ways out."""
    message = st.session_state.get(experiments.CONFLICT_KEY)
    if not message:
        return
    st.error("This experiment changed in another tab or window; your edits here are not saved.",
             icon=":material/sync_problem:")
    st.code(message, language=None, wrap_lines=True)
    c1, c2 = st.columns(2)
    if c1.button("Load the saved version", key="conflict_reload", width="stretch"):
        experiments.reload_saved()
        st.rerun()
    if c2.button("Keep mine as new", type="primary", key="conflict_keep", width="stretch",
                 help="Save this tab's code, shape, seed and results as a new experiment"):
        experiments.keep_as_new(code, shape, seed)
        st.rerun()


# ---------------------------------------------------------------------------------------------
# Problems, shown as text
# ---------------------------------------------------------------------------------------------

_MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]<>$~#|])")


def plain_text(text: str) -> str:
    """Text safe inside a Markdown element (identifiers like ``__init__`` stay literal)."""
    return _MARKDOWN_SPECIALS.sub(r"\\\1", str(text))


def show_problem(problem: CodeProblem, log_tail: str = "") -> None:
    """An error box naming the problem and the user's line; its text is shown as text."""
    title = plain_text(problem.title) + (f" — line {problem.lineno}" if problem.lineno else "")
    if problem.kind == "unavailable":
        st.warning(title, icon=":material/construction:")
    else:
        st.error(title, icon=":material/error:")
    st.code(problem.message, language=None, wrap_lines=True)
    if problem.line:
        st.code(f"{problem.lineno:>4} | {problem.line.rstrip()}", language="python")
    if problem.op:
        st.text(f"Operation: {problem.op}")
    if log_tail:
        with st.expander("The worker's last log lines (its crash report)"):
            st.code(log_tail, language=None)


def show_failure(e: services.ActionFailed) -> None:
    show_problem(e.problem, e.log_tail)


def annotations(problem: CodeProblem) -> list[dict]:
    if problem.lineno is None:
        return []
    return [{"row": problem.lineno - 1, "column": 0, "type": "error",
             "text": f"{problem.title}: {problem.message}"}]


def table(t: tables.Table) -> None:
    """A result table as static HTML: cells wrap and numbers are never cut."""
    if t[1]:
        st.table(tables.frame(t), hide_index=True)


def stale_note(record: dict, fingerprint: str) -> bool:
    """Mark a result computed from other code, shape or seed; True when it is stale."""
    if record.get("fingerprint") == fingerprint:
        return False
    st.warning("Stale: these results were computed from other code, shape or seed than the "
               "editor's. Run again to update them; the export leaves them out.",
               icon=":material/history:")
    return True


def remote_banner() -> None:
    """The server listens beyond this machine (allowed with --allow-remote): say what it means."""
    address = st.get_option("server.address") or "all interfaces"
    st.warning(f"This workbench listens on {plain_text(address)}, not only on this machine. Anyone who "
               "can reach its port can run Python with your rights through the Playground. Keep it "
               "on a trusted network, or restart it on 127.0.0.1 and use an SSH tunnel.",
               icon=":material/public:")
