"""One writer per output folder: an exclusive ``flock`` on ``<folder>/run.lock`` held for a whole run.

The lock file names its holder (pid, host, start time, command) so that a refused second writer can
say who holds the folder. The kernel drops the lock when the holder exits, however it exits
(SIGKILL included), so a stale lock file never blocks a later run; the file itself is never
deleted, because a second process could otherwise lock a file that the path no longer names.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

LOCK_NAME = "run.lock"


class FolderBusyError(RuntimeError):
    """Another process holds the output folder's lock; the message names it."""


def _holder_text(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process (it has not written its name yet)"
    command = f" ({info['command']})" if info.get("command") else ""
    return (f"pid {info.get('pid')} on host {info.get('host', '?')}, started "
            f"{info.get('started_utc', '?')}{command}")


class FolderLock:
    """An exclusive, non-blocking lock on ``folder/run.lock``.

    Example:
        >>> with FolderLock(Path("results/tiny"), "bench run"):
        ...     ...  # the only writer of results/tiny until the block ends

    Raises:
        FolderBusyError: on entry, when another process holds the lock.
    """

    def __init__(self, folder: Path, what: str = "a bench run"):
        self.folder, self.what = Path(folder), what
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderBusyError(
                f"{self.folder} is in use by {_holder_text(self.path)}; wait for that run to end or "
                f"stop it, then run again (one writer per output folder)") from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:300],
                "what": self.what}
        data = (json.dumps(info) + "\n").encode()
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
        os.ftruncate(fd, len(data))  # after the write: a reader never sees an empty holder
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

