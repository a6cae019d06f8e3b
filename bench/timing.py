"""Timing and peak memory of a prepared call: CUDA events on the GPU, a wall clock on the CPU."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Timing:
    """Quantiles of one call's time, in milliseconds, over ``reps`` repetitions."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    method: str  # "cuda_events", "cuda_graph" or "wall_clock"
    pinned_core: int | None = None  # the core the process's threads ran on while timed (pin_host)
    samples: tuple = dataclasses.field(default=(), repr=False, compare=False)  # each repetition, ms


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty sequence."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(times_ms: Sequence[float], method: str) -> Timing:
    return Timing(statistics.median(times_ms), quantile(times_ms, 0.2), quantile(times_ms, 0.8),
                  len(times_ms), method, samples=tuple(times_ms))


def pooled(timings: Sequence[Timing]) -> Timing:
    """One Timing of the repetitions of several (rounds of the same call): quantiles over all of
    them, with the first's method and pinned core."""
    first = timings[0]
    return dataclasses.replace(summarize([t for timing in timings for t in timing.samples], first.method),
                               pinned_core=first.pinned_core)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _current_core() -> int | None:
    """The core this thread last ran on (field 39 of /proc/thread-self/stat), or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[37])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def pinned_host(enabled: bool = True):
    """Within it, every thread of this process (the caller's, autograd's device threads, any
    other) runs on one core: the one the caller is on. Yields that core, or None where pinning is
    off or not possible (no sched_setaffinity, no /proc). The threads' own sets come back after.

    Why (docs/decisions.md#host-pinning): on the GPU machines a forward+backward call's host time per
    call halves when its threads share one core (caches and clocks stay warm; the autograd
    engine's hand-offs between the caller and its device thread do not cross cores), and it
    spreads less; rows whose host time meets their GPU time otherwise move by up to 40% from
    one machine to the next. Every provider is timed the same way."""
    core = _current_core() if enabled and hasattr(os, "sched_setaffinity") else None
    saved: dict[int, set] = {}
    if core is not None:
        try:
            if core not in os.sched_getaffinity(0):
                core = min(os.sched_getaffinity(0))
            for tid in (int(t) for t in os.listdir("/proc/self/task")):
                try:
                    saved[tid] = os.sched_getaffinity(tid)
                    os.sched_setaffinity(tid, {core})
                except OSError:  # the thread ended meanwhile, or may not be moved
                    saved.pop(tid, None)
        except OSError:
            core = None
    try:
        yield core if saved else None
    finally:
        for tid, cores in saved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass


def time_call(fn: Callable[[int], object], n_sets: int, device: torch.device, *, warmup_ms: float = 25,
              rep_ms: float = 100, min_reps: int = 10, max_reps: int = 200, cpu_reps: int = 5,
              cuda_graph: bool = False, pin_host: bool = False) -> Timing:
    """Time ``fn(i)`` (i picks one of ``n_sets`` input sets, rotated so that caches don't flatter).

    On CUDA: warm-up for ``warmup_ms``, then ``clamp(rep_ms / estimate, min_reps, max_reps)``
    repetitions, each between CUDA events and after flushing L2 (as triton.testing.do_bench does).
    With ``cuda_graph`` each input set's call is captured once in a CUDA graph and the replays are
    timed: the GPU time of the call without the host's time to launch it (what a decoding loop
    under CUDA graphs pays). Raises :class:`GraphCaptureError` when the call cannot be captured.
    With ``pin_host`` the process's threads share one core while timed on CUDA (:func:`pinned_host`).
    On the CPU: ``cpu_reps`` wall-clock repetitions, without warm-up (the runner's first call
    already compiled, and the interpreter has no caches worth warming).
    """
    if device.type != "cuda":
        times = []
        for i in range(max(1, cpu_reps)):
            start = time.perf_counter()
            fn((i + 1) % n_sets)
            times.append((time.perf_counter() - start) * 1e3)
        return summarize(times, "wall_clock")
    with pinned_host(pin_host) as core:
        timing = _time_cuda(fn, n_sets, device, warmup_ms, rep_ms, min_reps, max_reps, cuda_graph)
    return dataclasses.replace(timing, pinned_core=core)


def _time_cuda(fn, n_sets: int, device: torch.device, warmup_ms: float, rep_ms: float, min_reps: int,
               max_reps: int, cuda_graph: bool) -> Timing:
    method = "cuda_events"
    if cuda_graph:
        graphs = capture_graphs(fn, n_sets, device)
        fn, method = (lambda i: graphs[i % n_sets].replay()), "cuda_graph"

    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    flush = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.int32, device=device)
    # Estimate one call's time.
    synchronize(device)
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for i in range(3):
        fn(i % n_sets)
    end_ev.record()
    synchronize(device)
    estimate = max(start_ev.elapsed_time(end_ev) / 3, 1e-3)
    for i in range(max(1, int(warmup_ms / estimate))):
        fn(i % n_sets)
    reps = int(min(max_reps, max(min_reps, rep_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    synchronize(device)
    del flush
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)], method)


class GraphCaptureError(RuntimeError):
    """A call could not be captured in a CUDA graph (the message says why)."""


def capture_graphs(fn: Callable[[int], object], n_sets: int, device: torch.device) -> list:
    """One CUDA graph per input set of ``fn(i)``, sharing a memory pool.

    The calls run once on a side stream first, as torch requires: compilation, autotuning and the
    callers' cached buffers happen there, outside the capture.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(n_sets):
            fn(i)
    torch.cuda.current_stream(device).wait_stream(side)
    synchronize(device)
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    try:
        for i in range(n_sets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                fn(i)
            graphs.append(graph)
    except Exception as exc:  # noqa: BLE001 - any capture failure is reported, then timed eagerly
        synchronize(device)
        raise GraphCaptureError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return graphs


#: The square size of the matmul whose throughput is a GPU's measured peak: large enough that
#: every SM runs full tiles for milliseconds, as in vendors' dense-matmul figures.
PEAK_MATMUL_SIZE = 8192


def matmul_peak_tflops(device: torch.device | str, size: int = PEAK_MATMUL_SIZE,
                       dtype: torch.dtype = torch.bfloat16, rep_ms: float = 200.0) -> float | None:
    """Measured peak of ``device``: TFLOP/s of ``torch.matmul`` on (size, size) ``dtype``
    matrices, ``2·size³`` FLOPs over the median time of :func:`time_call` (warm-up first, then
    ``rep_ms`` of repetitions between CUDA events). None on the CPU (not measured: a CPU has no
    tensor-core peak that attention rows could be read against)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=device, dtype=dtype)
    timing = time_call(lambda i: torch.matmul(a, b, out=out), 1, device, warmup_ms=100, rep_ms=rep_ms,
                       min_reps=10, max_reps=200)
    del a, b, out
    return 2.0 * size ** 3 / (timing.median_ms * 1e-3) / 1e12


def time_first_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one synchronised call: the first call of a provider holds its compile time."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM)
        return True
    except OSError:
        return False


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[int | None, str]:
    """Extra memory one call needs on top of what was allocated before it: (bytes, method).

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset, minus the allocation before the call.
    CPU: the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs) minus
    the resident size before the call; coarse, and None where /proc does not allow it.
    """
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before), "cuda_max_memory_allocated"
    before = _rss_bytes()
    if before is None or not _reset_hwm():
        fn()
        return None, "unavailable"
    fn()
    peak = _hwm_bytes()
    if peak is None:
        return None, "unavailable"
    return max(0, peak - before), "rss_high_water_mark"
