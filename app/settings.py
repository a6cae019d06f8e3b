"""Where the workbench keeps its data, and whether it may listen beyond this machine.

Settings come from the environment or from the script's own arguments (after ``--``)::

    python -m streamlit run app/streamlit_app.py -- --data-dir /path/to/folder --allow-remote

- data folder: ``$FLEXLAB_DATA_DIR``, else ``--data-dir``, else ``~/.flexlab``. It holds the
  experiments database and the worker's log.
- ``--allow-remote`` (or ``FLEXLAB_ALLOW_REMOTE=1``): accept a server address other than the
  loopback interface. Without it the workbench refuses to serve pages on another address.
"""
from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

DATA_DIR_ENV = "FLEXLAB_DATA_DIR"
ALLOW_REMOTE_ENV = "FLEXLAB_ALLOW_REMOTE"
DATA_DIR_FLAG = "--data-dir"
ALLOW_REMOTE_FLAG = "--allow-remote"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _flag_value(name: str, argv: list[str]) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv``, else None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def data_dir(argv: list[str] | None = None) -> Path:
    """The data folder (created, private to the user, on first use)."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = os.environ.get(DATA_DIR_ENV) or _flag_value(DATA_DIR_FLAG, argv)
    path = Path(chosen).expanduser() if chosen else Path.home() / ".flexlab"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def remote_allowed(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return ALLOW_REMOTE_FLAG in argv or os.environ.get(ALLOW_REMOTE_ENV, "") == "1"


def is_loopback(address: str | None) -> bool:
    """Whether a server address listens on this machine only (an empty address means all)."""
    if not address:
        return False
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def binding(address: str | None, argv: list[str] | None = None) -> str:
    """``"loopback"``, ``"remote-allowed"`` or ``"remote-refused"`` for a server address."""
    if is_loopback(address):
        return "loopback"
    return "remote-allowed" if remote_allowed(argv) else "remote-refused"
