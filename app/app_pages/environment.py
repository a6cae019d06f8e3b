"""Environment: GPU or CPU mode, versions, providers and why some are unavailable, the worker,
the data folder, and what running the workbench means for security."""
from __future__ import annotations

import datetime

import streamlit as st

from app import client, editor, services, ui
from app.services import playground
from app.settings import data_dir, is_loopback

st.title("Environment")
lim = services.limits()
try:
    info = services.worker_info()
    env = services.call("environment")
except services.ActionFailed as e:
    ui.show_failure(e)
    st.stop()

if lim.cpu_mode:
    st.info(lim.describe(), icon=":material/computer:")
else:
    st.success(f"{lim.describe()} Device: {info.get('gpu', 'cuda')}.", icon=":material/rocket_launch:")

c1, c2, c3, c4 = st.columns(4)
c1.metric("Mode", "CPU" if lim.cpu_mode else "GPU")
c2.metric("torch", info["torch"])
c3.metric("triton", info["triton"])
c4.metric("streamlit", st.__version__)

st.subheader("Attention providers")
# A static table: the reasons are sentences and must wrap, not be cut off.
st.table([{"provider": services.provider_label(r["name"]),
           "available": "yes" if r["available"] else "no", "detail / why not": r["reason"]}
          for r in playground.providers()])

st.subheader("Versions and machine")
st.table([{"key": k, "value": str(v)} for k, v in {"python": info["python"], **env}.items()])

st.subheader("Workbench")
worker = client.worker()
address = st.get_option("server.address") or "(all interfaces)"
started = (datetime.datetime.fromtimestamp(worker.started_at).strftime("%H:%M:%S")
           if worker.started_at else "not started")
st.table([
    {"key": "server address", "value": address + ("" if is_loopback(st.get_option("server.address"))
                                                  else "  (reachable from other machines)")},
    {"key": "worker process", "value": f"pid {info.get('pid')}, started {started}, "
                                       f"{worker.starts} start(s) since the app started"},
    {"key": "worker's last failure", "value": worker.last_failure or "none"},
    {"key": "data folder (experiments, worker log)", "value": str(data_dir())},
    {"key": "code editor", "value": "Ace (streamlit-ace), with syntax highlighting"
     if editor.ace_available() else "plain text area"},
])
st.markdown(
    "**What the workbench runs, and with which rights.** The mods you type into the Playground are "
    "ordinary Python. They run in the workbench's worker process with your user's own rights, as "
    "code in a Jupyter kernel does: they can read and write your files and reach the network. The "
    "worker keeps a crash, an endless loop or a CUDA error away from the app (it is restarted), "
    "but it is not a sandbox. That is why the server listens on 127.0.0.1 only; to reach it from "
    "elsewhere, prefer an SSH tunnel (`ssh -L 8501:127.0.0.1:8501 host`). Another address needs "
    "`--server.address ADDRESS` and the explicit flag `-- --allow-remote`, and every page then "
    "shows a warning.")
