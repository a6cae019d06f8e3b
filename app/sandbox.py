"""Run the user's code first in a separate process, with a time limit.

The Playground executes whatever the user types. Before the app runs it in its own process, a
worker process runs the code, lowers its mods (which traces them to a finite graph) and evaluates
them once over the problem's indices. A mod that never finishes, or that crashes the interpreter,
then costs a killed worker and an error message, never a frozen app.

A long-lived checker process imports torch and flexcore once, then forks one worker per request
(a fresh copy of its warmed-up state, so nothing the user's code does leaks into the next run,
and no request waits for ``import torch``).

Protocol on the checker's pipes: it prints ``READY``; for each JSON request line on stdin it
prints ``PID <worker pid>``, the worker prints one JSON result line
(``{"ok": true, "score_source": ..., "mask_source": ..., "tensors": [...]}`` or
``{"ok": false, "problem": {...CodeProblem...}}``), and the checker prints ``DONE <status>`` once
the worker has exited.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Seconds the user's code may run in the child before it is stopped.
DEFAULT_TIMEOUT_S = 5.0
#: Seconds a fresh child may take to import torch and flexcore.
_STARTUP_TIMEOUT_S = 90.0
#: Largest B*H*Q_LEN*KV_LEN evaluated densely in the child (index errors in captured tensors).
_PROBE_ELEMENTS = 1 << 24

_lock = threading.Lock()
_server: subprocess.Popen | None = None
_buffer = bytearray()


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------

def _spawn() -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The checker forks a worker per request: it must not initialise CUDA itself (a child forked
    # after cuInit cannot use the GPU), so torch answers is_available() through NVML instead.
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    return subprocess.Popen([sys.executable, "-m", "app.sandbox"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=str(REPO_ROOT),
                            env=env)


def warm() -> None:
    """Start the checker process now (at app start), so the first check does not wait for imports."""
    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            _buffer.clear()
            _server = _spawn()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except (OSError, ValueError):
            pass


@atexit.register
def shutdown() -> None:
    """Stop the checker process (at exit, and from tests)."""
    global _server
    with _lock:
        if _server is not None:
            _stop(_server)
            _server = None


def _read_line(proc: subprocess.Popen, buffer: bytearray, deadline: float) -> bytes | None:
    """One line from the process's stdout, or None if the deadline passes or it exits."""
    fd = proc.stdout.fileno()
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        buffer.extend(chunk)
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def _problem(kind: str, title: str, message: str, lineno=None, line=None) -> dict:
    return {"ok": False, "problem": {"kind": kind, "title": title, "message": message,
                                     "lineno": lineno, "line": line, "op": None}}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def check_code(code: str, shape: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run, lower and probe the user's code in a worker process, stopping it after ``timeout_s``.

    Args:
        code: the editor's text.
        shape: the shape controls: ``B, Hq, Hkv, Q_LEN, KV_LEN, D`` and ``device``.
        timeout_s: seconds the code may run.

    Returns:
        The worker's JSON result (see the module docstring).
    """
    from app.usercode import source_line

    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            _buffer.clear()
            _server = _spawn()
        proc = _server
        if not getattr(proc, "flexlab_ready", False):
            if _read_line(proc, _buffer, time.monotonic() + _STARTUP_TIMEOUT_S) != b"READY":
                _stop(proc)
                _server = None
                return _problem("internal", "The code checker did not start",
                                "The process that runs your code first could not start (exit code "
                                f"{proc.poll()}). See the Environment page.")
            proc.flexlab_ready = True
        try:
            proc.stdin.write((json.dumps({"code": code, "shape": shape}) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            _stop(proc)
            _server = None
            return _problem("internal", "The code checker stopped", "It exited; try again.")
        result = _exchange(proc, timeout_s)
        if result is None:  # the checker itself is out of step or gone: start afresh next time
            _stop(proc)
            _server = None
            return _problem("internal", "The code checker stopped",
                            "It stopped answering; it will be restarted. Try again.")
    if not result.get("ok") and result["problem"].get("lineno") and not result["problem"].get("line"):
        result["problem"]["line"] = source_line(code, result["problem"]["lineno"])
    return result


def _exchange(proc: subprocess.Popen, timeout_s: float) -> dict | None:
    """Collect ``PID``, the result and ``DONE`` for one request, stopping a worker that overruns."""
    deadline = time.monotonic() + timeout_s
    pid, result, status = None, None, None
    timed_out = False
    while status is None:
        line = _read_line(proc, _buffer, deadline)
        if line is None:
            if proc.poll() is not None:
                return None
            if pid is None or timed_out:
                return None
            # Ask the worker where it is; a loop inside one long C call cannot answer: kill it.
            timed_out = True
            _signal(pid, signal.SIGUSR1)
            deadline = time.monotonic() + 1.0
            answer = _read_line(proc, _buffer, deadline)
            if answer is not None and answer.startswith(b"{"):
                result = json.loads(answer)  # the worker answered and exits by itself
            elif answer is not None and answer.startswith(b"DONE "):
                status = answer
                break
            else:
                _signal(pid, signal.SIGKILL)  # not reaped yet (no DONE), so the pid is still its
            deadline = time.monotonic() + 10.0
            continue
        if line.startswith(b"PID "):
            pid = int(line[4:])
        elif line.startswith(b"DONE "):
            status = line
        elif line.startswith(b"{"):
            result = json.loads(line)
    if timed_out and (result is None or result.get("ok")):
        return _problem("timeout", f"Stopped after {timeout_s:g} s",
                        f"The code was still running after {timeout_s:g} s (an endless loop, or "
                        "work too large for this machine?). It was stopped; nothing ran in the "
                        "app. Change it and run again.")
    if result is None:
        return _problem("internal", "The code crashed the checker's worker",
                        f"The process running your code ended without an answer "
                        f"({status.decode().strip()}; a crash in native code?). Nothing ran in "
                        "the app.")
    return result


# ---------------------------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------------------------

_CURRENT_CODE = {"text": ""}
_CHANNEL = {"out": None}


def _send_line(text: str) -> None:
    out = _CHANNEL["out"] or sys.stdout
    out.write(text + "\n")
    out.flush()


def _send(result: dict) -> None:
    _send_line(json.dumps(result))


def _where_now(signum, frame) -> None:
    """SIGUSR1: report the user's line the code is stuck on, then exit."""
    from app.usercode import FILENAME, source_line

    lineno = None
    while frame is not None:
        if frame.f_code.co_filename == FILENAME and lineno is None:
            lineno = frame.f_lineno
        frame = frame.f_back
    if lineno is not None:
        message = (f"The code was still running at line {lineno} when its time ran out (an "
                   "endless loop such as `while True`?). It was stopped; nothing ran in the app. "
                   "Make every loop finish and run again.")
    else:
        message = ("Checking the code did not finish in time, inside the libraries rather than on "
                   "one of your lines: the shape may be too large for this machine. It was "
                   "stopped; nothing ran in the app. Try a smaller shape.")
    result = _problem("timeout", "Stopped: the code did not finish", message, lineno,
                      source_line(_CURRENT_CODE["text"], lineno))
    _send(result)
    os._exit(0)


def _lower(mods) -> dict:
    try:
        from flexcore.lowering import lower_mask_mod, lower_score_mod
    except ImportError as e:
        return {"lowering": f"unavailable: {e}"}
    out = {}
    if mods.score_mod is not None:
        out["score_source"] = lower_score_mod(mods.score_mod).source
    if mods.mask_mod is not None:
        out["mask_source"] = lower_mask_mod(mods.mask_mod).source
    return out


def _probe(mods, shape: dict) -> None:
    """Evaluate the mods over every index once, so out-of-range reads show up here."""
    from flexcore import create_mask

    B, H, L, S = shape["B"], shape["Hq"], shape["Q_LEN"], shape["KV_LEN"]
    if B * H * L * S > _PROBE_ELEMENTS:
        return
    # On the app's device, so that captured tensors are indexed where they live; a device-side
    # assert (an out-of-range index on the GPU) then kills this worker, not the app.
    for fn in (mods.mask_mod, mods.score_mod):
        if fn is not None:
            create_mask(fn, B, H, L, S, device=shape.get("device", "cpu"))


def serve_one(request: dict) -> dict:
    """Handle one request in this (child) process."""
    from app.usercode import UserCodeError, problem_from_exception, run_code

    code, shape = request["code"], dict(request["shape"])
    shape.setdefault("device", "cpu")
    _CURRENT_CODE["text"] = code
    try:
        mods = run_code(code, shape)
        result = {"ok": True, "tensors": sorted(mods.tensors)}
        result.update(_lower(mods))
        _probe(mods, shape)
        return result
    except UserCodeError as e:
        return {"ok": False, "problem": e.problem.to_dict()}
    except Exception as e:  # noqa: BLE001 - report anything the user's code caused, with its line
        return {"ok": False, "problem": problem_from_exception(e, code, "while checking the mods").to_dict()}


def _warm_up() -> None:
    """Pay the first-use cost of tracing (lazy imports) before the user's clock starts."""
    try:
        from flexcore import create_mask
        from flexcore.lowering import lower_mask_mod, lower_score_mod

        def _score(score, b, h, q_idx, kv_idx):
            return score + (q_idx - kv_idx)

        def _mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        lower_score_mod(_score)
        lower_mask_mod(_mask)
        create_mask(_mask, 1, 1, 8, 8, device="cpu")
    except Exception:  # noqa: BLE001 - a missing piece shows up again when the user's code runs
        pass


def _main() -> None:
    import torch

    from flexcore._runtime import prepare_triton

    prepare_triton()
    # One thread: forking after OpenMP has started its thread pool can deadlock the worker.
    torch.set_num_threads(1)
    _warm_up()
    # The user's print() calls (and native writes to fd 1) must not corrupt the protocol.
    _CHANNEL["out"] = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")
    _send_line("READY")
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGUSR1, _where_now)
            try:
                _send(serve_one(json.loads(line)))
            finally:
                os._exit(0)
        _send_line(f"PID {pid}")
        _, status = os.waitpid(pid, 0)
        _send_line(f"DONE {status}")


if __name__ == "__main__":
    _main()
