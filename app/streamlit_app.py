"""flexlab workbench: the entry script. Routes to the pages in app/app_pages/.

Run with ``make app`` or ``python -m streamlit run app/streamlit_app.py`` from the repository root.
"""
from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

# `streamlit run` puts app/ on sys.path, not the repository root that holds the packages.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from flexcore._runtime import prepare_triton  # noqa: E402 - needs the path above

# Before anything imports triton: on machines without a GPU, kernels run under its interpreter,
# which must be selected before any @triton.jit decorator runs.
prepare_triton()

from app import sandbox  # noqa: E402

st.set_page_config(page_title="flexlab workbench", page_icon=":material/science:", layout="wide")
# The child process that first runs the user's code imports torch: start it before it is needed.
sandbox.warm()

pages = [
    st.Page("app_pages/playground.py", title="Playground", icon=":material/science:", default=True),
    st.Page("app_pages/gallery.py", title="Gallery", icon=":material/photo_library:"),
    st.Page("app_pages/benchmarks.py", title="Benchmarks", icon=":material/bar_chart:"),
    st.Page("app_pages/environment.py", title="Environment", icon=":material/memory:"),
]
st.navigation(pages).run()
