"""Run-to-run spread: one grid timed in N fresh processes, one after another.

``python -m bench run ... --processes N --out DIR`` runs the grid N times, each time in a new Python
process (``python -m bench.spread``, which runs :func:`bench.runner.run`), so that each one compiles,
autotunes and chooses its kernels again, as a new training job would. The processes run one at a
time: two on one GPU would time each other. The folder then holds:

- ``processes/<k>/``: the run folder of process k (1 to N), an ordinary run;
- ``rows.jsonl``, ``results.json``, ``results.csv``: every process's rows, each with its
  ``process`` number, for the cases that every process finished;
- ``env.json``: every process's environments (``process`` added), ``config.json``: the grid and
  ``processes``.

The report shows the median over the processes in each cell and a spread table: per (case,
provider), max/min - 1 of the processes' median times (:func:`spread`), marked above
:data:`SPREAD_LIMIT`. ``--resume`` keeps the processes that finished and resumes the first that did
not (in a new process); ``--max-minutes`` bounds each process, and the next process starts only
after the previous one finished its grid.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

#: A row whose processes' median times differ by more than this (max/min - 1) is flagged.
SPREAD_LIMIT = 0.03
#: Sub-folder of a spread run that holds one run folder per process.
PROCESSES_DIR = "processes"


def spread(times_ms: Iterable[float]) -> float | None:
    """max/min - 1 of the given median times (at least two, all positive), else None."""
    values = [float(t) for t in times_ms if t is not None]
    if len(values) < 2 or min(values) <= 0:
        return None
    return max(values) / min(values) - 1.0


def spread_text(value: float) -> str:
    """A spread as the report writes it: ``1.2%``, with ``⚠`` above :data:`SPREAD_LIMIT`."""
    return f"{100 * value:.1f}%" + (" ⚠" if value > SPREAD_LIMIT else "")


@dataclass(frozen=True)
class Spread:
    """The median times of one (case, provider) in each process, and their spread."""

    case_id: str
    provider: str
    times_ms: dict  #: process number -> median time (ms)
    spread: float

    @property
    def flagged(self) -> bool:
        return self.spread > SPREAD_LIMIT


def spreads(rows: list[dict]) -> list[Spread]:
    """The spread of every (case, provider) timed by at least two processes (``time_ms`` rows
    with status ok and a ``process``), in the rows' order."""
    times: dict = {}
    for r in rows:
        if r.get("process") is None or r.get("metric") != "time_ms" or r.get("status") != "ok":
            continue
        if r.get("provider") == "baseline" or r.get("value") is None:
            continue
        times.setdefault((r["case_id"], r["provider"]), {})[int(r["process"])] = float(r["value"])
    out = []
    for (case_id, provider), by_process in times.items():
        value = spread(by_process.values())
        if value is not None:
            out.append(Spread(case_id, provider, dict(sorted(by_process.items())), value))
    return out


def summary_line(rows: list[dict]) -> str:
    """One line on a spread run: how many (case, provider) pairs, the largest spread, how many
    are above the limit."""
    found = spreads(rows)
    if not found:
        return "spread: no (case, provider) pair was timed by two processes or more"
    worst = max(found, key=lambda s: s.spread)
    flagged = sum(s.flagged for s in found)
    return (f"spread over {max(len(s.times_ms) for s in found)} processes: {len(found)} (case, provider) "
            f"pairs, largest {100 * worst.spread:.1f}% ({worst.case_id} {worst.provider}), {flagged} above "
            f"{100 * SPREAD_LIMIT:.0f}%")


class SpreadError(RuntimeError):
    """One process of a spread run failed (the message names it and its folder)."""


def grid_from_config(config: dict):
    """The :class:`bench.grid.Grid` of a config.json mapping (:meth:`Grid.to_dict`)."""
    from bench.grid import Grid, Settings, case_from_dict

    return Grid(name=config["name"], cases=[case_from_dict(c) for c in config["cases"]],
                providers=list(config["providers"]), settings=Settings(**config.get("settings", {})))


def process_dir(out_dir: Path, k: int) -> Path:
    return Path(out_dir) / PROCESSES_DIR / str(k)


