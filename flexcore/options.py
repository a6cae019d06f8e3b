"""Typed kernel options (``kernel_options=`` of :func:`flexcore.flex_attention`)."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from flexcore.errors import InputError
from flexcore.kernels.policy import BACKENDS, Backend, DispatchPolicy, resolve


class KernelOptionsConflict(InputError, RuntimeError):
    """Two kernel options ask for different things (torch raises RuntimeError there)."""


@dataclass(frozen=True)
class KernelOptions:
    """Knobs of flexcore's kernels. Every field defaults to "choose automatically".

    A plain dict with the same keys is accepted wherever KernelOptions is, and so are the keys of
    torch's ``FlexKernelOptions``: ``BACKEND`` ("AUTO"; "TRITON" forbids and "TRITON_DECODE" forces
    the decoding kernel) and ``FORCE_USE_FLEX_ATTENTION=True`` (forbids it) map to ``decode``;
    torch's other keys at their default values ask for nothing here (``BACKEND="TRITON"`` keeps the
    Gluon kernels allowed: use ``backend="triton"`` to forbid them); the rest (``PRESCALE_QK``,
    ``fwd_``/``bwd_`` tiles, ``BLOCK_M1``..., ROCm knobs, ``BACKEND="FLASH"``) are ignored with one
    warning that names them.

    Attributes:
        BLOCK_M: query rows per program. Must divide the BlockMask's query BLOCK_SIZE. Larger tiles
            reuse K/V more (faster on long sequences) but need more registers. It applies to the
            forward and the backward.
        BLOCK_N: key rows per inner-loop step. Must divide the BlockMask's key BLOCK_SIZE.
        num_warps: warps per program (GPU only).
        num_stages: software-pipelining depth of the K/V loads (GPU only); more stages hide memory
            latency at the cost of shared memory.
        autotune: on the GPU, time a few tile configurations per head dim and keep the fastest
            (the first call of a new shape then takes longer). Ignored when BLOCK_M/BLOCK_N are given.
            The backward at head dim 128 also times one launch of its dK/dV and dQ programs against
            two; without autotune it takes one launch.
        allow_tf32: for float32 inputs, use tf32 tensor-core matmuls: several times faster, with
            about 1e-3 relative error instead of 1e-6.
        decode: force (True) or forbid (False) the split-KV decoding kernel; None picks it for
            query lengths up to 16.
        deterministic: backward only; captured-tensor gradients accumulated in 32.32 fixed point
            with int64 atomics, so they are bit-identical across runs (resolution 2^-32 per
            contribution, partial sums below 2^31). dQ, dK and dV are deterministic regardless.
        check_indices: check at run time, on the GPU, that every index a score_mod or mask_mod
            reads from a captured tensor lies inside it, and raise otherwise (indices that the
            lowering proves in range are not checked). Costs one extra pass over the index grid.
        backend: which kernels may serve the call. "auto": flexcore's rules pick between the Gluon
            kernels for Hopper and the Triton templates; "triton": never the Gluon kernels;
            "gluon": only the Gluon kernels (an sm_90 GPU whose triton has Gluon; a call they
            cannot serve raises, and short queries do not pick the decoding kernel).
        policy: a :class:`flexcore.kernels.policy.DispatchPolicy` replacing flexcore's dispatch
            rules (experiments, tests); None: the defaults. :func:`flexcore.explain` shows what
            the rules choose for a call.

    ``dispatch``: the policy the kernels read (``policy`` with ``backend`` applied), computed once
    per options object.
    """

    BLOCK_M: int | None = None
    BLOCK_N: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    autotune: bool = True
    allow_tf32: bool = False
    decode: bool | None = None
    deterministic: bool = False
    check_indices: bool = False
    backend: Backend = "auto"
    policy: DispatchPolicy | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise InputError(f"kernel_options['backend'] = {self.backend!r}: expected one of "
                             f"{list(BACKENDS)}")
        if self.policy is not None and not isinstance(self.policy, DispatchPolicy):
            raise InputError(f"kernel_options['policy'] must be a flexcore.kernels.policy.DispatchPolicy "
                             f"or None, got {type(self.policy).__name__}")
        if self.backend == "gluon":  # the decoding kernel is a Triton kernel
            if self.decode:
                raise KernelOptionsConflict("kernel_options: decode=True contradicts backend='gluon' "
                                            "(the decoding kernel is a Triton kernel)")
            object.__setattr__(self, "decode", False)
        for name in ("BLOCK_M", "BLOCK_N"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 16 or value & (value - 1)):
                raise InputError(f"kernel_options[{name!r}] = {value!r}: expected a power of two >= 16")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InputError(f"kernel_options[{name!r}] = {value!r}: expected a positive int")
        # Switches are bools: a string such as "false" would otherwise read as True.
        for name in ("autotune", "allow_tf32", "deterministic", "check_indices", "decode"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "decode" and value is None):
                raise InputError(f"kernel_options[{name!r}] = {value!r}: expected True or False"
                                 + (" (or None: chosen by the query length)" if name == "decode" else ""))

    @functools.cached_property
    def dispatch(self) -> DispatchPolicy:
        """The dispatch policy the kernels read: ``policy`` (the defaults for None) with ``backend``
        applied; resolved on first use (InputError where backend='gluon' has no Hopper GPU)."""
        return resolve(self.backend, self.policy)

    @property
    def pins_tiles(self) -> bool:
        """Whether the user chose a tile configuration (tiles, warps or stages) themselves."""
        return bool(self.BLOCK_M or self.BLOCK_N or self.num_warps or self.num_stages)

    @classmethod
    def from_any(cls, options: "KernelOptions | Mapping[str, Any] | None") -> "KernelOptions":
        """Accept None, a KernelOptions, or a dict of its field names and of torch's keys."""
        if options is None:
            return _DEFAULT if cls is KernelOptions else cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise InputError(f"kernel_options must be a dict or flexcore.KernelOptions, got "
                             f"{type(options).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in options.items() if k in fields}
        theirs = {k: v for k, v in options.items() if k not in fields}
        unknown = sorted(str(k) for k in theirs if not _is_torch_key(k))
        if unknown:
            raise InputError(f"unknown kernel_options {unknown}; valid keys: "
                             f"{[f.name for f in dataclasses.fields(cls)]}, and torch's "
                             f"{sorted(_TORCH_KEYS)} (each also with a fwd_/bwd_ prefix)")
        if theirs:
            ours = _map_torch_options(ours, theirs)
        return cls(**ours)


# torch 2.13's FlexKernelOptions and the knobs its templates read: what each default asks for.
# None: no default (a value pins a tile or a vendor setting).
_TORCH_DEFAULTS: dict[str, Any] = {
    "BACKEND": "AUTO", "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False,
    "BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True, "FORCE_USE_FLEX_ATTENTION": False,
    "USE_TMA": False, "BLOCK_M1": None, "BLOCK_N1": None, "BLOCK_M2": None, "BLOCK_N2": None,
    "kpack": None, "matrix_instr_nonkdim": None, "waves_per_eu": None,
    "num_consumer_groups": None, "num_buffers_warp_spec": None,
}
_TORCH_KEYS = frozenset(_TORCH_DEFAULTS)
# Keys torch reads per pass with a fwd_/bwd_ prefix.
_PREFIXABLE = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}) | _TORCH_KEYS
_BACKENDS = {"AUTO": None, "TRITON": False, "TRITON_DECODE": True, "FLASH": None}
_WARNED: set[frozenset] = set()


