"""``lower_score_mod`` / ``lower_mask_mod``: a user's mod as a generated Triton function."""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field

import torch

from flexcore.errors import RelowerWarning
from flexcore.lowering.cache import FastGuard, LRUCache, guard_key
from flexcore.lowering.names import capture_names
from flexcore.lowering.codegen import generate
from flexcore.lowering.trace import mod_name, trace_mod

_cache = LRUCache(maxsize=512)
_fast = FastGuard(maxsize=512)
#: Number of traces run in this process (tests count re-traces with it).
trace_count = 0
#: Distinct generated sources of one mod (its code, name, dtype and math) before RelowerWarning
#: says why.
RELOWER_WARNING_AT = 8
_relowerings: dict = {}


@dataclass(frozen=True, eq=False)
class LoweredMod:
    """A mod lowered to the source of one ``@triton.jit`` function.

    ``score_mod_fn(score, b, h, q_idx, kv_idx, q_ok, kv_ok, *cap_params)`` returns a float32 tile;
    ``mask_mod_fn(b, h, q_idx, kv_idx, q_ok, kv_ok, *cap_params)`` returns a bool tile. Results
    broadcast against ``[BM, BN]``: a value that depends only on ``q_idx`` is ``[BM, 1]`` and a
    constant is a 0-d scalar, so callers combine them with full tiles (``tl.where``, ``&``).

    Attributes:
        kind: ``"score"`` or ``"mask"``.
        fn_name: ``"score_mod_fn"`` or ``"mask_mod_fn"``.
        source: the function's text, decorator included.
        cap_params: parameter names for captured tensors: per tensor ``{p}_c{i}_ptr`` then one
            stride ``{p}_c{i}_s{d}`` per dimension (``p`` is ``sm`` or ``mm``).
        captured: the captured tensors (the user's own objects), in ``cap_params`` order.
        key: hash of ``source``; never depends on captured values.
        is_trivial: identity score_mod / always-true mask_mod.
        mod_name: ``__name__`` of the user's function (``None`` gives ``"identity"``/``"noop"``).
        graph: the traced aten graph (None for trivial mods); index checks and per-element
            evaluation read it.
        cap_names: the user's name for each captured tensor (``"bias"``, ``"self.table"``), or
            None where none was found, in ``captured`` order.
        fast_math: lowered with the GPU's approximate transcendentals (16-bit inputs); the
            backward lowers the mod's gradient the same way (see ``flexcore.lowering.vjp``).
        graph_captured: the tensors ``graph`` reads, in ``captured`` order: ``captured`` itself
            as lowered. A lowering bound to other tensors of the same shapes (``captured``
            replaced, as flexcore.ops does under torch.compile) keeps them, so that index checks
            read the call's tensors where the graph reads these.
    """

    kind: str
    fn_name: str
    source: str
    cap_params: tuple
    captured: tuple
    key: str
    is_trivial: bool
    mod_name: str = ""
    graph: object = field(default=None, repr=False)
    cap_names: tuple = ()
    fast_math: bool = False
    graph_captured: tuple = field(default=(), repr=False)

    def kernel_args(self) -> list:
        """``[t0, *t0.stride(), t1, *t1.stride(), ...]``, matching ``cap_params``."""
        out: list = []
        for t in self.captured:
            out.append(t)
            out.extend(t.stride())
        return out


def _make(kind: str, source: str, cap_params, captured, trivial: bool, name: str, graph=None,
          cap_names=(), fast_math: bool = False) -> LoweredMod:
    fn_name = "score_mod_fn" if kind == "score" else "mask_mod_fn"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    return LoweredMod(kind, fn_name, source, tuple(cap_params), tuple(captured), key, trivial, name,
                      graph, tuple(cap_names), fast_math, graph_captured=tuple(captured))


_TRIVIAL = {
    "score": ("@triton.jit\ndef score_mod_fn(score, b, h, q_idx, kv_idx, q_ok, kv_ok):\n"
              "    return score\n"),
    "mask": ("@triton.jit\ndef mask_mod_fn(b, h, q_idx, kv_idx, q_ok, kv_ok):\n"
             "    return tl.full([], True, tl.int1)\n"),
}


_trivial_mods: dict[str, LoweredMod] = {}