def run_processes(grid, out_dir: str | Path, processes: int, *, device=None, resume: bool = False,
                  force: bool = False, progress: bool = True, log: Callable[[str], None] | None = None,
                  python: str | None = None) -> Path:
    """Run ``grid`` in ``processes`` fresh processes one after another into
    ``out_dir/processes/<k>``, merge their rows into ``out_dir`` and return its results.json.

    Raises:
        RunDirError: ``out_dir`` holds a run and neither ``resume`` nor ``force`` is given, or
            ``resume`` with another grid or process count.
        RunDirBusy: another process writes ``out_dir``.
        SpreadError: a process exited with an error.
    """
    import torch

    from bench import runner
    from bench.lock import FolderBusyError, FolderLock

    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 2:
        raise ValueError(f"processes={processes!r}: expected an integer >= 2 (one process is a plain run)")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out_dir = Path(out_dir)
    device = torch.device(device) if device is not None else runner.default_device()
    grid.settings.validate()
    try:
        lock = FolderLock(out_dir, "bench run --processes").acquire()
    except FolderBusyError as exc:
        raise runner.RunDirBusy(str(exc)) from None
    try:
        # Refuses a folder holding a run (process folders included) unless resume or force, and a
        # resume with another process count, in either direction.
        runner.prepare_out_dir(out_dir, resume, force, grid, processes=processes)
        from bench.grid import fingerprint

        config = {**grid.to_dict(), "processes": processes}
        config["fingerprint"] = fingerprint(config)  # the process count is part of what is measured
        runner._atomic_write(out_dir / "config.json", json.dumps(config, indent=2))
        total = len(grid.cases)
        for k in range(1, processes + 1):
            folder = process_dir(out_dir, k)
            if _finished(folder) >= total:
                continue
            cmd = [python or sys.executable, "-m", "bench.spread", "--grid", str(out_dir / "config.json"),
                   "--out", str(folder), "--device", str(device)]
            if (folder / "rows.jsonl").exists():
                cmd.append("--resume")
            if not progress:
                cmd.append("--no-progress")
            log(f"process {k} of {processes} -> {folder}")
            # stdout (the child's results path) is read here; its progress and log go to stderr.
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
            if done.returncode != 0:
                raise SpreadError(f"process {k} of {processes} exited with status {done.returncode} "
                                  f"(its run folder: {folder}; its messages are above)")
            if _finished(folder) < total:
                log(f"process {k} stopped before the end of the grid (max_minutes); run again with "
                    "--resume to finish it and start the next processes")
                break
        return merge(out_dir, processes)
    finally:
        lock.release()


def _finished(folder: Path) -> int:
    from bench.runner import read_jsonl

    return len({e["case_id"] for e in read_jsonl(folder / "rows.jsonl")})


def merge(out_dir: str | Path, processes: int) -> Path:
    """Write ``out_dir``'s rows.jsonl (one record per case that every process finished, the rows
    of all processes with their ``process`` number), env.json and results.json/.csv from the
    process folders; return results.json. The caller holds the folder's lock."""
    from bench import runner

    out_dir = Path(out_dir)
    per_process = []
    envs = []
    for k in range(1, processes + 1):
        folder = process_dir(out_dir, k)
        per_process.append({e["case_id"]: e["rows"] for e in runner.read_jsonl(folder / "rows.jsonl")})
        envs += [{**env, "process": k} for env in runner._read_envs(folder / "env.json")]
    from bench.grid import case_from_dict

    config = runner._read_json(out_dir / "config.json")
    lines = []
    for case in config.get("cases") or []:
        case_id = case_from_dict(case).case_id
        if all(case_id in found for found in per_process):
            rows = [{**r, "process": k} for k, found in enumerate(per_process, start=1) for r in found[case_id]]
            lines.append(json.dumps({"case_id": case_id, "rows": rows}) + "\n")
    runner._atomic_write(out_dir / "rows.jsonl", "".join(lines))
    runner._atomic_write(out_dir / "env.json", json.dumps({"runs": envs}, indent=2))
    return runner.finalize(out_dir)


def process_rows(out_dir: str | Path) -> list[dict]:
    """Every row measured so far by the processes of a spread run, with their ``process`` number,
    finished grid or not (the merge holds only the cases that every process finished)."""
    from bench import runner

    root = Path(out_dir) / PROCESSES_DIR
    folders = sorted((f for f in root.iterdir() if f.name.isdigit()), key=lambda f: int(f.name)) \
        if root.is_dir() else []
    return [{**r, "process": int(f.name)} for f in folders for e in runner.read_jsonl(f / "rows.jsonl")
            for r in e["rows"]]


def main(argv: list[str] | None = None) -> int:
    """One process of a spread run (started by :func:`run_processes`)."""
    parser = argparse.ArgumentParser(prog="python -m bench.spread",
                                     description="one process of `python -m bench run --processes N`")
    parser.add_argument("--grid", required=True, help="config.json of the spread run")
    parser.add_argument("--out", required=True, help="this process's run folder")
    parser.add_argument("--device", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from bench import runner

    try:
        grid = grid_from_config(runner._read_json(Path(args.grid)))
        path = runner.run(grid, args.out, device=args.device, resume=args.resume, progress=not args.no_progress)
    except (runner.RunDirError, runner.ResultsFileError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C reaches both processes: the parent says what was kept
        return 130
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
