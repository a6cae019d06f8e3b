"""The worker process: every piece of the user's code and every kernel run happens here.

The app (:mod:`app.client`) starts it with one end of a socket pair and sends it requests; a crash
in a kernel, a CUDA error, running out of memory or an ``os.kill`` in the user's code ends this
process, never the app. The app then says so and starts a new one.

Protocol: pickled tuples over a :class:`multiprocessing.connection.Connection`.

- worker → app, once at start: ``("ready", info)`` (device, versions);
- app → worker: ``("call", request_id, task, kwargs)``;
- worker → app: any number of ``("progress", request_id, fraction, text)``, then
  ``("result", request_id, value)`` or ``("error", request_id, problem, restart)``, where
  ``problem`` is a :class:`app.usercode.CodeProblem` as a dict and ``restart`` says that this
  process is unusable (a CUDA error poisons its context) and exits after replying.

The user's ``print`` output and native crash reports (faulthandler) go to the worker's log file,
which the app shows when the worker dies.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import traceback
from multiprocessing.connection import Connection


def _cuda_poisoned(exc: BaseException) -> bool:
    """Whether an exception leaves this process's CUDA context unusable (a device-side assert or
    an illegal memory access are sticky: every later CUDA call fails too)."""
    text = f"{type(exc).__name__}: {exc}"
    sticky = ("device-side assert", "illegal memory access", "unspecified launch failure",
              "misaligned address", "CUDA error: an illegal instruction")
    return any(s in text for s in sticky)


def _serve(conn: Connection) -> None:
    from app import tasks
    from app.usercode import CodeProblem

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the app is gone
        _, request_id, task, kwargs = message

        def progress(fraction: float, text: str = "", _id=request_id) -> None:
            conn.send(("progress", _id, float(fraction), str(text)))

        restart = False
        try:
            value = tasks.run(task, kwargs, progress)
            conn.send(("result", request_id, value))
            continue
        except tasks.CodeTimeout as e:
            problem = e.problem()
        except Exception as e:  # noqa: BLE001 - reported to the app, which shows it
            traceback.print_exc()
            restart = _cuda_poisoned(e)
            problem = tasks.problem_of(e, kwargs.get("code", ""), f"in {task}")
            if restart:
                problem = CodeProblem(
                    "worker", "CUDA error: the worker restarts",
                    f"{problem.message}\n\nA CUDA error like this one leaves the GPU context of the "
                    "process that ran it unusable, so the worker process is restarted. Your code and "
                    "saved results are kept.", problem.lineno, problem.line, problem.op)
        conn.send(("error", request_id, problem.to_dict(), restart))
        if restart:
            os._exit(3)


def main(fd: int) -> None:
    conn = Connection(fd)
    # The user's print() calls go to the log (stderr), not to the app.
    sys.stdout = sys.stderr
    os.dup2(2, 1)
    faulthandler.enable(all_threads=True)
    from flexcore._runtime import prepare_triton

    # Before anything imports triton: without a GPU, kernels run under Triton's interpreter,
    # which must be chosen before any @triton.jit decorator runs.
    prepare_triton()
    from app import tasks

    try:
        tasks.warm_up()
    except Exception:  # noqa: BLE001 - a missing piece shows up again in the first request
        traceback.print_exc()
    conn.send(("ready", tasks.startup_info()))
    _serve(conn)


if __name__ == "__main__":
    main(int(sys.argv[1]))
