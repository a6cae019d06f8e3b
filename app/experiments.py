"""The Playground's experiment in the browser session, kept in the store and named by the URL.

The URL's ``?exp=<id>`` names the experiment, so a reload (a new session) loads its code, shape,
seed and results again. Edits and results are saved as they happen; a save against a revision
that another tab saved in the meantime is refused, and the page offers to load the saved version
or to keep this tab's work as a new experiment.
"""
from __future__ import annotations

import hashlib
import threading
import time

import streamlit as st

from app import editor
from app.services import default_shape
from app.settings import data_dir
from app.store import NotFoundError, StaleWriteError, Store, StoreError
from app.templates import TEMPLATE

SHAPE_KEY = "playground_shape"
SEED_KEY = "playground_seed"
#: Results of the current experiment: {kind: record} (see app.services.export.make_record).
RESULTS_KEY = "playground_results"
#: The saved experiment this session edits: {"id", "revision", "name", "saved": (code, shape, seed)}.
EXP_KEY = "playground_experiment"
CONFLICT_KEY = "playground_conflict"
NOTICE_KEY = "playground_notice"
#: Widget keys of the shape and seed controls (reset when another experiment is loaded).
CONTROL_KEYS = ("shape_B", "shape_Hq", "shape_Hkv", "shape_Q_LEN", "shape_KV_LEN", "shape_D",
                "shape_BLOCK_SIZE", "shape_dtype", "seed_input")
#: Session keys derived from the current experiment, dropped when another one is loaded.
DERIVED_PREFIXES = ("playground_active", "playground_pending", "playground_problem",
                    "playground_crash", "pg_export", "pg_compare_", "exp_rename", "exp_confirm")

_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def store() -> Store:
    """The experiments database of the current data folder (opened and migrated once)."""
    folder = str(data_dir())
    with _STORES_LOCK:
        if folder not in _STORES:
            _STORES[folder] = Store.in_folder(folder)
        return _STORES[folder]


def current() -> dict | None:
    return st.session_state.get(EXP_KEY)


def results() -> dict:
    return st.session_state.setdefault(RESULTS_KEY, {})


def seed() -> int:
    return int(st.session_state.setdefault(SEED_KEY, 0))


def default_name() -> str:
    return "experiment " + time.strftime("%Y-%m-%d %H:%M:%S")


def _clear_derived() -> None:
    for key in list(st.session_state):
        if key.startswith(DERIVED_PREFIXES) or key in CONTROL_KEYS:
            del st.session_state[key]


def load(exp) -> None:
    """Make ``exp`` (a store Experiment) the session's experiment: editor, shape, seed, results."""
    _clear_derived()
    editor.set_code(exp.code)
    st.session_state[SHAPE_KEY] = {**default_shape(), **exp.shape}
    over = _beyond_limits(exp.shape)
    if over:
        st.session_state[NOTICE_KEY] = (
            "The experiment's shape is larger than this machine allows",
            f"It was saved with {', '.join(over)}. The controls show the largest values allowed "
            "here; running the experiment saves that smaller shape.")
    st.session_state[SEED_KEY] = int(exp.seed)
    st.session_state[RESULTS_KEY] = dict(exp.results)
    st.session_state[EXP_KEY] = {"id": exp.id, "revision": exp.revision, "name": exp.name,
                                 "saved": (exp.code, dict(exp.shape), int(exp.seed))}
    st.session_state.pop(CONFLICT_KEY, None)
    st.query_params["exp"] = exp.id


def _beyond_limits(shape: dict) -> list[str]:
    from app.services import limits

    lim = limits()
    caps = {"B": lim.max_bh, "Hq": lim.max_bh, "Hkv": lim.max_bh, "Q_LEN": lim.max_len,
            "KV_LEN": lim.max_len, "D": lim.max_d}
    return [f"{k} = {shape[k]}" for k, cap in caps.items() if int(shape.get(k, 0)) > cap]


def start_draft(code: str = TEMPLATE) -> None:
    """A new, unsaved experiment (saved at its first edit or action)."""
    _clear_derived()
    editor.set_code(code)
    st.session_state[RESULTS_KEY] = {}
    st.session_state.pop(EXP_KEY, None)
    st.session_state.pop(CONFLICT_KEY, None)
    if "exp" in st.query_params:
        del st.query_params["exp"]


