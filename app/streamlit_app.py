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

from app import sandbox  # noqa: E402 - needs the path above

st.set_page_config(page_title="flexlab workbench", page_icon="🧪", layout="wide")
# The child process that first runs the user's code imports torch: start it before it is needed.
sandbox.warm()

pages = [
    st.Page("app_pages/playground.py", title="Playground", icon="🧪", default=True),
    st.Page("app_pages/gallery.py", title="Gallery", icon="🖼️"),
    st.Page("app_pages/benchmarks.py", title="Benchmarks", icon="📊"),
    st.Page("app_pages/environment.py", title="Environment", icon="🖥️"),
]
st.navigation(pages).run()
