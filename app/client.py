"""The app's side of the worker process (:mod:`app.worker`): start it, call it, restart it.

One worker serves the whole app (every browser session), one request at a time. A request that
finds the worker dead, or whose worker dies or stops answering, raises :class:`WorkerFailed` with
a plain description (killed, segmentation fault, out of memory, ...) and the worker is started
again at once, so that the next request finds it ready.
"""
from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from app.settings import REPO_ROOT

#: Seconds a new worker may take to import torch and flexcore and report ready.
STARTUP_TIMEOUT_S = 180.0
#: Lines of the worker's log shown when it dies.
LOG_TAIL_LINES = 12

_SIGNAL_MEANING = {
    signal.SIGKILL: "was killed (SIGKILL): the machine ran out of memory, or something (the code "
                    "itself, or another program) killed it",
    signal.SIGSEGV: "crashed with a segmentation fault (a crash in native code: a kernel, a C "
                    "extension or ctypes)",
    signal.SIGABRT: "aborted (a failed check in native code, or a fatal CUDA error)",
    signal.SIGBUS: "crashed with a bus error (a bad memory access in native code)",
    signal.SIGFPE: "crashed with a floating-point exception in native code",
    signal.SIGTERM: "was terminated (SIGTERM)",
}


class WorkerFailed(Exception):
    """The worker process died or stopped answering; ``title`` and ``message`` say so plainly.

    Attributes:
        log_tail: the last lines of the worker's log (its Python traceback or crash report).
    """

    def __init__(self, title: str, message: str, log_tail: str = ""):
        super().__init__(f"{title}: {message}")
        self.title, self.message, self.log_tail = title, message, log_tail


class RemoteError(Exception):
    """A request ended with an error the worker reported (``problem`` is a CodeProblem dict)."""

    def __init__(self, problem: dict):
        super().__init__(f"{problem.get('title')}: {problem.get('message')}")
        self.problem = problem


def describe_exit(returncode: int | None) -> str:
    """What an exit status means, in words."""
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return _SIGNAL_MEANING.get(sig, f"was stopped by {name}")
    return f"exited with status {returncode}"