def sync_with_url() -> None:
    """Before any widget is drawn: load the experiment the URL names, or name ours in the URL."""
    wanted = st.query_params.get("exp")
    mine = current()
    if wanted and (mine is None or mine["id"] != wanted):
        try:
            load(store().get(wanted))
        except NotFoundError as e:
            st.session_state[NOTICE_KEY] = ("The experiment in the address could not be opened",
                                            str(e))
            del st.query_params["exp"]
    elif mine is not None and wanted != mine["id"]:
        st.query_params["exp"] = mine["id"]


def _provenance() -> tuple[str | None, dict | None]:
    """The commit, and the worker's device and versions when it has reported them."""
    from app import client
    from app.services import commit

    info = client.worker().info
    env = None if info is None else {k: info.get(k) for k in ("device", "gpu", "torch", "triton")}
    return commit(), env


def autosave(code: str, shape: dict, seed_value: int, force: bool = False) -> None:
    """Save the editor's code, shape and seed when they changed since the last save.

    A draft is saved (created) once it differs from the template, or when ``force`` (an action
    was run on it).
    """
    if st.session_state.get(CONFLICT_KEY):
        return
    mine = current()
    state = (code, dict(shape), int(seed_value))
    if mine is None:
        if not force and code == TEMPLATE and not results():
            return
        exp = store().create(default_name(), code, shape, seed_value, results(), *_provenance())
        st.session_state[EXP_KEY] = {"id": exp.id, "revision": exp.revision, "name": exp.name,
                                     "saved": state}
        st.query_params["exp"] = exp.id
        return
    if mine["saved"] == state:
        return
    commit_id, env = _provenance()
    _save(code=code, shape=shape, seed=seed_value, commit=commit_id, environment=env)
    mine["saved"] = state


def _save(**fields) -> bool:
    """One write of the current experiment; a refused write becomes the page's conflict banner."""
    mine = current()
    try:
        exp = store().save(mine["id"], mine["revision"], **fields)
    except (StaleWriteError, NotFoundError) as e:
        st.session_state[CONFLICT_KEY] = str(e)
        return False
    mine["revision"], mine["name"] = exp.revision, exp.name
    return True


def record(kind: str, rec: dict, code: str, shape: dict, seed_value: int) -> bool:
    """Keep a result with the experiment (saving the experiment first if it is a draft)."""
    results()[kind] = rec
    if current() is None:
        autosave(code, shape, seed_value, force=True)
        return current() is not None
    if st.session_state.get(CONFLICT_KEY):
        return False
    return _save(results={kind: rec})


def rename(name: str) -> None:
    mine = current()
    try:
        exp = store().rename(mine["id"], mine["revision"], name)
    except StaleWriteError as e:
        st.session_state[CONFLICT_KEY] = str(e)
        return
    mine["revision"], mine["name"] = exp.revision, exp.name


def keep_as_new(code: str, shape: dict, seed_value: int) -> None:
    """Resolve a conflict by saving this tab's work as a new experiment."""
    mine = current() or {"name": default_name()}
    exp = store().create(f"{mine['name']} (this tab)", code, shape, seed_value, results(),
                         *_provenance())
    st.session_state.pop(CONFLICT_KEY, None)
    load(exp)


def reload_saved() -> None:
    """Resolve a conflict by loading the saved version (this tab's unsaved edits are dropped)."""
    mine = current()
    st.session_state.pop(CONFLICT_KEY, None)
    try:
        load(store().get(mine["id"]))
    except NotFoundError as e:
        st.session_state[NOTICE_KEY] = ("The saved version is gone", str(e))
        start_draft()


def open_new(code: str, name: str, shape: dict | None = None) -> None:
    """Create an experiment from ``code`` (a gallery variant, New) and make it current."""
    shape = shape or st.session_state.get(SHAPE_KEY) or default_shape()
    exp = store().create(name, code, shape, seed(), {}, *_provenance())
    load(exp)


def import_upload(data: bytes) -> str | None:
    """Import an uploaded experiment JSON once per content; returns an error text or None."""
    digest = hashlib.sha256(data).hexdigest()
    seen = st.session_state.setdefault("exp_imported", set())
    if digest in seen:
        return None
    try:
        exp = store().import_json(data)
    except StoreError as e:
        return str(e)
    seen.add(digest)
    load(exp)
    return None
