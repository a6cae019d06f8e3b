"""bench.timing on any machine: quantiles, and the host pinning that GPU timing runs under."""
from __future__ import annotations

import os
import threading

import pytest

from bench.timing import pinned_host, quantile

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"),
                                    reason="needs Linux thread affinity")


def test_quantile_interpolates():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, 2.0], 0.0) == 1.0 and quantile([1.0, 2.0], 1.0) == 2.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


@needs_affinity
def test_pinned_host_puts_every_thread_on_one_core_and_gives_their_sets_back():
    # Threads that exist when timing starts (autograd's device threads among them) share the
    # caller's core while timed, and get their own sets back after.
    started, release = threading.Event(), threading.Event()
    helper_tid = []

    def helper():
        helper_tid.append(threading.get_native_id())
        started.set()
        release.wait(10)

    thread = threading.Thread(target=helper)
    thread.start()
    started.wait(10)
    before = {tid: os.sched_getaffinity(tid) for tid in (threading.get_native_id(), helper_tid[0])}
    try:
        with pinned_host(True) as core:
            assert core is not None and core in before[threading.get_native_id()]
            for tid in before:
                assert os.sched_getaffinity(tid) == {core}
        for tid, cores in before.items():
            assert os.sched_getaffinity(tid) == cores
        with pinned_host(False) as core:  # off: nothing moves
            assert core is None
            assert os.sched_getaffinity(helper_tid[0]) == before[helper_tid[0]]
    finally:
        release.set()
        thread.join()


def test_matmul_peak_is_not_measured_on_the_cpu():
    from bench.env import PEAK_KEY, capture
    from bench.timing import matmul_peak_tflops

    assert matmul_peak_tflops("cpu") is None
    env = capture("cpu", peak=True)
    assert PEAK_KEY in env and env[PEAK_KEY] is None


@pytest.mark.gpu
def test_matmul_peak_is_measured_on_the_gpu():
    # A number, not a speed check (tests share the GPU): finite, positive, stored in the env.
    import math

    from bench.env import PEAK_KEY, capture
    from bench.timing import matmul_peak_tflops

    value = matmul_peak_tflops("cuda", size=2048, rep_ms=20)
    assert math.isfinite(value) and value > 0
    env = capture("cuda", peak=True)
    assert env[PEAK_KEY] > 0 and "8192" in env["peak_method"]
    assert capture("cuda")[PEAK_KEY] is None  # measured only when asked (the runner asks)