def _is_torch_key(key) -> bool:
    if not isinstance(key, str):
        return False
    if key in _TORCH_KEYS:
        return True
    return key[:4] in ("fwd_", "bwd_") and key[4:] in _PREFIXABLE


def _asks_nothing(key: str, value) -> bool:
    """Whether a torch key holds torch's default value (with or without a fwd_/bwd_ prefix)."""
    base = key[4:] if key[:4] in ("fwd_", "bwd_") else key
    default = _TORCH_DEFAULTS.get(base)
    return default is not None and type(value) is type(default) and value == default


def _map_torch_options(ours: dict, theirs: dict) -> dict:
    """flexcore fields from torch's keys: decode from BACKEND / FORCE_USE_FLEX_ATTENTION; one
    warning naming the keys that ask for something flexcore does not do."""
    if "BACKEND" in theirs and theirs.get("FORCE_USE_FLEX_ATTENTION", False):
        raise KernelOptionsConflict(
            "kernel_options: BACKEND cannot be combined with FORCE_USE_FLEX_ATTENTION (as in "
            "torch); give BACKEND alone ('TRITON' forbids the decoding kernel)")
    decode = None
    if "BACKEND" in theirs:
        backend = theirs["BACKEND"]
        if backend not in _BACKENDS:
            raise InputError(f"kernel_options['BACKEND'] = {backend!r}: expected one of "
                             f"{list(_BACKENDS)}")
        decode = _BACKENDS[backend]
    if theirs.get("FORCE_USE_FLEX_ATTENTION", False):
        decode = False
    if decode is not None:
        if ours.get("decode") not in (None, decode):
            source = (f"BACKEND={theirs['BACKEND']!r}" if "BACKEND" in theirs
                      else "FORCE_USE_FLEX_ATTENTION=True")
            raise KernelOptionsConflict(f"kernel_options: decode={ours['decode']} contradicts {source}")
        ours = dict(ours, decode=decode)
    ignored = sorted(k for k, v in theirs.items()
                     if k not in ("BACKEND", "FORCE_USE_FLEX_ATTENTION") and not _asks_nothing(k, v))
    if theirs.get("BACKEND") == "FLASH":
        ignored.append("BACKEND")
    if ignored and not torch.compiler.is_compiling():
        _warn_ignored(ignored)
    return ours


def _warn_ignored(keys: list[str]) -> None:
    """One warning per distinct set of ignored keys."""
    key_set = frozenset(keys)
    if key_set in _WARNED:
        return
    _WARNED.add(key_set)
    warnings.warn(
        f"kernel_options {keys} are torch flex_attention options that flexcore's kernels do not "
        f"use; they are ignored (flexcore chooses TMA, block traversal and its backward tiles "
        f"itself; BLOCK_M/BLOCK_N/num_warps/num_stages pin the tiles of both passes, "
        f"decode=True/False picks the kernel)", UserWarning, stacklevel=5)


_DEFAULT = KernelOptions()

try:  # torch's typed dict of its kernel_options keys: such a dict is accepted as it is
    from torch.nn.attention.flex_attention import FlexKernelOptions
except ImportError:  # an older torch
    FlexKernelOptions = dict
