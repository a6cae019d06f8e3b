"""Run the user's code first in a child process, with a time limit.

The Playground executes whatever the user types. Before the app runs it in its own process, a
child process runs the code, lowers its mods (which traces them to a finite graph) and evaluates
them once over the problem's indices. A mod that never finishes, or that crashes the interpreter,
then costs a killed child and an error message, never a frozen app.

A spare child is started ahead of time so that its ``import torch`` is not paid on the user's
clock; each child serves one request and exits, so nothing leaks between runs.

Protocol: the child prints ``READY``, reads one JSON request line from stdin, and prints one JSON
result line: ``{"ok": true, "score_source": ..., "mask_source": ..., "tensors": [...]}`` or
``{"ok": false, "problem": {...CodeProblem...}}``.
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
_spare: subprocess.Popen | None = None


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------

def _spawn() -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen([sys.executable, "-m", "app.sandbox"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=str(REPO_ROOT),
                            env=env)


def _take_worker() -> subprocess.Popen:
    """The spare child (or a new one), and a new spare started behind it."""
    global _spare
    with _lock:
        proc = _spare if _spare is not None and _spare.poll() is None else _spawn()
        _spare = _spawn()
    return proc


def warm() -> None:
    """Start the spare child now (at app start), so the first check does not wait for imports."""
    global _spare
    with _lock:
        if _spare is None or _spare.poll() is not None:
            _spare = _spawn()


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
    """Stop the spare child (at exit, and from tests)."""
    global _spare
    with _lock:
        if _spare is not None:
            _stop(_spare)
            _spare = None


def _read_line(proc: subprocess.Popen, buffer: bytearray, deadline: float) -> bytes | None:
    """One line from the child's stdout, or None if the deadline passes or the child exits."""
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


def check_code(code: str, shape: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run, lower and probe the user's code in a child process, stopping it after ``timeout_s``.

    Args:
        code: the editor's text.
        shape: the shape controls: ``B, Hq, Hkv, Q_LEN, KV_LEN, D`` and ``device``.
        timeout_s: seconds the code may run.

    Returns:
        The child's JSON result (see the module docstring).
    """
    from app.usercode import source_line

    proc = _take_worker()
    buffer = bytearray()
    try:
        if _read_line(proc, buffer, time.monotonic() + _STARTUP_TIMEOUT_S) != b"READY":
            return _problem("internal", "The code checker did not start",
                            "The child process that runs your code first could not start "
                            f"(exit code {proc.poll()}). See the Environment page.")
        request = json.dumps({"code": code, "shape": shape}) + "\n"
        try:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
        except BrokenPipeError:
            return _problem("internal", "The code checker stopped", "The child process exited early.")
        line = _read_line(proc, buffer, time.monotonic() + timeout_s)
        if line is None and proc.poll() is None:
            # Ask the child where it is; a loop inside one long C call cannot answer and is killed.
            proc.send_signal(signal.SIGUSR1)
            line = _read_line(proc, buffer, time.monotonic() + 1.0)
            if line is not None:
                return json.loads(line)
            return _problem("timeout", f"Stopped after {timeout_s:g} s",
                            f"The code was still running after {timeout_s:g} s (an endless loop, "
                            "or work too large for this machine?). It was stopped; nothing ran in "
                            "the app. Change it and run again.")
        if line is None:
            code_ = proc.poll()
            return _problem("internal", "The code crashed the checker process",
                            f"The child process running your code exited with code {code_} "
                            "(a crash in native code?). Nothing ran in the app.")
        result = json.loads(line)
        if not result.get("ok") and result["problem"].get("lineno") and not result["problem"].get("line"):
            result["problem"]["line"] = source_line(code, result["problem"]["lineno"])
        return result
    finally:
        _stop(proc)


# ---------------------------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------------------------

_CURRENT_CODE = {"text": ""}
_CHANNEL = {"out": None}


def _send(result: dict) -> None:
    out = _CHANNEL["out"] or sys.stdout
    out.write(json.dumps(result) + "\n")
    out.flush()


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
    for fn in (mods.mask_mod, mods.score_mod):
        if fn is not None:
            create_mask(fn, B, H, L, S, device="cpu")


def serve_one(request: dict) -> dict:
    """Handle one request in this (child) process."""
    from app.usercode import UserCodeError, problem_from_exception, run_code

    code, shape = request["code"], dict(request["shape"])
    shape["device"] = "cpu"
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
    import torch  # noqa: F401 - paid before READY, not on the user's clock

    from flexcore._runtime import prepare_triton

    prepare_triton()
    _warm_up()
    # The user's print() calls (and native writes to fd 1) must not corrupt the protocol.
    _CHANNEL["out"] = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")
    signal.signal(signal.SIGUSR1, _where_now)
    _CHANNEL["out"].write("READY\n")
    _CHANNEL["out"].flush()
    line = sys.stdin.readline()
    if not line:
        return
    _send(serve_one(json.loads(line)))


if __name__ == "__main__":
    _main()
