"""The benchmark runner: every case × provider, timed, checked against float64, written as it goes.

Output folder (``results/<name>`` by default):

- ``rows.jsonl``: one line per finished case, ``{"case_id": ..., "rows": [...]}``, appended and
  fsynced as each case ends, so an interrupted run keeps what it wrote and ``--resume`` skips it.
- ``env.json``: ``{"runs": [environment of each run segment]}`` (see :func:`bench.env.capture`).
- ``config.json``: the expanded grid.
- ``results.json`` / ``results.csv``: all rows, long form (written atomically at the end of each
  segment; the report also reads ``rows.jsonl`` of an unfinished run).

The row schema is :class:`Row`; its fields are the CSV columns (``pass_`` is written ``pass``).

:func:`run` is the command line's run (a progress bar or log lines); :func:`run_grid` is the
library's: it takes the mods in memory and a progress callback, and returns the results.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

import torch

from bench import env as env_mod
from bench import providers as prov
from bench.context import CaseContext, Slice, make_context
from bench.grid import Case, Grid, case_from_dict
from bench.lock import FolderBusyError, FolderLock
from bench.timing import GraphCaptureError, peak_memory, pooled, time_call, time_first_call
from flexcore.kernels import hopper
from flexcore.testing import within_tolerance
from variants.core import Mods

SCHEMA_VERSION = "flexlab-bench/1"

#: Mods given in memory: one :class:`variants.core.Mods` for every case, or a function building
#: them for a case (its shape); either replaces resolving the cases' variant specs.
ModsSource = Union[Mods, Callable[[Case], Mods]]
#: ``progress(done, total, case)``: called as each case starts (``done`` cases finished before
#: it) and as it ends (``done`` counting it); the last call of a complete run has done == total.
ProgressCallback = Callable[[int, int, Case], None]


@dataclass
class Row:
    """One (case, provider, metric) measurement.

    Attributes:
        run_id: id of the run segment that measured it (env.json has its environment).
        case_id: :attr:`bench.grid.Case.case_id`.
        variant ... pass_: the case's fields (``pass_`` is ``fwd``, ``fwd_bwd`` or ``decode``).
        density: fraction of BLOCK_SIZE blocks computed (the FLOP convention of docs/benchmark-method.md).
        provider: provider name, or ``baseline`` for the same-dtype reference errors.
        metric: see ``METRICS``.
        value: the number (None for status rows).
        unit: ``ms``, ``s``, ``bytes``, ``TFLOP/s``, ``GB/s``, ``abs``, ``rel``, ``bool``, ``count``.
        status: ``ok``; ``fail`` (a correctness metric over its tolerance); ``skipped`` (provider
            unavailable on this machine), ``unsupported`` (cannot express the case), ``error``.
        note: reason of a status, how the variant was expressed, the tolerance rule.
        ref_coverage: slices of the output checked against float64: ``all`` or ``b0/h0:2;...``.
        process: in a run of several processes (``run --processes N``, bench.spread), which one
            measured the row (1 to N); None in a run of one process.
    """

    run_id: str
    case_id: str
    variant: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dtype: str
    pass_: str
    density: float | None
    provider: str
    metric: str
    value: float | None
    unit: str
    status: str
    note: str = ""
    ref_coverage: str = ""
    process: int | None = None

    def to_dict(self) -> dict:
        """The row keyed by CSV column, in column order."""
        return {("pass" if k == "pass_" else k): v for k, v in dataclasses.asdict(self).items()}


#: Column order of results.csv.
COLUMNS = [("pass" if f.name == "pass_" else f.name) for f in dataclasses.fields(Row)]

#: metric -> (unit, meaning). Errors come as out_*, dq_*, dk_*, dv_*, d<captured name>_*.
METRICS = {
    "status": ("", "provider did not run this case: see status and note"),
    "time_ms": ("ms", "median time of one call (forward, or forward+backward)"),
    "time_ms_p20": ("ms", "20th percentile"),
    "time_ms_p80": ("ms", "80th percentile"),
    "reps": ("count", "timed repetitions"),
    "setup_s": ("s", "prepare(): BlockMask / dense mask construction"),
    "compile_s": ("s", "first call (compilation plus one run), synchronised"),
    "peak_mem_bytes": ("bytes", "peak memory of one call above what was allocated before it, plus "
                                "the masks the provider holds"),
    "tflops": ("TFLOP/s", "bench.flops.attention_flops / median time"),
    "gbps": ("GB/s", "decode only: bench.flops.decode_bytes / median time"),
    "tokens_per_s": ("tokens/s", "train_step only: batch · sequence length / median step time"),
    "loss": ("", "train_step only: sum(out · g) of the first input set (finite, else status fail)"),
    "*_max_abs": ("abs", "max |x - golden| against float64, over the checked slices (train_step: "
                         "out, dx, dparams of the whole block)"),
    "*_mean_abs": ("abs", "mean |x - golden|"),
    "*_rel_fro": ("rel", "||x - golden||_F / ||golden||_F"),
    "*_tolerance": ("abs", "2 * baseline max_abs + eps(dtype) (flexcore.testing.DEFAULT_EPS)"),
    "*_correct": ("bool", "1 when *_max_abs <= *_tolerance"),
}


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; results are meant to be shared
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_csv(path: Path, rows: list[dict]) -> None:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS})
    _atomic_write(path, buf.getvalue())


def read_jsonl(path: Path) -> list[dict]:
    """Finished cases of a rows.jsonl; a line cut short by an interruption is ignored."""
    cases = []
    if not path.exists():
        return cases
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and "case_id" in entry and "rows" in entry:
                cases.append(entry)
    return cases


class RunDirError(RuntimeError):
    """The output folder holds a previous run: resume it or replace it."""


class RunDirBusy(RunDirError):
    """Another process is writing the output folder (the message names it)."""


class ResultsFileError(ValueError):
    """A results file (or a run folder's JSON) is malformed; the message names the path and why."""


# ---- one case --------------------------------------------------------------------------------


def _fallback_notes(before: dict) -> list[str]:
    """The reasons for which flexcore's Gluon kernels turned calls to the Triton template since
    ``before`` (hopper.fallback_counts): a row timed on the template says so, in every case that
    meets a kept failure, not only the first (its warning is given once per process)."""
    counts, reasons = hopper.fallback_counts(), hopper.fallbacks()
    found = dict.fromkeys(reasons[key] for key, n in counts.items() if n > before.get(key, 0) and key in reasons)
    return [f"Gluon kernel not used ({reason}): the Triton template's times" for reason in found]


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


def _metrics(parts: list[torch.Tensor], golden: list[torch.Tensor]) -> dict:
    from flexcore.testing import error_metrics

    out = torch.cat([p.detach().reshape(-1).to(torch.float64).to(g.device) for p, g in zip(parts, golden)])
    ref = torch.cat([g.detach().reshape(-1).to(torch.float64) for g in golden])
    return error_metrics(out, ref)


def _eps(dtype: torch.dtype) -> float:
    from flexcore.testing import DEFAULT_EPS

    return DEFAULT_EPS.get(dtype, 1e-5)


class CaseRunner:
    """Runs one case over the providers and returns its rows."""

    def __init__(self, case: Case, grid: Grid, device: torch.device, run_id: str,
                 availability: dict[str, tuple[bool, str]], mods: ModsSource | None = None):
        self.case, self.grid, self.device, self.run_id = case, grid, device, run_id
        self.availability = availability
        self.mods_source = mods
        self.rows: list[Row] = []
        self.ctx: CaseContext | None = None
        self.coverage = ""
        self.density: float | None = None
        self._deferred: list = []  # (provider, step) timed in interleaved rounds (_time_rounds)

    def row(self, provider: str, metric: str, value, unit: str = "", status: str = "ok", note: str = ""):
        c = self.case
        value = None if value is None else float(value)
        self.rows.append(Row(self.run_id, c.case_id, c.variant, c.batch, c.q_heads, c.kv_heads, c.q_len,
                             c.kv_len, c.head_dim, c.v_head_dim, c.dtype, c.pass_, self.density,
                             provider, metric, value, unit, status, note, self.coverage))

    def run(self) -> list[Row]:
        c = self.case
        try:
            self.ctx = make_context(c, self.grid.settings, self.device, mods=self.case_mods())
            self.density = self.ctx.density()
            self.coverage = self.ctx.coverage()
        except Exception as exc:
            for name in self.grid.providers:
                self.row(name, "status", None, status="error", note=f"case setup failed: {_error_text(exc)}")
            self._cleanup()
            return self.rows
        try:
            self._baseline()
            for name in self.grid.providers:
                self._provider(name)
            self._time_rounds()
        finally:
            self._cleanup()
        return self.rows

    def case_mods(self) -> Mods | None:
        """The in-memory mods of this case, or None to resolve its variant spec."""
        source = self.mods_source
        return source(self.case) if callable(source) else source

    def _cleanup(self):
        if self.ctx is not None:
            self.ctx.release()
        self.ctx = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- golden and baseline ----
    def _golden(self):
        return self.ctx.golden()

    def _baseline(self):
        """Errors of the same-dtype baseline: SDPA math, or flexcore's reference with upcast=False."""
        ctx = self.ctx
        self.baseline = None
        try:
            golden = self._golden()
        except Exception as exc:
            self.golden_error = _error_text(exc)
            self.row("baseline", "status", None, status="error",
                     note=f"float64 reference failed: {self.golden_error}")
            return
        self.golden_error = None
        outputs, name = None, None
        try:
            outputs = self._sdpa_math_slices()
            name = "sdpa_math"
        except Exception as exc:
            reason = _error_text(exc)
            try:
                outputs = ctx.reference_baseline()
                name = f"flexcore.reference(upcast=False) (SDPA math: {reason})"
            except Exception as exc2:
                self.row("baseline", "status", None, status="error",
                         note=f"no same-dtype baseline: SDPA math: {reason}; reference: {_error_text(exc2)}")
                return
        errors = {}
        for key in self._error_keys():
            try:
                errors[key] = _metrics(outputs[key] if key in ("out", "dq", "dk", "dv")
                                       else [outputs["captured"][self._cap_index(key)]],
                                       golden[key] if key in ("out", "dq", "dk", "dv")
                                       else [golden["captured"][self._cap_index(key)]])
            except Exception as exc:
                self.row("baseline", f"{key}_max_abs", None, status="error", note=_error_text(exc))
                continue
            for metric in ("max_abs", "mean_abs", "rel_fro"):
                self.row("baseline", f"{key}_{metric}", errors[key][metric],
                         "rel" if metric == "rel_fro" else "abs", note=name)
        self.baseline = errors

    def _error_keys(self) -> list[str]:
        keys = ["out"]
        if self.ctx.needs_grad:
            keys += ["dq", "dk", "dv"] + [f"d{n}" for n, _ in self.ctx.learnable_named]
        return keys

    def _cap_index(self, key: str) -> int:
        names = [f"d{n}" for n, _ in self.ctx.learnable_named]
        return names.index(key)

    def _sdpa_math_slices(self) -> dict:
        ctx = self.ctx
        first = ctx.inputs[0]
        learnable = ctx.learnable
        dout = ctx.correctness_dout()
        result = {"out": [], "dq": [], "dk": [], "dv": []}
        cap = [None] * len(learnable)
        for s in ctx.slices():
            mods = ctx.slice_mods(s)
            q, k, v = (t.detach() for t in ctx.slice_tensors(s, first.q, first.k, first.v))
            with torch.set_grad_enabled(ctx.needs_grad):
                if ctx.needs_grad:
                    for t in (q, k, v):
                        t.requires_grad_(True)
                out = prov.sdpa_reference(ctx, q, k, v, mods, grad=bool(learnable) and ctx.needs_grad)
                if ctx.needs_grad:
                    g = s.q_part(dout)
                    grads = torch.autograd.grad(out, [q, k, v, *learnable], g, allow_unused=True)
                    for key, grad in zip(("dq", "dk", "dv"), grads[:3]):
                        result[key].append(grad)
                    for i, grad in enumerate(grads[3:]):
                        if grad is not None:
                            cap[i] = grad.double() if cap[i] is None else cap[i] + grad.double()
            result["out"].append(out.detach())
        result["captured"] = [g if g is not None else torch.zeros_like(t, dtype=torch.float64)
                              for g, t in zip(cap, learnable)]
        return result

    # ---- one provider ----
    def _provider(self, name: str):
        try:
            self._run_provider(name)
        except Exception as exc:  # a bug in one provider must not lose the rest of the run
            self._error(name, "unexpected", exc)

    def _run_provider(self, name: str):
        ctx, c = self.ctx, self.case
        provider = prov.PROVIDERS.get(name)
        if provider is not None and provider.passes is not None and c.pass_ not in provider.passes:
            return
        ok, why = self.availability.get(name, (False, "unknown provider"))
        if not ok or provider is None:
            self.row(name, "status", None, status="skipped", note=why)
            return
        try:
            start = time.perf_counter()
            prepared = provider.prepare(ctx)
            prov_setup = time.perf_counter() - start
        except (prov.Unsupported, NotImplementedError) as exc:
            self.row(name, "status", None, status="unsupported", note=_error_text(exc))
            return
        except Exception as exc:
            self._error(name, "prepare", exc)
            return
        step = self._step(prepared)
        declined = hopper.fallback_counts()
        try:
            compile_s = time_first_call(lambda: step(0), self.device)
        except (prov.Unsupported, NotImplementedError) as exc:
            what = "backward" if c.pass_ == "fwd_bwd" and self._forward_works(prepared) else "call"
            self.row(name, "status", None, status="unsupported", note=f"{what}: {_error_text(exc)}")
            return
        except Exception as exc:
            self._error(name, "first call", exc)
            return
        note = prepared.note  # after the first call, which may have changed how the case runs
        note = "; ".join(filter(None, [note, *_fallback_notes(declined)]))
        self.row(name, "setup_s", prov_setup, "s", note=note)
        self.row(name, "compile_s", compile_s, "s", note=note)
        memory = []
        self._correctness(name, prepared, memory)
        try:
            # On the CPU the correctness run (the same work) is measured instead of one more
            # call: calls under Triton's interpreter cost seconds.
            peak, method = memory[0] if memory else peak_memory(lambda: step(0), self.device)
            if peak is not None:
                peak += prepared.held_bytes
            self.row(name, "peak_mem_bytes", peak, "bytes", note=method)
        except Exception as exc:
            self._error(name, "timing", exc)
            return
        s = self.grid.settings
        graphs = self.device.type == "cuda" and c.pass_ in s.graph_passes()
        if s.rounds > 1 and not graphs:
            self._deferred.append((name, step))
            return
        try:
            graph_note, eager = "", None
            if graphs:
                try:
                    timing = self._timed(step, True)
                    eager = self._timed(step, False)  # beside it: the same call launched from Python each time
                except GraphCaptureError as exc:
                    graph_note = f"; CUDA graph capture failed ({exc}), timed eagerly"
                    timing = self._timed(step, False)
            else:
                timing = self._timed(step, False)
        except Exception as exc:
            self._error(name, "timing", exc)
            return
        self._timing_result(name, timing, eager, graph_note)

    def _timed(self, step, cuda_graph: bool, share: int = 1):
        """bench.timing.time_call of ``step`` under the grid's settings; ``share``: this timing is
        one of that many rounds, with a share of the repetitions (and its own warm-up)."""
        s = self.grid.settings
        min_reps = -(-s.min_reps // share)
        return time_call(step, len(self.ctx.inputs), self.device, warmup_ms=s.warmup_ms,
                         rep_ms=s.rep_ms / share, min_reps=min_reps, max_reps=max(min_reps, s.max_reps // share),
                         cpu_reps=-(-s.cpu_reps // share), cuda_graph=cuda_graph, pin_host=s.pin_host)

    def _time_rounds(self):
        """Time the deferred providers in the grid's ``rounds``, one after another in each round,
        in reverse order every other round (a drift that is linear in time then falls on each
        alike), and report each over its rounds' repetitions pooled."""
        rounds = self.grid.settings.rounds
        deferred, self._deferred = self._deferred, []
        timings: dict[str, list] = {name: [] for name, _ in deferred}
        for r in range(rounds):
            for name, step in (deferred if r % 2 == 0 else deferred[::-1]):
                if name not in timings:  # its timing failed in an earlier round
                    continue
                try:
                    timings[name].append(self._timed(step, False, rounds))
                except Exception as exc:
                    del timings[name]
                    self._error(name, "timing", exc)
        for name, parts in timings.items():
            try:
                self._timing_result(name, pooled(parts), None, f"; {rounds} interleaved rounds")
            except Exception as exc:  # one provider's rows must not lose the others'
                self._error(name, "unexpected", exc)

    def _timing_result(self, name: str, timing, eager, extra_note: str) -> None:
        """The rows of a provider's timing: times, repetitions, TFLOP/s (and GB/s for decoding)."""
        ctx, c = self.ctx, self.case
        pinned = "" if timing.pinned_core is None else f", host threads on core {timing.pinned_core}"
        tnote = f"{timing.method}, {len(ctx.inputs)} rotated input set(s){pinned}{extra_note}"
        if eager is not None:
            self.row(name, "time_ms_eager", eager.median_ms, "ms",
                     note=f"{eager.method}: launched from Python at every call (host time included)")
        self.timing_rows(name, timing, tnote)
        seconds = timing.median_ms * 1e-3
        if seconds > 0:
            self.row(name, "tflops", ctx.flops() / seconds / 1e12, "TFLOP/s",
                     note=f"density {self.density:.4f}")
            if c.pass_ == "decode":
                self.row(name, "gbps", ctx.bytes_moved() / seconds / 1e9, "GB/s",
                         note="K and V read once, density-scaled")

    def _forward_works(self, prepared) -> bool:
        try:
            with torch.no_grad():
                first = self.ctx.inputs[0]
                prepared.call(first.q, first.k, first.v)
            return True
        except Exception:
            return False

    def timing_rows(self, name: str, timing, note: str) -> None:
        """The rows of one timing: median, p20, p80 (ms) and the repetitions."""
        self.row(name, "time_ms", timing.median_ms, "ms", note=note)
        self.row(name, "time_ms_p20", timing.p20_ms, "ms", note=note)
        self.row(name, "time_ms_p80", timing.p80_ms, "ms", note=note)
        self.row(name, "reps", timing.reps, "count", note=note)

    def _error(self, name: str, stage: str, exc: BaseException):
        note = f"{stage}: {_error_text(exc)}"
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            note = f"{stage}: CUDA out of memory"
        self.row(name, "status", None, status="error", note=note)
        if os.environ.get("FLEXLAB_BENCH_TRACEBACK"):
            traceback.print_exc()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _step(self, prepared: prov.Prepared):
        ctx = self.ctx
        inputs = ctx.inputs
        call = prepared.call
        if ctx.needs_grad:
            targets = prepared.timing_grad_targets

            def step(i):
                x = inputs[i]
                out = call(x.q, x.k, x.v)
                return torch.autograd.grad(out, [x.q, x.k, x.v, *targets], x.dout)
        else:
            def step(i):
                x = inputs[i]
                with torch.no_grad():
                    return call(x.q, x.k, x.v)
        return step

    def _correctness(self, name: str, prepared: prov.Prepared, memory: list):
        ctx = self.ctx
        if self.baseline is None:
            self.row(name, "out_correct", None, status="error",
                     note="no float64 golden or baseline for this case (see the baseline rows)")
            return
        first = ctx.inputs[0]
        learnable = ctx.learnable
        call = prepared.grad_call or prepared.call
        result = {}

        def run():
            if ctx.needs_grad:
                result["out"] = call(first.q, first.k, first.v)
                result["grads"] = torch.autograd.grad(
                    result["out"], [first.q, first.k, first.v, *learnable], ctx.correctness_dout(),
                    allow_unused=True)
            else:
                with torch.no_grad():
                    result["out"] = call(first.q, first.k, first.v)
                result["grads"] = ()

        try:
            if self.device.type == "cuda":
                run()
            else:
                memory.append(peak_memory(run, self.device))
            out, grads = result["out"], result["grads"]
        except (prov.Unsupported, NotImplementedError) as exc:
            self.row(name, "out_correct", None, status="unsupported", note=_error_text(exc))
            return
        except Exception as exc:
            self._error(name, "correctness run", exc)
            return
        golden = self._golden()
        parts = {"out": out}
        if grads:
            parts.update(dq=grads[0], dk=grads[1], dv=grads[2])
        eps = _eps(ctx.dtype)
        for key in self._error_keys():
            if key not in self.baseline:
                continue
            missing = ""
            if key in ("out", "dq", "dk", "dv"):
                full = parts[key]
                part = Slice.q_part if key in ("out", "dq") else Slice.kv_part
                slices = [part(s, full) for s in ctx.slices()]
                ref = golden[key]
            else:
                i = self._cap_index(key)
                grad = grads[3 + i]
                ref = [golden["captured"][i]]
                if grad is None:
                    # Right only where the true gradient is zero (a tensor read by the mask alone).
                    missing = "no gradient reached the captured tensor (counted as zero); "
                    grad = torch.zeros_like(ref[0])
                slices = [grad]
            errors = _metrics(slices, ref)
            tol = 2.0 * self.baseline[key]["max_abs"] + eps
            passed = within_tolerance(errors["max_abs"], tol)
            for metric in ("max_abs", "mean_abs", "rel_fro"):
                self.row(name, f"{key}_{metric}", errors[metric], "rel" if metric == "rel_fro" else "abs")
            rule = missing + f"max_abs <= 2 * baseline {self.baseline[key]['max_abs']:.3g} + {eps:g}"
            self.row(name, f"{key}_tolerance", tol, "abs", note=rule)
            self.row(name, f"{key}_correct", 1 if passed else 0, "bool", status="ok" if passed else "fail",
                     note=rule)


# ---- the run ---------------------------------------------------------------------------------


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="case", dynamic_ncols=True, file=sys.stderr)


def prepare_out_dir(out_dir: Path, resume: bool, force: bool, grid: Grid | None = None,
                    processes: int | None = None) -> list[dict]:
    """Check the output folder (its lock held by the caller); return the finished cases to keep
    (resume), or refuse.

    ``processes`` is the run's process count (``--processes N``, bench.spread); None is a run of
    one process. A folder holds a run when it has a rows.jsonl or a spread run's process folders.

    Raises:
        RunDirError: the folder holds a run and neither ``resume`` nor ``force`` is given, or
            ``resume`` with a ``grid`` or a process count that differs from the stored one (the
            message names the differing keys, or ``--processes N``).
    """
    from bench.spread import PROCESSES_DIR

    out_dir.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.glob("*.tmp"):  # an atomic write cut short by a kill
        leftover.unlink(missing_ok=True)
    jsonl = out_dir / "rows.jsonl"
    existing = read_jsonl(jsonl)
    spread_dir = out_dir / PROCESSES_DIR
    if (jsonl.exists() or spread_dir.is_dir()) and not resume:
        if not force:
            what = f"{len(existing)} finished cases" if jsonl.exists() else f"its process folders in {spread_dir}"
            raise RunDirError(f"{out_dir} holds a previous run ({what}); pass --resume to continue it "
                              "or --force to start over")
        for name in ("rows.jsonl", "results.json", "results.csv", "env.json", "config.json"):
            (out_dir / name).unlink(missing_ok=True)
        # A spread run's process folders are its rows too: starting over removes them.
        shutil.rmtree(spread_dir, ignore_errors=True)
        return []
    config_path = out_dir / "config.json"
    stored = _read_json(config_path) if resume and config_path.exists() else None
    if stored is not None:
        # Checked before the grid: resuming with another count would mix a spread run's rows with
        # a plain run's (or the reverse) in one folder and rewrite its config.json.
        stored_count = _stored_processes(out_dir, stored)
        if stored_count != (processes or 1):
            asked = f"--resume --processes {processes}" if processes else "--resume"
            kept = (f"with --processes {stored_count}" if stored_count > 1 else "without --processes")
            runs = f"{stored_count} processes" if stored_count > 1 else "one process"
            raise RunDirError(f"{asked}: {out_dir} holds a run of {runs}; resume it {kept}, or pass "
                              "--force to start over")
    if resume and grid is not None:
        if stored is None and (existing or spread_dir.is_dir()):
            raise RunDirError(f"--resume: {out_dir} has finished cases but no config.json to compare "
                              "the config with; pass --force to start over")
        if stored is not None:
            from bench.grid import config_differences

            current = grid.to_dict()
            if processes:
                current["processes"] = processes
            try:
                differences = config_differences(stored, current)
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                raise RunDirError(f"--resume: {out_dir / 'config.json'} is not a bench config "
                                  f"({type(exc).__name__}: {exc}); pass --force to start over") from None
            if differences:
                raise RunDirError(f"--resume: {out_dir} was run with another config; differing keys: "
                                  + "; ".join(differences) + ". Resume with the same config, or pass "
                                  "--force to start over")
    if resume and jsonl.exists():
        # Rewrite without a line cut short by the interruption, so appends start on a clean line.
        _atomic_write(jsonl, "".join(json.dumps(e) + "\n" for e in existing))
    return existing


def _stored_processes(out_dir: Path, stored) -> int:
    """The process count of the run in ``out_dir``: its config.json's ``processes``, else 1 (a
    plain run). Raises RunDirError for a count that is not an integer >= 2."""
    if not isinstance(stored, dict):
        raise RunDirError(f"--resume: {out_dir / 'config.json'} is not a bench config (a "
                          f"{type(stored).__name__}, expected a mapping); pass --force to start over")
    count = stored.get("processes")
    if count is None:
        return 1
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        raise RunDirError(f"--resume: {out_dir / 'config.json'} has processes={count!r}, expected an "
                          "integer >= 2; pass --force to start over")
    return count


def run(grid: Grid, out_dir: str | Path, *, device: torch.device | str | None = None, resume: bool = False,
        force: bool = False, progress: bool = True, log=None) -> Path:
    """Run a grid into ``out_dir`` and return the path of results.json (the command line's run:
    a progress bar or ``[i/N]`` log lines; :func:`run_grid` is the library's).

    The folder's lock (:class:`bench.lock.FolderLock`) is held from the first check to the last
    write, so a second run or ``--resume`` on the same folder is refused while this one runs.

    Example:
        >>> from bench.grid import build_grid, load_config
        >>> run(build_grid(load_config("tiny"), "tiny"), "results/tiny")

    Raises:
        RunDirError: the folder holds a run (see :func:`prepare_out_dir`) or another process is
            writing it (:class:`RunDirBusy`, naming that process).
        ConfigError: invalid settings.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    return _run(grid, Path(out_dir), device, resume, force, log, bar=progress)


def run_grid(grid: Grid, out_dir: str | Path | None = None, *, mods: ModsSource | None = None,
             progress: ProgressCallback | None = None, device: torch.device | str | None = None,
             resume: bool = False, force: bool = False, log: Callable[[str], None] | None = None
             ) -> dict:
    """Run a grid and return its results: the results.json payload (``rows``, ``envs``,
    ``config``, ``complete``, ...).

    Args:
        grid: the cases, providers and settings.
        out_dir: the run folder (written as by :func:`run`); None runs in a temporary folder
            that is removed afterwards.
        mods: the cases' mods in memory, instead of resolving each case's variant spec (which is
            then only the label of its rows): one :class:`variants.core.Mods` for every case, or
            ``mods(case) -> Mods`` (called once per case, when the case starts).
        progress: ``progress(done, total, case)`` as each case starts and as it ends.
        device: where to run (default: the GPU when there is one).
        resume, force: as :func:`run` (for an ``out_dir`` that holds a run).
        log: receives the run's messages (providers skipped, a time limit reached); default:
            dropped.

    Example:
        >>> import variants
        >>> from bench.grid import Case, Grid, Settings
        >>> mods = variants.get("sliding_window").make(Q_LEN=256, window_size=64)
        >>> case = Case("my window", 1, 8, 8, 256, 256, 64, 64, "float32", "fwd")
        >>> rows = run_grid(Grid("mine", [case], ["flexlab"], Settings()), mods=mods)["rows"]

    Raises:
        RunDirError: as :func:`run`.
    """
    log = log or (lambda msg: None)
    if out_dir is not None:
        return _read_json(_run(grid, Path(out_dir), device, resume, force, log, mods=mods,
                               progress=progress))
    with tempfile.TemporaryDirectory(prefix="flexlab-bench-") as tmp:
        return _read_json(_run(grid, Path(tmp), device, resume, force, log, mods=mods,
                               progress=progress))


def _run(grid: Grid, out_dir: Path, device, resume: bool, force: bool, log, *, bar: bool = False,
         mods: ModsSource | None = None, progress: ProgressCallback | None = None) -> Path:
    device = torch.device(device) if device is not None else default_device()
    grid.settings.validate()
    from flexcore._runtime import prepare_triton

    prepare_triton()  # before anything imports triton: the interpreter must be chosen first on CPUs
    try:
        lock = FolderLock(out_dir, "bench run").acquire()
    except FolderBusyError as exc:
        raise RunDirBusy(str(exc)) from None
    try:
        return _run_locked(grid, out_dir, device, resume, force, bar, log, mods, progress)
    finally:
        lock.release()


def _run_locked(grid: Grid, out_dir: Path, device: torch.device, resume: bool, force: bool,
                bar_enabled: bool, log, mods: ModsSource | None,
                progress: ProgressCallback | None) -> Path:
    existing = prepare_out_dir(out_dir, resume, force, grid)
    done = {e["case_id"] for e in existing}
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    _atomic_write(out_dir / "config.json", json.dumps(grid.to_dict(), indent=2))
    env = {"run_id": run_id, **env_mod.capture(device, peak=True)}
    env_path = out_dir / "env.json"
    envs = _read_envs(env_path) if resume else []
    _atomic_write(env_path, json.dumps({"runs": envs + [env]}, indent=2))
    availability = prov.availability(device, grid.providers)
    for name, (ok, why) in availability.items():
        log(f"provider {name}: {'available' if ok else 'skipped'} ({why})")
    todo = [c for c in grid.cases if c.case_id not in done]
    total, finished = len(grid.cases), len(grid.cases) - len(todo)
    if done:
        log(f"resuming: {finished} of {total} cases already done")
    bar = _progress(total, finished, bar_enabled)
    started = time.monotonic()
    limit = grid.settings.max_minutes * 60
    stopped_early = 0
    try:
        with open(out_dir / "rows.jsonl", "a") as jsonl:
            for i, case in enumerate(todo):
                # Each invocation runs at least one case, so that --resume always makes progress.
                if limit and i and time.monotonic() - started > limit:
                    stopped_early = len(todo) - i
                    break
                if progress is not None:
                    progress(finished, total, case)
                t0 = time.monotonic()
                rows = _case_runner(case)(case, grid, device, run_id, availability, mods).run()
                jsonl.write(json.dumps({"case_id": case.case_id, "rows": [r.to_dict() for r in rows]}) + "\n")
                jsonl.flush()
                os.fsync(jsonl.fileno())
                finished += 1
                if progress is not None:
                    progress(finished, total, case)
                if bar is not None:
                    bar.set_postfix_str(case.case_id[:60])
                    bar.update(1)
                else:
                    log(f"[{finished}/{total}] {case.case_id} ({time.monotonic() - t0:.1f}s)")
    finally:
        if bar is not None:
            bar.close()
        path = finalize(out_dir, grid)
    if stopped_early:
        log(f"stopped after {grid.settings.max_minutes:g} minutes with {stopped_early} cases left; run "
            "again with --resume to finish")
    return path


def _case_runner(case: Case):
    if case.pass_ == "train_step":
        from bench.train_step import TrainStepRunner

        return TrainStepRunner
    return CaseRunner


def _read_json(path: Path):
    """A JSON file's data; raises ResultsFileError naming the path and the parser's reason."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column "
                               f"{exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise ResultsFileError(f"{path}: not a text file ({exc.reason})") from None


def _read_envs(path: Path) -> list:
    if not path.exists():
        return []
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("runs", []), list):
        raise ResultsFileError(f"{path}: expected {{\"runs\": [environment, ...]}}")
    return _check_envs(path, data.get("runs", []), "runs")


def _check_envs(path: Path, envs, key: str) -> list:
    """``envs`` when it is a list of environment mappings; the reports read keys of each
    (bench.env.label), so anything else is a ResultsFileError naming ``path`` and ``key``."""
    if not isinstance(envs, list):
        raise ResultsFileError(f"{path}: '{key}' is {type(envs).__name__}, expected a list of environments")
    for i, env in enumerate(envs):
        if not isinstance(env, dict):
            raise ResultsFileError(f"{path}: {key}[{i}] is {type(env).__name__} {env!r}, expected an "
                                   "environment mapping ({\"gpu_name\": ..., ...})")
    return envs


def collect(out_dir: Path, grid: Grid | None = None) -> dict:
    """The results.json payload of a run folder, from rows.jsonl (the record that survives an
    interruption), env.json and config.json. Cases are counted once each, the first record kept;
    records of cases outside config.json are left out and listed as ``cases_outside_config`` (their
    row count as ``rows_outside_config``)."""
    out_dir = Path(out_dir)
    envs = _read_envs(out_dir / "env.json")
    config_path = out_dir / "config.json"
    config = _read_json(config_path) if config_path.exists() else (grid.to_dict() if grid else {})
    if not isinstance(config, dict):
        raise ResultsFileError(f"{config_path}: expected a mapping, got {type(config).__name__}")
    try:
        planned = {case_from_dict(c).case_id for c in config.get("cases") or []}
    except (TypeError, AttributeError) as exc:
        raise ResultsFileError(f"{config_path}: 'cases' is not a list of cases ({exc})") from None
    cases, seen, outside, outside_rows = [], set(), [], 0
    for entry in read_jsonl(out_dir / "rows.jsonl"):
        if planned and entry["case_id"] not in planned:
            outside.append(entry["case_id"])
            outside_rows += len(entry["rows"]) if isinstance(entry["rows"], list) else 0
        elif entry["case_id"] not in seen:
            seen.add(entry["case_id"])
            cases.append(entry)
    rows = [r for e in cases for r in e["rows"]]
    total = len(planned) or len(cases)
    payload = {"schema": SCHEMA_VERSION, "name": config.get("name", out_dir.name), "columns": COLUMNS,
               "complete": len(cases) >= total, "cases_done": len(cases), "cases_total": total,
               "envs": envs, "config": config, "rows": rows}
    if outside:  # only a hand-edited rows.jsonl has these: the lock and --resume's check prevent them
        payload["cases_outside_config"] = outside
        payload["rows_outside_config"] = outside_rows
    return payload


def finalize(out_dir: Path, grid: Grid | None = None) -> Path:
    """Write results.json and results.csv from rows.jsonl (atomically); the caller holds the
    folder's lock."""
    out_dir = Path(out_dir)
    payload = collect(out_dir, grid)
    path = out_dir / "results.json"
    _atomic_write(path, json.dumps(payload, indent=1))
    write_csv(out_dir / "results.csv", payload["rows"])
    return path


#: Columns a results row must have for the reports: the case, the provider and the measurement.
REQUIRED_COLUMNS = ("variant", "batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "dtype",
                    "pass", "provider", "metric", "value", "status")
_INT_COLUMNS = ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "v_head_dim", "process")


def _check_rows(path: Path, rows) -> list[dict]:
    if not isinstance(rows, list):
        raise ResultsFileError(f"{path}: 'rows' is {type(rows).__name__}, expected a list of rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ResultsFileError(f"{path}: row {i} is {type(row).__name__}, expected a mapping")
        missing = [c for c in REQUIRED_COLUMNS if c not in row]
        if missing:
            raise ResultsFileError(f"{path}: row {i} lacks column(s) {missing}")
        for c in _INT_COLUMNS:
            value = row.get(c)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ResultsFileError(f"{path}: row {i} has {c}={value!r}, expected an integer")
        value = row.get("value")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ResultsFileError(f"{path}: row {i} has value={value!r}, expected a number or null")
    return rows


def load_results(path: str | Path) -> dict:
    """Read a results.json, a results.csv, or a run folder (from its rows.jsonl when it has one, so
    that an interrupted or running run reads as far as it got; nothing is written).

    Raises:
        FileNotFoundError: nothing to read at ``path``.
        ResultsFileError: a malformed file, with its path and the reason.
    """
    path = Path(path)
    if path.is_dir():
        if (path / "rows.jsonl").exists():
            data = collect(path)
            _check_rows(path / "rows.jsonl", data["rows"])
            return data
        if (path / "results.json").exists():
            return load_results(path / "results.json")
        raise FileNotFoundError(f"{path} holds no results.json or rows.jsonl")
    if not path.exists():
        raise FileNotFoundError(f"results file {path} does not exist")
    if path.suffix == ".csv":
        import csv

        try:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
                if missing:
                    raise ResultsFileError(f"{path}: not a bench results CSV (no column(s) {missing})")
                rows = []
                for r in reader:
                    line = reader.line_num
                    # DictReader pads a short row with None and files extra fields under None: a
                    # file cut short (a full disk, `head -c`) must not read as rows of blanks.
                    if None in r or any(v is None for v in r.values()):
                        given = len([v for k, v in r.items() if k is not None and v is not None])
                        given += len(r.get(None) or [])
                        raise ResultsFileError(f"{path} line {line}: {given} fields, expected "
                                               f"{len(reader.fieldnames)} (the file is cut short or "
                                               "malformed; read its run folder or results.json "
                                               "instead)")
                    for k in _INT_COLUMNS:
                        try:
                            r[k] = int(r[k]) if r.get(k) not in (None, "") else None
                        except ValueError:
                            raise ResultsFileError(f"{path} line {line}: {k}={r[k]!r} is not an "
                                                   "integer") from None
                    for k in ("density", "value"):
                        try:
                            r[k] = float(r[k]) if r.get(k) not in (None, "") else None
                        except ValueError:
                            raise ResultsFileError(f"{path} line {line}: {k}={r[k]!r} is not a "
                                                   "number") from None
                    rows.append(r)
        except (UnicodeDecodeError, csv.Error) as exc:
            raise ResultsFileError(f"{path}: not a readable CSV ({exc})") from None
        envs = _read_envs(path.parent / "env.json")
        return {"schema": SCHEMA_VERSION, "name": path.parent.name, "envs": envs, "rows": rows}
    data = _read_json(path)
    if not isinstance(data, dict) or "rows" not in data:
        raise ResultsFileError(f"{path}: not a bench results file (no 'rows')")
    _check_rows(path, data["rows"])
    _check_envs(path, data.get("envs") or [], "envs")
    return data


# ---- the exit status -------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What a finished run says to scripts: see :func:`verdict`."""

    measured: int  #: (case, provider) pairs with a time
    errors: int  #: (case, provider) pairs whose status is error
    failed_checks: list  #: "case_id provider metric" of correctness checks over tolerance
    not_run: int  #: (case, provider) pairs skipped or unsupported

    @property
    def nothing_measured(self) -> bool:
        return self.measured == 0

    def exit_code(self, keep_going: bool = False) -> int:
        """0 when something was measured and every check passed (or ``keep_going``), else 1."""
        if self.nothing_measured or (self.failed_checks and not keep_going):
            return 1
        return 0

    def summary(self) -> str:
        text = (f"{self.measured} measured, {self.errors} errors, {self.not_run} skipped or unsupported, "
                f"{len(self.failed_checks)} correctness checks failed")
        if self.failed_checks:
            text += f" (first: {self.failed_checks[0]})"
        return text


def verdict(rows: list[dict]) -> Verdict:
    """Count a run's rows: which (case, provider) pairs were timed, errored or did not run, and
    which correctness checks failed."""
    status: dict = {}
    timed, failed = set(), []
    for r in rows:
        if r["provider"] == "baseline":
            continue
        key = (r.get("case_id"), r["provider"])
        if r["metric"] == "status":
            status[key] = r["status"]
        elif r["metric"] == "time_ms" and r["status"] == "ok":
            timed.add(key)
        elif r["status"] == "error":
            status.setdefault(key, "error")
        if r["status"] == "fail":
            failed.append(f"{r.get('case_id')} {r['provider']} {r['metric']}")
    errors = sum(1 for k, v in status.items() if v == "error" and k not in timed)
    not_run = sum(1 for v in status.values() if v in ("skipped", "unsupported"))
    return Verdict(len(timed), errors, failed, not_run)
