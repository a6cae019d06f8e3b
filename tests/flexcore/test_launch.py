"""Direct launches (flexcore.kernels.launch): when a remembered compiled kernel is launched without
triton's JITFunction.run, and when a launch must go through triton again.

Kernels on this machine run under triton's interpreter, which never launches directly, so these
tests drive the logic with a stand-in kernel that records how it was launched. The GPU tests
(test_attention_gpu.py, test_direct_launches_gpu) run the real kernels both ways.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from flexcore.kernels import launch as L
from flexcore.kernels.policy import LaunchPolicy


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Compiled:
    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *launch_args):
        self.launches.append(launch_args)


class _Kernel:
    """Signature (x, n, scale, BLOCK, FLAG=True); records launches through ``kernel[grid](...)``."""

    def __init__(self, names=("x", "n", "scale", "BLOCK"), defaults=(("FLAG", True),),
                 fail_above: int | None = None):
        self.params = [_Param(n) for n in names] + [_Param(n, d) for n, d in defaults]
        self.compiled: dict = {}
        self.slow, self.warmed = [], []
        self.fail_above = fail_above

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            if self.fail_above is not None and kwargs.get("BLOCK_M", 0) > self.fail_above:
                raise type("OutOfResources", (Exception,), {})("shared memory")
            self.slow.append((grid, args, kwargs))
            return self.compiled.setdefault(tuple(sorted(kwargs.items())), _Compiled())
        return call

    def warmup(self, *args, grid, **kwargs):  # compiles without launching (Tuned._compile_configs)
        from triton.runtime import _async_compile

        self.warmed.append((args[1], kwargs, _async_compile.active_mode.get() is not None))
        if self.fail_above is not None and kwargs.get("BLOCK_M", 0) > self.fail_above:
            raise type("CompilationError", (Exception,), {})("does not compile")


@pytest.fixture
def gpu_like(monkeypatch):
    """The launch module as it behaves on a GPU machine (device 0, stream 77, no hooks)."""
    monkeypatch.setattr(L, "use_interpreter", lambda: False)
    monkeypatch.setattr(L, "_hooks_installed", lambda: False)
    monkeypatch.setattr(L, "_supported", lambda: True)
    monkeypatch.setattr(L, "_stream", lambda device: 77 + device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_direct", {})
    monkeypatch.setattr(L, "_fallback_cache", {})


def _x(offset=0, dtype=torch.float32):
    return torch.zeros(64, dtype=dtype)[offset:]


def test_arg_key_follows_triton_specialisation():
    key = L.arg_key
    assert key([1]) != key([2]) != key([16])          # 1, other, multiple of 16
    assert key([32]) == key([48]) == key([0])         # same class: one compiled kernel
    assert key([17]) == key([3])
    assert key([2 ** 31 + 16]) != key([16])           # 64-bit ints are another type
    assert key([2 ** 31 + 16]) != key([2 ** 31 + 3])
    assert key([2 ** 63]) != key([2 ** 62])           # unsigned 64-bit
    assert key([-16]) == key([16]) and key([-3]) == key([3])
    assert key([0.5]) == key([3.0])                   # floats are not specialised
    assert key([None]) != key([0]) and key([True]) != key([False])
    assert key([True]) != key([1]) and key([False]) != key([0])  # 1 is a constexpr to triton, True is not
    assert key([_x()]) == key([_x()])
    assert key([_x(1)]) != key([_x()])                # 4 bytes off: not 16-byte aligned
    assert key([_x(4)]) == key([_x()])                # 16 bytes off: aligned
    assert key([_x(dtype=torch.float16)]) != key([_x()])


def test_second_launch_is_direct_with_constexprs_in_signature_order(gpu_like):
    kernel = _Kernel()
    x = _x()
    L.run(kernel, (3, 2), (x, 5, 0.5), {"BLOCK": 64, "num_warps": 4})
    assert len(kernel.slow) == 1
    compiled, = kernel.compiled.values()
    assert compiled.launches == []
    y = _x()
    L.run(kernel, (3, 2), (y, 7, 0.25), {"BLOCK": 64, "num_warps": 4})
    assert len(kernel.slow) == 1
    assert compiled.launches == [(3, 2, 1, 77, "function-handle", "packed-metadata", None, None, None,
                                  y, 7, 0.25, 64, True)]


@pytest.mark.parametrize("change", ["alignment", "int_class", "dtype", "constexpr", "options",
                                    "debug_knob", "instrumentation_knob"])
def test_launches_that_specialise_differently_go_through_triton(gpu_like, monkeypatch, change):
    kernel = _Kernel()
    base = dict(x=_x(), n=5, kwargs={"BLOCK": 64, "num_warps": 4})
    L.run(kernel, (1,), (base["x"], base["n"], 1.0), base["kwargs"])
    L.run(kernel, (1,), (_x(), 7, 2.0), dict(base["kwargs"]))   # same specialisation: direct
    assert len(kernel.slow) == 1
    x, n, kwargs = _x(), 5, dict(base["kwargs"])
    if change == "alignment":
        x = _x(1)
    elif change == "int_class":
        n = 32
    elif change == "dtype":
        x = _x(dtype=torch.float16)
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "options":
        kwargs["num_warps"] = 8
    elif change == "debug_knob":  # triton compiles a kernel with device-side assertions
        from triton import knobs

        monkeypatch.setattr(knobs.runtime, "debug", True)
    else:
        from triton import knobs

        monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "profile-test")
    L.run(kernel, (1,), (x, n, 1.0), kwargs)
    assert len(kernel.slow) == 2
    L.run(kernel, (1,), (x, n, 1.0), kwargs)
    assert len(kernel.slow) == 2


def test_direct_launches_can_be_switched_off(gpu_like):
    kernel = _Kernel()
    for _ in range(3):
        L.run(kernel, (1,), (_x(), 5, 1.0), {"BLOCK": 64}, LaunchPolicy(direct=False))
    assert len(kernel.slow) == 3 and not L._direct


def test_launch_hooks_keep_launches_in_triton(gpu_like, monkeypatch):
    kernel = _Kernel()
    monkeypatch.setattr(L, "_hooks_installed", lambda: True)
    for _ in range(3):
        L.run(kernel, (1,), (_x(), 5, 1.0), {"BLOCK": 64})
    assert len(kernel.slow) == 3


def test_callable_grids_and_pre_run_hooks_stay_with_triton(gpu_like):
    kernel = _Kernel()
    for _ in range(2):
        L.run(kernel, lambda meta: (1,), (_x(), 5, 1.0), {"BLOCK": 64})
    assert len(kernel.slow) == 2
    kernel = _Kernel()
    kernel.pre_run_hooks = [lambda *args, **kwargs: None]
    for _ in range(2):
        L.run(kernel, (1,), (_x(), 5, 1.0), {"BLOCK": 64})
    assert len(kernel.slow) == 2


def test_installed_triton_launches_as_mirrored():
    # The direct path calls the compiled kernel's launcher with the arguments JITFunction.run
    # passes; _supported finds that call in triton's source (else every launch goes through
    # triton). triton 3.6 (the GPU machine) and 3.7 (this machine) have it.
    L._supported_result = None
    assert L._supported() is (torch.version.hip is None)


def test_hooks_installed_reads_triton_knobs(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(L, "_knobs", None)
    assert not L._hooks_installed()

    def hook(metadata):
        return None

    current = knobs.runtime.launch_enter_hook
    if hasattr(current, "add"):  # a chain of hooks (newer triton)
        current.add(hook)
        try:
            assert L._hooks_installed()
        finally:
            current.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        assert L._hooks_installed()


def test_launch_arguments_follow_the_signature(gpu_like):
    # A parameter after the positional ones with neither a value nor a default.
    kernel = _Kernel(names=("x", "n", "scale", "BLOCK", "OTHER"))
    for _ in range(2):
        L.run(kernel, (1,), (_x(), 5, 1.0), {"BLOCK": 64})
    assert len(kernel.slow) == 2
    # A runtime parameter passed by keyword takes its place in the signature.
    kernel = _Kernel()
    for _ in range(2):
        L.run(kernel, (1,), (_x(), 5), {"scale": 0.5, "BLOCK": 64})
    compiled, = kernel.compiled.values()
    assert len(kernel.slow) == 1 and compiled.launches[0][-3:] == (0.5, 64, True)


def test_fallback_configuration_is_launched_directly(gpu_like):
    kernel = _Kernel(names=("x", "n", "scale", "BLOCK_M", "BLOCK_N"), fail_above=64)
    grids = []

    def grid(bm, bn):
        grids.append((bm, bn))
        return (256 // bm, 1)

    meta = {"num_warps": 4, "num_stages": 2}
    ran = L.launch(kernel, grid, (_x(), 5, 1.0), 128, 64, meta, {})
    assert ran == (64, 64, meta) and len(kernel.slow) == 1
    y = _x()
    assert L.launch(kernel, grid, (y, 5, 1.0), 128, 64, meta, {}) == ran
    assert len(kernel.slow) == 1
    compiled, = kernel.compiled.values()
    assert compiled.launches[-1][:3] == (4, 1, 1)  # the grid of the configuration that ran
    assert compiled.launches[-1][9:] == (y, 5, 1.0, 64, 64, True)


class _Tuner:
    """A stand-in autotuner over two configurations of ``kernel`` that always picks the second
    (BLOCK_M=32); counts its tunings."""

    def __init__(self, kernel):
        import triton

        self.fn, self.tunings = kernel, 0
        self.configs = [triton.Config({"BLOCK_M": 64}, num_warps=4), triton.Config({"BLOCK_M": 32}, num_warps=4)]
        self.best_config = self.configs[1]

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.tunings += 1
        return call


def test_tuned_launch_is_direct_once_tuned(gpu_like):
    kernel = _Kernel(names=("x", "n", "scale", "BLOCK_M"))
    tuner = L.Tuned(_Tuner(kernel))

    def grid(meta):
        return (128 // meta["BLOCK_M"],)

    for _ in range(4):
        tuner.launch(grid, (_x(), 5, 1.0), {"FLAG": False}, key=(3,))
    assert tuner.tuner.tunings == 1                 # tuned once
    assert len(kernel.slow) == 1                    # then one launch through triton
    compiled, = kernel.compiled.values()
    assert len(compiled.launches) == 2              # then direct, with the tuned tile and grid
    assert compiled.launches[-1][:3] == (4, 1, 1)
    assert compiled.launches[-1][-2:] == (32, False)
    tuner.launch(grid, (_x(), 5, 1.0), {"FLAG": False}, key=(4,))  # another tuning key
    assert tuner.tuner.tunings == 2


def _desc(x, shape=(4, 16), strides=(16, 1), block=(2, 16)):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(shape), list(strides), list(block))


def test_arg_key_of_tensor_descriptors():
    key = L.arg_key
    x = torch.zeros(128, dtype=torch.bfloat16)
    assert key([_desc(x)]) == key([_desc(torch.zeros(128, dtype=torch.bfloat16))])
    assert key([_desc(x)]) == key([_desc(x, block=(4, 16))])   # block shape: from the tile constexprs
    assert key([_desc(x)]) == key([_desc(x, shape=(5, 16))])   # same classes of ints
    assert key([_desc(x)]) != key([_desc(x, shape=(1, 16))])   # 1 is another class
    assert key([_desc(x)]) == key([_desc(x, strides=(32, 1))])  # strides: multiples of 16 ...
    assert key([_desc(x, strides=(24, 1))]) != key([_desc(x)])  # ... or not
    assert key([_desc(x)]) != key([_desc(torch.zeros(128, dtype=torch.float16))])
    assert key([_desc(x)]) != key([x])


def test_fit_sees_each_configuration_before_it_launches(gpu_like):
    """launch(fit=...) calls fit with the configuration about to run: each fallback attempt, then
    the remembered configuration before every direct launch."""
    kernel = _Kernel(names=("x", "n", "scale", "BLOCK_M", "BLOCK_N"), fail_above=64)
    seen = []

    def fit(args, meta):
        seen.append((args[1], meta["BLOCK_M"], meta["BLOCK_N"]))

    meta = {"num_warps": 4, "num_stages": 2}
    L.launch(kernel, lambda bm, bn: (1,), (_x(), 5, 1.0), 128, 64, meta, {}, fit=fit)
    assert seen == [(5, 128, 64), (5, 64, 64)]  # the first attempt ran out of resources
    L.launch(kernel, lambda bm, bn: (1,), (_x(), 6, 1.0), 128, 64, meta, {}, fit=fit)
    assert seen[-1] == (6, 64, 64) and len(kernel.slow) == 1  # direct, fitted to what ran


def test_tuned_fit_before_untuned_launches(gpu_like):
    kernel = _Kernel(names=("x", "n", "scale", "BLOCK_M"))
    seen = []
    tuner = L.Tuned(_Tuner(kernel), fit=lambda args, meta: seen.append((args[1], meta["BLOCK_M"])))
    for n in (5, 6, 7):
        tuner.launch(lambda meta: (1,), (_x(), n, 1.0), {}, key=(3,))
    # The tuning call is the autotuner's own (in real use its configs' pre_hook fits the
    # descriptors: test_attention.py); Tuned fits before its launch through triton, then before
    # each direct one.
    # Tuned also fits each configuration before compiling it (test_tuned_compiles_...).
    assert seen == [(5, 64), (5, 32), (6, 32), (7, 32)]
    compiled, = kernel.compiled.values()
    assert len(kernel.slow) == 1 and len(compiled.launches) == 1


@pytest.mark.parametrize("threads", [8, 1])
def test_tuned_compiles_every_configuration_concurrently_before_tuning(gpu_like, monkeypatch, threads):
    """The first call for a key compiles all the autotuner's configurations at once, in triton's
    asynchronous compile mode, each fitted first; a configuration that fails to compile is left to
    the autotuner; later calls and other keys of the same configurations compile nothing more."""
    policy = LaunchPolicy(compile_threads=threads)
    monkeypatch.setattr(L, "_pool", None)
    kernel = _Kernel(names=("x", "n", "scale", "BLOCK_M"), fail_above=32)  # BLOCK_M=64 fails
    seen = []
    tuner = L.Tuned(_Tuner(kernel), fit=lambda args, meta: seen.append(meta["BLOCK_M"]))
    tuner.launch(lambda meta: (1,), (_x(), 5, 1.0), {"FLAG": False}, key=(3,), policy=policy)
    assert tuner.tuner.tunings == 1
    if threads < 2:
        assert kernel.warmed == [] and seen == []
        return
    assert [(n, kw["BLOCK_M"], kw["num_warps"], kw["FLAG"], mode) for n, kw, mode in kernel.warmed] == [
        (5, 64, 4, False, True), (5, 32, 4, False, True)]
    assert seen == [64, 32]
    tuner.launch(lambda meta: (1,), (_x(), 6, 1.0), {"FLAG": False}, key=(3,), policy=policy)
    assert len(kernel.warmed) == 2  # tuned: launched, nothing compiled ahead
    tuner.launch(lambda meta: (1,), (_x(), 7, 1.0), {"FLAG": False}, key=(4,), policy=policy)
    assert len(kernel.warmed) == 4 and tuner.tuner.tunings == 2  # a new key tunes (triton's cache hits)


def test_compile_threads_follow_the_setting_the_environment_and_the_cores(monkeypatch):
    monkeypatch.setattr(L, "_pool", None)
    monkeypatch.delenv("FLEXLAB_COMPILE_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert L.compile_threads() == 1 and L._compile_pool(3) is None
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert L.compile_threads() == 8
    assert L._compile_pool(1) is None  # one configuration: nothing to overlap
    pool = L._compile_pool(3)
    assert pool is not None and pool._max_workers == 8 and L._compile_pool(2) is pool
    pool.shutdown()
    monkeypatch.setattr(L, "_pool", None)
    monkeypatch.setenv("FLEXLAB_COMPILE_THREADS", "1")
    assert L.compile_threads() == 1 and L._compile_pool(3) is None
    monkeypatch.setenv("FLEXLAB_COMPILE_THREADS", "3")
    assert L.compile_threads() == 3
    assert L.compile_threads(0) == 0 and L._compile_pool(3, 0) is None  # the policy's setting wins
    monkeypatch.setenv("FLEXLAB_COMPILE_THREADS", "many")
    with pytest.raises(ValueError, match="FLEXLAB_COMPILE_THREADS='many': expected a number of threads"):
        L.compile_threads()


def test_recording_sees_what_a_plan_can_launch(gpu_like):
    """``recording`` lists each launch with the direct launch that ran or was remembered for it,
    and None for the autotuner's first call (its configurations were timed, none was chosen for a
    plan yet); direct_launches accepts a record only with the expected count, all direct."""
    kernel = _Kernel()
    with L.recording() as record:
        L.run(kernel, (3, 2), (_x(), 5, 0.5), {"BLOCK": 64})   # through triton, then remembered
        L.run(kernel, (3, 2), (_x(), 7, 0.5), {"BLOCK": 64})   # direct
    compiled, = kernel.compiled.values()
    assert [(entry.compiled, grid) for entry, grid in record] == [(compiled, (3, 2))] * 2
    assert L.direct_launches(record, 2) == record
    assert L.direct_launches(record, 1) is None

    tuned = _Kernel(names=("x", "n", "scale", "BLOCK_M"))
    tuner = L.Tuned(_Tuner(tuned))
    for expect_direct in (False, True, True):
        with L.recording() as record:
            tuner.launch(lambda meta: (128 // meta["BLOCK_M"],), (_x(), 5, 1.0), {"FLAG": False})
        (entry, grid), = record
        assert (entry is not None) == expect_direct
        assert L.direct_launches(record, 1) == (record if expect_direct else None)
        if expect_direct:
            assert grid == (4,)
    with L.recording() as record:  # a callable grid always goes through triton
        L.run(kernel, lambda meta: (1,), (_x(), 5, 0.5), {"BLOCK": 64})
    assert L.direct_launches(record, 1) is None


def test_plan_keys_follow_the_launch_environment(gpu_like, monkeypatch):
    default = LaunchPolicy()
    assert L.plan_key(default, "forward", 1) == ((0, L._triton_knobs().runtime.debug,
                                                  getattr(L._triton_knobs().compilation, "instrumentation_mode",
                                                          None)),
                                                 "forward", 1)
    monkeypatch.setattr(L, "_hooks_installed", lambda: True)   # a profiler: launches through triton
    assert L.plan_key(default, "forward", 1) is None
    monkeypatch.setattr(L, "_hooks_installed", lambda: False)
    assert L.plan_key(LaunchPolicy(plans=False), "forward", 1) is None
    monkeypatch.setattr(L, "use_interpreter", lambda: True)
    assert L.plan_key(default, "forward", 1) == (("interpreter",), "forward", 1)


def test_recording_is_per_thread(gpu_like):
    """Launches in another thread (DataParallel replicas, autograd's device threads) go to that
    thread's record, never to this one's."""
    import threading

    kernel = _Kernel()
    other: list = []

    def elsewhere():
        L.run(kernel, (1, 1), (_x(), 5, 0.5), {"BLOCK": 32})  # outside any recording
        with L.recording() as record:
            L.run(kernel, (2, 1), (_x(), 5, 0.5), {"BLOCK": 32})
        other.extend(record)

    with L.recording() as mine:
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        L.run(kernel, (3, 1), (_x(), 5, 0.5), {"BLOCK": 32})
    assert [grid for _, grid in mine] == [(3, 1)]
    assert [grid for _, grid in other] == [(2, 1)]
    with L.recording() as after:  # the previous records were restored, not left behind
        pass
    assert after == [] and L._recording.__dict__.get("record") is None
