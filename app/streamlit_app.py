"""flexlab workbench: the entry script. Routes to the pages in app/app_pages/.

Run with ``make app`` or ``python -m streamlit run app/streamlit_app.py`` from the repository root;
settings after ``--`` are described in :mod:`app.settings`.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import streamlit as st

# `streamlit run` puts app/ on sys.path, not the repository root that holds the packages.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

st.set_page_config(page_title="flexlab workbench", page_icon=":material/science:", layout="wide")

try:
    from flexcore._runtime import prepare_triton

    # Before anything imports triton: without a GPU, kernels run under Triton's interpreter,
    # which must be selected before any @triton.jit decorator runs (bench's loader imports it).
    prepare_triton()
except Exception as exc:  # noqa: BLE001 - the Environment page explains what is missing
    st.sidebar.warning(f"flexcore cannot be imported: {type(exc).__name__}: {exc}")

from app import client, settings, ui  # noqa: E402

binding = settings.binding(st.get_option("server.address"))
if binding == "remote-refused":
    st.error("This workbench runs the Python typed into it with your rights, so it serves pages on "
             "the loopback interface (127.0.0.1) only.", icon=":material/gpp_bad:")
    st.code(f"It was started with server address {st.get_option('server.address') or '(all)'!r}. "
            "Restart it on 127.0.0.1 and use an SSH tunnel, or, on a trusted network, add the "
            "explicit flag:\n\n  python -m streamlit run app/streamlit_app.py --server.address "
            "0.0.0.0 -- --allow-remote", language=None, wrap_lines=True)
    st.stop()
if binding == "remote-allowed":
    ui.remote_banner()

# The worker imports torch and flexcore: start it before the first action needs it.
client.warm()

pages = [
    st.Page("app_pages/playground.py", title="Playground", icon=":material/science:", default=True),
    st.Page("app_pages/gallery.py", title="Gallery", icon=":material/photo_library:"),
    st.Page("app_pages/benchmarks.py", title="Benchmarks", icon=":material/bar_chart:"),
    st.Page("app_pages/environment.py", title="Environment", icon=":material/memory:"),
]
page = st.navigation(pages)
try:
    page.run()
except Exception as exc:  # noqa: BLE001 - last resort: an error box, never a traceback page
    logging.getLogger("flexlab.app").exception("uncaught error on page %s", page.title)
    st.error("Something went wrong on this page. Your code and settings are kept; the full "
             "traceback is in the server's log.", icon=":material/error:")
    st.code(f"{type(exc).__name__}: {exc}", language=None, wrap_lines=True)
