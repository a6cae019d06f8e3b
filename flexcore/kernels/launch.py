"""Launching flexcore's Triton kernels: direct launches, configurations that may not fit the GPU,
autotuned candidates compiled concurrently.

Direct launches. ``kernel[grid](*args)`` goes through triton's ``JITFunction.run``, which binds and
specialises every argument again at each call: 70-80 µs of host time for the forward's and the
backward's 50-80 arguments on the GPU machine, against 15-18 µs for the compiled kernel's own
launcher (docs/decisions.md#direct-launch). :func:`run` keeps, per kernel, constexprs and
:func:`arg_key` of the arguments, the compiled kernel that triton chose, and launches it directly
the next time, through the same launcher that triton calls.

Configurations that may not fit. A mod that keeps many values live (a gather from a captured table,
say) can push a tile configuration past the shared memory of the GPU. Triton only finds out when the
kernel is loaded, so a launch that runs out is retried with the next smaller configuration, and the
configuration that worked is remembered for the same kernel and constexprs.

Autotuned candidates. triton's autotuner compiles each configuration as it first times it, one after
another; :class:`Tuned` compiles them all at once first, in threads (:func:`compile_threads`), has
the autotuner time them over several rounds and keeps the earliest candidate within a tolerance of
the fastest (flexcore.kernels.choice); the choice is persisted per GPU and versions, and a later
process launches it without compiling or timing the others.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import threading
import warnings
import weakref
from typing import Callable, Iterator

import torch

from flexcore._runtime import capturing, use_interpreter
from flexcore.kernels import choice as choice_mod
from flexcore.kernels import triton_compat
from flexcore.kernels.choice import ChoiceCache, Timer, TuneRule
from flexcore.kernels.policy import LaunchPolicy

_fallback_cache: dict = {}
# Every function here that launches takes a LaunchPolicy (direct launches, plans, compile threads);
# callers without options use the defaults.
_DEFAULT = LaunchPolicy()

# key -> _Direct; bounded (cleared when full: entries are cheap to rebuild, one slow launch each).
_direct: dict = {}
_DIRECT_LIMIT = 4096


def arg_key(args) -> tuple:
    """What triton's specialisation of a launch reads from its runtime arguments, as a hashable key.

    Per argument: a tensor's dtype and whether its address is a multiple of 16 bytes; an int's
    class (1, multiple of 16 or not, in the 32-bit range or not, 64-bit unsigned); the type of a
    float; a tensor descriptor's base (as a tensor), rank, options and the classes of its shape
    and strides (not its block shape: callers derive it from constexprs that are in the key, the
    tiles through ``launch``'s and ``Tuned``'s ``fit``, the head dims); any other
    value with its type (None, bools, strings). Launches of one kernel with equal keys and equal
    constexprs run the same compiled kernel (on NVIDIA GPUs; see _direct_key).
    Raises TypeError for unhashable values.
    """
    key = []
    append = key.append
    for a in args:
        t = type(a)
        if t is int:  # a small int code; nothing else in the key is an int
            if -2147483648 <= a <= 2147483647:
                append(1 if a == 1 else (2 if a & 15 else 3))
            else:
                append(4 + (a & 15 == 0) + 2 * (a >= 1 << 63))
        elif t is float:
            append(float)
        elif isinstance(a, torch.Tensor):
            append((a.dtype, a.data_ptr() & 15 == 0))
        elif t.__name__ == "TensorDescriptor":
            append((t, a.base.dtype, a.base.data_ptr() & 15 == 0, arg_key(a.shape), arg_key(a.strides),
                    getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None)))  # newer triton
        else:  # tagged with its type: True must not key as the int 1 (triton makes 1 a constexpr)
            append((t, a))
    return tuple(key)


class _Direct:
    """A compiled kernel and the constexprs that follow the positional arguments in its signature."""

    __slots__ = ("owner", "compiled", "tail", "extra", "device")

    def __init__(self, owner, compiled, tail: tuple, extra, device: int):
        # owner: the kernel (or Tuned) whose id is in the key; kept so that the id stays its own.
        self.owner, self.compiled, self.tail, self.extra, self.device = owner, compiled, tail, extra, device

    def launch(self, grid, args) -> None:
        ck = self.compiled
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        ck.run(grid[0], g1, g2, _stream(self.device), ck.function,
               ck.packed_metadata, None, None, None, *args, *self.tail)


def _entry(key, owner) -> _Direct | None:
    """The launch remembered under ``key`` for ``owner`` (None when there is none, or no key)."""
    entry = None if key is None else _direct.get(key)
    return entry if entry is not None and entry.owner is owner else None


_stream = None  # triton's driver.get_current_stream, bound on first use


def launch_env(policy: LaunchPolicy = _DEFAULT) -> tuple | None:
    """What a direct launch depends on besides its kernel and arguments: (current device, triton's
    debug knob, its instrumentation mode; it compiles another kernel when they change). None when
    launches must go through triton: interpreter, direct launches switched off (``policy.direct``),
    a triton whose launch convention is not the one mirrored here, a ROCm build (its specialisation
    also reads tensor sizes), launch hooks or a stages-inspection hook installed (profilers)."""
    if not policy.direct or use_interpreter() or not _supported() or _hooks_installed():
        return None
    knobs = _triton_knobs()
    instrumentation = getattr(getattr(knobs, "compilation", None), "instrumentation_mode", None)
    return (torch.cuda.current_device(), knobs.runtime.debug, instrumentation)


def _direct_key(kernel, args, kwargs_items: tuple, extra=(), policy: LaunchPolicy = _DEFAULT) -> tuple | None:
    """The key of a direct launch, or None when this launch must go through triton (see
    launch_env; also unhashable arguments)."""
    env = launch_env(policy)
    if env is None:
        return None
    try:
        return (id(kernel), kwargs_items, extra, arg_key(args), *env)
    except TypeError:
        return None


def _supported() -> bool:
    """Whether this triton launches a compiled kernel as flexcore's direct launches do, on a CUDA
    build of torch (flexcore.kernels.triton_compat, checked once)."""
    return triton_compat.launches_like_jit_run()


def _hooks_installed() -> bool:
    """Whether a profiler installed triton launch hooks or a stages-inspection hook (direct
    launches would skip them)."""
    runtime = _triton_knobs().runtime
    return (any(h is not None and getattr(h, "calls", True)
                for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))
            or getattr(runtime, "add_stages_inspection_hook", None) is not None)


_knobs = None


def _triton_knobs():
    global _knobs
    if _knobs is None:
        _knobs = triton_compat.knobs()
    return _knobs


def _remember(key, kernel, compiled, args: tuple, kwargs: dict, extra=None, owner=None) -> None:
    """Keep ``compiled`` (what ``kernel[grid](*args, **kwargs)`` returned) for direct launches
    under ``key``, when every parameter after the positional arguments is given in ``kwargs`` or
    has a default (triton has rejected the launch already if one was given twice). ``owner``: the
    object whose id the key holds, when it is not ``kernel``."""
    global _stream
    if key is None or compiled is None or not all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return
    params = getattr(kernel, "params", None)
    if params is None or len(params) < len(args) or getattr(kernel, "pre_run_hooks", None):
        return
    tail = []
    for p in params[len(args):]:
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            return
    if _stream is None:
        _stream = triton_compat.current_stream_getter()
    if len(_direct) >= _DIRECT_LIMIT:
        _direct.clear()
    device = key[4]  # the current device, as _direct_key put it in the key
    _direct[key] = _Direct(kernel if owner is None else owner, compiled, tuple(tail), extra, device)


def run(kernel, grid: tuple, args: tuple, kwargs: dict, policy: LaunchPolicy = _DEFAULT) -> None:
    """``kernel[grid](*args, **kwargs)``, launched directly when the same kernel has run with the
    same constexprs and argument key before (see the module docstring). ``grid``: a tuple (a
    callable grid always launches through triton)."""
    key = None if callable(grid) else _direct_key(kernel, args, tuple(kwargs.items()), (), policy)
    entry = _entry(key, kernel)
    if entry is not None:
        entry.launch(grid, args)
    else:
        compiled = kernel[grid](*args, **kwargs)
        _remember(key, kernel, compiled, args, kwargs)
        entry = _entry(key, kernel)
    _record_launch(entry, grid, kernel, kwargs)


def out_of_resources(error: BaseException) -> bool:
    """Whether ``error`` is triton's OutOfResources (matched by name: it moved between triton
    modules across versions)."""
    return type(error).__name__ == "OutOfResources"


def smaller_configs(bm: int, bn: int, meta: dict) -> Iterator[tuple[int, int, dict]]:
    """Configs to try in order: halve the larger tile down to 64, then fewer stages, then halve to 16
    (halving keeps tiles dividing the mask blocks)."""
    yield bm, bn, meta
    while max(bm, bn) > 64:
        bm, bn = (bm, bn // 2) if bn >= bm else (bm // 2, bn)
        yield bm, bn, meta
    while meta.get("num_stages", 1) > 1:
        meta = dict(meta, num_stages=meta["num_stages"] - 1)
        yield bm, bn, meta
    while max(bm, bn) > 16:
        bm, bn = (bm, bn // 2) if bn >= bm else (bm // 2, bn)
        yield bm, bn, meta


def _describe(bm: int, bn: int, meta: dict) -> str:
    return ", ".join([f"BLOCK_M={bm}", f"BLOCK_N={bn}"] + [f"{k}={v}" for k, v in sorted(meta.items())])


def launch(kernel, grid: Callable[[int, int], tuple], args: tuple, bm: int, bn: int, meta: dict,
           kwargs: dict, *, pinned: bool = False,
           tile_names: tuple[str, str] = ("BLOCK_M", "BLOCK_N"),
           fit: Callable[[tuple, dict], None] | None = None,
           policy: LaunchPolicy = _DEFAULT) -> tuple[int, int, dict]:
    """Launch ``kernel[grid(bm, bn)](*args, BLOCK_M=bm, BLOCK_N=bn, **meta, **kwargs)`` (the tile
    constexprs are named by ``tile_names``).

    On the GPU a configuration that runs out of shared memory is replaced by the next of
    :func:`smaller_configs`. ``pinned`` says the user chose the configuration in ``kernel_options``;
    they are then warned once which configuration ran instead. ``fit(args, constexprs)`` is called
    before each launch with the configuration about to run (tensor descriptors take their block
    shape from the tiles). Returns the configuration that ran.
    """
    direct = _direct_key(kernel, args, tuple(kwargs.items()), (tile_names, bm, bn, *meta.items()), policy)
    entry = _entry(direct, kernel)
    if entry is not None:  # extra: the configuration that ran
        if fit is not None:
            fit(args, {tile_names[0]: entry.extra[0], tile_names[1]: entry.extra[1], **entry.extra[2]})
        ran_grid = grid(entry.extra[0], entry.extra[1])
        entry.launch(ran_grid, args)
        _record_launch(entry, ran_grid)
        return entry.extra
    key = (id(kernel), tile_names, bm, bn, tuple(sorted(meta.items())),
           tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    requested = (bm, bn, meta)
    bm, bn, meta = _fallback_cache.get(key, requested)
    error = None
    for bm, bn, meta in smaller_configs(bm, bn, meta):
        full = {tile_names[0]: bm, tile_names[1]: bn, **meta, **kwargs}
        if fit is not None:
            fit(args, full)
        try:
            compiled = kernel[grid(bm, bn)](*args, **full)
        except Exception as e:  # noqa: BLE001 - only triton's OutOfResources is retried
            if not out_of_resources(e):
                raise
            error = e
            continue
        if key not in _fallback_cache:
            _fallback_cache[key] = (bm, bn, meta)
            if pinned and (bm, bn, meta) != requested:
                warnings.warn(f"kernel_options ({_describe(*requested)}) need more shared memory than "
                              f"this GPU has for this mod; ran {_describe(bm, bn, meta)} instead",
                              stacklevel=4)
        _remember(direct, kernel, compiled, args, full, (bm, bn, meta))
        _record_launch(_entry(direct, kernel), grid(bm, bn), kernel, full)
        return bm, bn, meta
    raise error


class Tuned:
    """A triton autotuner's configurations, chosen between here and remembered on the host.

    The first call for a key chooses a configuration (:meth:`tune`: timings over several rounds,
    the tie rule of flexcore.kernels.choice, the persisted choice cache); later calls launch the chosen
    configuration on the kernel directly. That skips the autotuner's per-call work over every
    argument, which costs more than a decoding step's kernel on the GPU. The autotuner object
    supplies the configurations (in preference order), the kernel and its hooks.
    """

    def __init__(self, tuner, fit: Callable[[tuple, dict], None] | None = None):
        # fit(args, constexprs): as launch's; the autotuner's own launches use its configs' pre_hook.
        self.tuner = tuner
        self.fit = fit
        self.chosen: dict = {}

    def launch(self, grid, args: tuple, kwargs: dict, key: tuple = (),
               policy: LaunchPolicy = _DEFAULT) -> None:
        """``tuner[grid](*args, **kwargs)`` with the configuration chosen by :meth:`tune` for
        ``key``: the values of the tuner's ``key`` arguments (the dtypes of the tensor arguments
        are added here, as the autotuner does). The policy's ``tune`` rule (a
        :class:`flexcore.kernels.choice.TuneRule`) says how."""
        direct = _direct_key(self, args, tuple(kwargs.items()), key, policy)
        entry = _entry(direct, self)
        if entry is not None:  # extra: the constexprs and options of the tuned configuration
            if self.fit is not None:
                self.fit(args, entry.extra)
            ran_grid = grid(entry.extra) if callable(grid) else grid
            entry.launch(ran_grid, args)
            _record_launch(entry, ran_grid)
            return
        full_key = (key, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        config = self.chosen.get(full_key)
        if config is None and capturing():
            # Timing configurations inside a CUDA graph capture would break it: run the first one
            # and tune at the next call outside a capture (warm up before capturing to get the
            # tuned configuration into the graph).
            config = self.tuner.configs[0]
        elif config is None:
            rule = policy.tune
            self.chosen[full_key] = self.tune(grid, args, kwargs, full_key, rule,
                                              cache=choice_mod.cache_for(rule),
                                              threads=policy.compile_threads)
            _record_launch(None, None)  # tuned: nothing to launch directly yet
            return
        full = {**kwargs, **config.all_kwargs()}
        if self.fit is not None:
            self.fit(args, full)
        compiled = self.tuner.fn[grid](*args, **full)
        tuned = config is self.chosen.get(full_key)  # not the untuned stand-in of a capture
        if tuned:
            _remember(direct, self.tuner.fn, compiled, args, full, full, owner=self)
        _record_launch(_entry(direct, self) if tuned else None, grid(full) if callable(grid) else grid)

    def tune(self, grid, args: tuple, kwargs: dict, full_key=(), rule: TuneRule = choice_mod.DEFAULT_RULE,
             *, timer: Timer | None = None, cache: ChoiceCache | None = None, threads: int | None = None):
        """Run the call with a configuration chosen for these arguments and return that
        configuration: the one ``cache`` holds for this kernel and problem (:func:`choice_key`),
        launched through triton (the others are not compiled); else every configuration is
        compiled (concurrently, ``threads`` as :func:`compile_threads`), the autotuner times them
        with ``rule``'s benchmark (flexcore.kernels.choice.benchmark: ``rule.rounds`` rounds,
        median) and runs its fastest, and the kept configuration is the earliest within
        ``rule.tolerance`` of the fastest (flexcore.kernels.choice.choose), which is stored in
        ``cache``. ``timer``: see flexcore.kernels.choice.Timer (tests pass timings through it)."""
        configs = list(self.tuner.configs)
        key = choice_key(self.tuner.fn, configs, full_key, args, kwargs) if cache is not None else None
        found = _cached_config(cache.get(key), configs) if cache is not None else None
        if found is not None:
            full = {**kwargs, **found.all_kwargs()}
            if self.fit is not None:
                self.fit(args, full)
            self.tuner.fn[grid](*args, **full)
            return found
        self._compile_configs(grid, args, kwargs, threads)
        # triton's Autotuner reads its benchmark from this attribute (its ``do_bench`` argument).
        self.tuner.do_bench = choice_mod.benchmark(rule, timer)
        self.tuner.configs_timings = None
        getattr(self.tuner, "cache", {}).clear()  # its own earlier choices: this call times afresh
        self.tuner[grid](*args, **kwargs)
        timings = getattr(self.tuner, "configs_timings", None)
        if not isinstance(timings, dict) or not timings:  # nothing timed: the autotuner's own choice
            return self.tuner.best_config
        times = [_median_ms(timings.get(c)) for c in configs]
        index = choice_mod.choose(times, rule.tolerance)
        if cache is not None:
            stored = cache.put(key, {"index": index, "config": str(configs[index]),
                                     "times_ms": [t if math.isfinite(t) else None for t in times],
                                     "tolerance": rule.tolerance})
            return _cached_config(stored, configs) or configs[index]
        return configs[index]

    def _compile_configs(self, grid, args: tuple, kwargs: dict, threads: int | None = None) -> None:
        """Compile every configuration the autotuner is about to time, concurrently (triton's
        compiler releases the GIL), so that a new mod's first call waits for the slowest compile
        rather than for their sum (docs/decisions.md#concurrent-compile). The autotuner
        then finds them in the kernel's cache. A configuration that fails to compile here is left
        to the autotuner, which reports or skips it as it would have. ``threads``: see
        :func:`compile_threads`."""
        configs = self.tuner.configs
        pool = _compile_pool(len(configs), threads)
        if pool is None:
            return
        AsyncCompileMode, active_mode = triton_compat.async_compile()

        if active_mode.get() is not None:  # the caller compiles asynchronously already
            return
        with AsyncCompileMode(pool, ignore_errors=True):
            for config in configs:
                full = {**kwargs, **config.all_kwargs()}
                if self.fit is not None:  # the descriptors' block shapes are part of the signature
                    self.fit(args, full)
                try:
                    self.tuner.fn.warmup(*args, grid=grid, **full)
                except Exception:  # left to the autotuner (see above)
                    pass


def _median_ms(timing) -> float:
    """The median of an autotuner timing ([median, p20, p80] or one number); inf where absent."""
    if isinstance(timing, (list, tuple)):
        timing = timing[0] if timing else None
    return float(timing) if isinstance(timing, (int, float)) else math.inf


def choice_key(fn, configs, full_key, args: tuple, kwargs: dict) -> str:
    """The text a persisted choice is kept under: the kernel (name and triton's hash of its source
    and dependencies), its configurations in order, the tuning key and the problem (each tensor's
    dtype, shape and strides, each descriptor's base, shape and strides, the other arguments' values,
    the constexprs)."""
    def describe(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", str(a.dtype), tuple(a.shape), a.stride())
        if type(a).__name__ == "TensorDescriptor":
            return ("descriptor", str(a.base.dtype), tuple(a.base.shape), tuple(a.shape), tuple(a.strides))
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        return type(a).__name__

    base = fn
    while not hasattr(base, "cache_key") and hasattr(base, "fn"):
        base = base.fn
    name = getattr(getattr(base, "fn", base), "__name__", type(base).__name__)
    parts = [name, str(getattr(base, "cache_key", "")), [str(c) for c in configs], repr(full_key),
             [describe(a) for a in args], sorted((k, repr(describe(v))) for k, v in kwargs.items())]
    return json.dumps(parts, default=repr)


def _cached_config(entry: dict | None, configs: list):
    """The configuration a persisted entry names, where it still names one of ``configs``."""
    if not entry:
        return None
    index = entry.get("index")
    if isinstance(index, int) and 0 <= index < len(configs) and str(configs[index]) == entry.get("config"):
        return configs[index]
    return None


_pool = None  # the executor, made on first use; False where there is none


def compile_threads(threads: int | None = None) -> int:
    """How many threads compile an autotuner's configurations (Tuned._compile_configs):
    ``threads`` (a LaunchPolicy's compile_threads) where given, else the environment variable
    FLEXLAB_COMPILE_THREADS if set, else the host's cores up to 8; 0 or 1 compiles one
    configuration after another, as triton's autotuner does (benchmarks, shared hosts)."""
    if threads is not None:
        return int(threads)
    value = os.environ.get("FLEXLAB_COMPILE_THREADS", "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"FLEXLAB_COMPILE_THREADS={value!r}: expected a number of threads "
                             f"(0 or 1 compiles one configuration at a time)") from None
    return min(8, os.cpu_count() or 1)


def _compile_pool(count: int, threads: int | None = None):
    """The executor for ``count`` configurations, or None: one configuration, one thread (see
    :func:`compile_threads`), or a triton without asynchronous compilation."""
    global _pool
    threads = compile_threads(threads)
    if min(threads, count) < 2:
        return None
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        if triton_compat.async_compile() is None:
            _pool = False
            return None
        _pool = ThreadPoolExecutor(threads, thread_name_prefix="flexlab-compile")
    return _pool or None


# Per-call plans. A kernel call repeated with the same shapes, strides, dtypes, alignments, mask
# tables, mods, scale and options makes the same host decisions each time: tiles, paths, the
# autotuner's and the layout tuner's choices, grids, the integer arguments, the compiled kernels.
# flexcore.kernels.forward and .backward keep them as a plan under a key of everything those
# decisions read (launch_env included), so that a repeated call allocates its outputs, puts its
# tensors in the argument tuple and calls the compiled launchers (docs/decisions.md#per-call-plans).
# Plans are made from what ``recording`` saw launched directly, outside CUDA graph captures.
# A LaunchPolicy with plans=False makes every call decide again (benchmarks, debugging).
_plans: dict = {}
_plan_finalizers: dict = {}  # key -> the weakref.finalize of each of its owners
_PLAN_LIMIT = 1024  # cleared when full, as _direct
# The list that ``recording`` yields, per thread: calls in other threads (DataParallel replicas,
# autograd's device threads) record their own launches.
_recording = threading.local()


def plan_key(policy: LaunchPolicy, *parts) -> tuple | None:
    """The key of a plan: ``parts`` and the launch environment, or None where ``policy`` turns
    plans off or launches go through triton on the GPU (see launch_env). Under triton's
    interpreter, plans launch through it (see _Interpreted)."""
    if not policy.plans:
        return None
    env = ("interpreter",) if use_interpreter() else launch_env(policy)
    return None if env is None else (env, *parts)


def get_plan(key):
    """The plan kept under ``key``, or None."""
    return _plans.get(key)


def keep_plan(key, plan, owners: tuple = ()) -> None:
    """Keep ``plan`` under ``key`` as long as every object of ``owners`` lives (the mask tables
    whose ids the key holds: the plan leaves when one of them is collected, before another object
    can take its id, and never keeps a mask's tables alive past it). Nothing is kept inside a CUDA
    graph capture, whose decisions stand in for ones that need the GPU, nor for owners that cannot
    be referenced weakly."""
    if key is None or capturing():
        return
    if len(_plans) >= _PLAN_LIMIT:
        clear_plans()
    _drop_plan(key)
    finalizers = []
    try:
        for owner in owners:
            finalizers.append(weakref.finalize(owner, _drop_plan, key))
    except TypeError:
        for f in finalizers:
            f.detach()
        return
    _plans[key] = plan
    _plan_finalizers[key] = finalizers


def _drop_plan(key) -> None:
    """Forget the plan under ``key`` and the finalizers that would drop it."""
    _plans.pop(key, None)
    for f in _plan_finalizers.pop(key, ()):
        f.detach()


def clear_plans() -> None:
    """Forget every plan (tests that patch flexcore's decisions between calls)."""
    for key in list(_plans):
        _drop_plan(key)


@contextlib.contextmanager
def recording():
    """Within it, each launch by :func:`run`, :func:`launch` and :meth:`Tuned.launch` appends
    ``(entry, grid)`` to the yielded list: the direct launch that ran, or the one remembered for
    the next launch with these arguments, and the grid it ran with; ``(None, grid)`` where there
    is none (the autotuner's first call, a launch through triton)."""
    saved = _recording.__dict__.get("record")
    record = _recording.record = []
    try:
        yield record
    finally:
        _recording.record = saved


def _record_launch(entry, grid, kernel=None, kwargs: dict | None = None) -> None:
    """Append ``(entry, grid)`` to this thread's record where ``recording`` is on. A launch that
    ran through triton without a direct entry (``entry`` None) records, under the interpreter, its
    ``kernel`` and constexprs ``kwargs`` instead (see _Interpreted)."""
    record = _recording.__dict__.get("record")
    if record is not None:
        if entry is None and kernel is not None:
            entry = _interpreted(kernel, kwargs)
        record.append((entry, grid))


class _Interpreted:
    """What a plan launches under triton's interpreter, which compiles nothing: the kernel and its
    constexprs, launched through the interpreter each time (CPU tests run plans on the real
    kernels)."""

    __slots__ = ("kernel", "kwargs")

    def __init__(self, kernel, kwargs: dict):
        self.kernel, self.kwargs = kernel, dict(kwargs)

    def launch(self, grid, args) -> None:
        self.kernel[grid](*args, **self.kwargs)


def _interpreted(kernel, kwargs: dict) -> _Interpreted | None:
    """The stand-in of a launch that ran through triton under the interpreter (None on a GPU)."""
    return _Interpreted(kernel, kwargs) if use_interpreter() else None


def direct_launches(record: list, count: int) -> list | None:
    """``record``'s (entry, grid) pairs if it holds ``count`` launches that all ran or can run
    directly, else None."""
    if len(record) != count or any(entry is None for entry, _ in record):
        return None
    return list(record)