def lower_mod(fn, kind: str, score_dtype: torch.dtype = torch.float32, fast_math: bool = False) -> LoweredMod:
    global trace_count
    if fn is None:
        if kind not in _trivial_mods:
            _trivial_mods[kind] = _make(kind, _TRIVIAL[kind], (), (), True,
                                        "identity" if kind == "score" else "noop")
        return _trivial_mods[kind]  # dtype-agnostic: it returns its input
    # The same function object with nothing it reads rebound: no key to rebuild (every step of a
    # decoding loop, every layer of a model).
    variant = (kind, score_dtype, fast_math)
    lowered = _fast.get(fn, variant)
    if lowered is not None:
        return lowered
    guard = guard_key(fn)
    if guard is not None:
        cache_key = (kind, guard[0], score_dtype, fast_math)
        hit = _cache.get(cache_key)
        if hit is not None:
            _fast.put(fn, variant, guard, hit[0])
            return hit[0]
    trace_count += 1
    gm = trace_mod(fn, kind, score_dtype)
    source, cap_params, captured, trivial = generate(gm, kind, mod_name(fn), score_dtype, fast_math)
    lowered = _make(kind, source, cap_params, captured, trivial, mod_name(fn),
                    None if trivial else gm, capture_names(fn, captured), fast_math)
    if guard is not None:
        _cache.put(cache_key, (lowered, guard[1]))
        _fast.put(fn, variant, guard, lowered)
    _count_relowering(fn, variant, lowered.source)
    return lowered


def _count_relowering(fn, variant, source: str) -> None:
    """RelowerWarning, once, when the same mod (code and name: a compiled call's replayed mod
    keeps the user's name) has been lowered to RELOWER_WARNING_AT different sources for one
    variant (a new captured tensor gives the same source, hence the same kernel)."""
    key = (getattr(fn, "__code__", None), mod_name(fn), variant)
    if len(_relowerings) > 4096:  # long-lived processes with many mods: forget, warn again later
        _relowerings.clear()
    sources = _relowerings.setdefault(key, set())
    if len(sources) >= RELOWER_WARNING_AT:
        return
    sources.add(hashlib.sha1(source.encode()).digest())
    count = len(sources)
    if count == RELOWER_WARNING_AT:
        warnings.warn(
            f"{variant[0]}_mod {mod_name(fn)!r} has been lowered to {count} different kernels: a value it "
            f"reads (a Python number in a closure, a global or a default argument) changes between calls, "
            f"and each value is a constant of its generated code (a trace and a Triton compile per value, "
            f"under torch.compile(dynamic=True) too). Read a changing value from a captured tensor "
            f"instead (torch.tensor(pos), or flexcore.decoding.offset_score_mod / offset_mask_mod): it is "
            f"then an argument of one kernel", RelowerWarning, stacklevel=4)


def lower_score_mod(fn, score_dtype: torch.dtype = torch.float32, fast_math: bool = False) -> LoweredMod:
    """Lower ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (None: identity).

    Example:
        >>> def alibi(score, b, h, q_idx, kv_idx):
        ...     return score + slopes[h] * (kv_idx - q_idx)
        >>> lowered = lower_score_mod(alibi)
        >>> lowered.cap_params
        ('sm_c0_ptr', 'sm_c0_s0')

    Raises:
        ModError (UnsupportedOpError, ControlFlowError, ModSignatureError, ModReturnError) naming
        the mod and the offending line.

    ``score_dtype`` is the dtype of the score tile: float32, or float64 for float64 inputs.
    ``fast_math`` (for float16/bfloat16 inputs) lowers tanh to the GPU's approximate instruction.
    """
    return lower_mod(fn, "score", score_dtype, fast_math)


def lower_mask_mod(fn) -> LoweredMod:
    """Lower ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (None: keep everything).

    Example:
        >>> lower_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).source.splitlines()[1]
        'def mask_mod_fn(b, h, q_idx, kv_idx, q_ok, kv_ok):'
    """
    return lower_mod(fn, "mask")


def clear_cache() -> None:
    """Forget every cached trace, the score_mods' gradients' included (tests: counting traces, a
    first lowering)."""
    from flexcore.lowering import vjp

    _cache.clear()
    _fast.clear()
    _relowerings.clear()
    vjp._cache.clear()