class Worker:
    """One worker process and the lock that serialises requests to it."""

    def __init__(self, log_path: Path | None = None):
        self.log_path = log_path
        self.lock = threading.RLock()
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.info: dict | None = None
        self.starts = 0
        self.started_at: float | None = None
        self.last_failure: str | None = None
        self._ids = itertools.count(1)
        #: A request whose caller stopped waiting (a Streamlit rerun): its answer is skipped.
        self._abandoned: tuple[int, float] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the process (it imports torch in the background; :meth:`call` waits for it)."""
        with self.lock:
            if self.alive():
                return
            self._close()
            parent, child = socket.socketpair()
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
            env.setdefault("PYTHONUNBUFFERED", "1")
            log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "app.worker", str(child.fileno())],
                    pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), env=env)
            finally:
                child.close()
                if log is not subprocess.DEVNULL:
                    log.close()
            self.conn = Connection(parent.detach())
            self.info, self._abandoned = None, None
            self.starts += 1
            self.started_at = time.time()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn, self.info = None, None, None

    def log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        # A native crash report (faulthandler) or the last Python traceback, from its start.
        starts = [i for i, line in enumerate(lines)
                  if line.startswith(("Fatal Python error", "Traceback (most recent call last)"))]
        lines = lines[starts[-1]:] if starts else lines[-LOG_TAIL_LINES:]
        lines = [line for line in lines if not line.startswith("Extension modules:")]
        return "\n".join(lines[:3 * LOG_TAIL_LINES])

    def _failed(self, title: str, what: str, advice: str) -> WorkerFailed:
        """Stop (or reap) the process, start a new one, and describe what happened."""
        tail = self.log_tail()
        self._close()
        self.last_failure = f"{time.strftime('%H:%M:%S')}: {what}"
        self.start()
        return WorkerFailed(title, f"The worker process that runs your code {what}. {advice} "
                                   "It has been restarted; your code and saved results are kept.",
                            tail)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.info is None:
            message = self._receive(deadline)
            if message is None:
                if self._still_running():
                    raise self._failed("The worker did not start",
                                       f"did not start within {STARTUP_TIMEOUT_S:g} s", "")
                raise self._failed("The worker did not start",
                                   describe_exit(self.proc.returncode) + " while starting",
                                   "See its log below and the Environment page.")
            if message[0] == "ready":
                self.info = message[1]

    def _receive(self, deadline: float):
        """The next message, or None when the deadline passes or the process ends."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                if self.conn.poll(min(left, 0.2)):
                    return self.conn.recv()
            except (EOFError, OSError):
                return None
            if not self.alive():
                try:  # a last message may still be in the socket
                    if self.conn.poll(0):
                        return self.conn.recv()
                except (EOFError, OSError):
                    pass
                return None

    def _still_running(self) -> bool:
        """Whether the process lives on (a closed socket precedes the exit status by a moment)."""
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return True
        return False

    def ready_info(self) -> dict:
        with self.lock:
            self.start()
            self._wait_ready()
            return dict(self.info)

    # ---- requests -----------------------------------------------------------------------------
    def call(self, task: str, kwargs: dict[str, Any], timeout_s: float,
             progress: Callable[[float, str], None] | None = None) -> Any:
        """Run ``task`` in the worker and return its value.

        Raises:
            RemoteError: the task failed with a reported problem (the worker lives on).
            WorkerFailed: the worker died or overran ``timeout_s``; it has been restarted.
        """
        with self.lock:
            if not self.alive():
                if self.proc is not None:
                    raise self._failed("The worker process stopped",
                                       describe_exit(self.proc.returncode) + " after the last action",
                                       "")
                self.start()
            self._wait_ready()
            self._skip_abandoned()
            request_id = next(self._ids)
            try:
                self.conn.send(("call", request_id, task, kwargs))
            except (OSError, ValueError):
                self._abandoned = None
                raise self._failed("The worker process stopped",
                                   describe_exit(self.proc.poll()), "") from None
            deadline = time.monotonic() + timeout_s
            finished = False
            try:
                while True:
                    message = self._receive(deadline)
                    if message is None:
                        finished = True
                        if self._still_running():
                            raise self._failed(
                                "Stopped: no answer in time",
                                f"did not finish {task} within {timeout_s:g} s (stuck in native "
                                "code, or work too large for this machine?) and was stopped",
                                "Try a smaller shape.")
                        raise self._failed("The worker process died", describe_exit(self.proc.poll()),
                                           _advice(self.proc.poll()))
                    kind, got_id = message[0], message[1]
                    if got_id != request_id:
                        continue  # the answer of an abandoned request
                    if kind == "progress":
                        if progress is not None:
                            progress(message[2], message[3])
                        continue
                    finished = True
                    if kind == "result":
                        return message[2]
                    problem, restart = message[2], message[3]
                    if restart:  # the worker exits after this reply; start a fresh one
                        self._close()
                        self.last_failure = f"{time.strftime('%H:%M:%S')}: {problem.get('title')}"
                        self.start()
                    raise RemoteError(problem)
            finally:
                if not finished and self.alive():
                    # The caller stopped waiting (a Streamlit rerun interrupted it): the next
                    # request skips this one's answer.
                    self._abandoned = (request_id, time.monotonic() + timeout_s)

    def _skip_abandoned(self) -> None:
        """Wait for an abandoned request to end (up to a few seconds), else restart the worker."""
        if self._abandoned is None:
            return
        request_id, deadline = self._abandoned
        deadline = min(deadline, time.monotonic() + 5.0)
        while True:
            message = self._receive(deadline)
            if message is None:
                break
            if message[1] == request_id and message[0] in ("result", "error"):
                self._abandoned = None
                if message[0] == "error" and message[3]:
                    break  # it exits: start afresh
                return
        self._close()
        self.start()
        self._wait_ready()


def _advice(returncode: int | None) -> str:
    if returncode == -signal.SIGKILL:
        return "If the shape was large, try a smaller one."
    if returncode is not None and returncode < 0:
        return "The crash report is below."
    return ""


_WORKER: Worker | None = None
_WORKER_LOCK = threading.Lock()


def worker() -> Worker:
    """The app's worker (created on first use; its log is ``worker.log`` in the data folder)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            from app.settings import data_dir

            _WORKER = Worker(data_dir() / "worker.log")
        return _WORKER


def warm() -> None:
    """Start the worker now (at app start), so that the first action does not wait for imports."""
    worker().start()


@atexit.register
def shutdown() -> None:
    """Stop the worker (at exit, and from tests)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is not None:
            _WORKER.stop()
            _WORKER = None
