"""Environment: GPU or CPU mode, versions, providers and why some are unavailable."""
from __future__ import annotations

import streamlit as st

from app import editor, services

st.title("Environment")
lim = services.limits()
info = services.environment()

if lim.cpu_mode:
    st.info(lim.describe(), icon=":material/computer:")
else:
    st.success(f"{lim.describe()} Device: {info.get('gpu', 'cuda')}.", icon=":material/rocket_launch:")

c1, c2, c3, c4 = st.columns(4)
c1.metric("Mode", info["mode"])
c2.metric("torch", info["torch"])
c3.metric("triton", info["triton"])
c4.metric("streamlit", info["streamlit"])

st.subheader("Attention providers")
try:
    rows = services.providers()
    # A static table: the reasons are sentences and must wrap, not be cut off.
    st.table([{"provider": r["name"], "available": "yes" if r["available"] else "no",
               "detail / why not": r["reason"]} for r in rows])
except services.Unavailable as e:
    st.warning(f"The provider list is unavailable: {e}", icon=":material/construction:")

st.subheader("Versions and machine")
details = {"python": info["python"], **info.get("bench_env", {})}
st.table([{"key": k, "value": str(v)} for k, v in details.items()])
if "bench_env_error" in info:
    st.caption(f"bench's environment capture is unavailable: {info['bench_env_error']}")

st.subheader("Workbench")
address = st.get_option("server.address") or "(all interfaces)"
st.markdown(
    f"- Server address: `{address}`. The workbench runs the Python typed into the Playground, so "
    "it listens on 127.0.0.1 only (`.streamlit/config.toml`). To expose it on purpose, start it "
    "with `--server.address 0.0.0.0` on a trusted network only.\n"
    "- Code editor: " + ("Ace (streamlit-ace), with syntax highlighting" if editor.ace_available()
                         else "plain text area") + ".\n"
    "- User code runs first in a child process with a time limit, so an endless loop cannot "
    "freeze the app.")
