"""Typed kernel options (``kernel_options=`` of :func:`flexcore.flex_attention`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from flexcore.errors import InputError


@dataclass(frozen=True)
class KernelOptions:
    """Knobs of flexcore's kernels. Every field defaults to "choose automatically".

    A plain dict with the same keys is accepted wherever KernelOptions is (torch's
    ``kernel_options`` dicts use these names too).

    Attributes:
        BLOCK_M: query rows per program. Must divide the BlockMask's query BLOCK_SIZE. Larger tiles
            reuse K/V more (faster on long sequences) but need more registers.
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
    """

    BLOCK_M: int | None = None
    BLOCK_N: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    autotune: bool = True
    allow_tf32: bool = False
    decode: bool | None = None
    deterministic: bool = False

    def __post_init__(self):
        for name in ("BLOCK_M", "BLOCK_N"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 16 or value & (value - 1)):
                raise InputError(f"kernel_options[{name!r}] = {value!r}: expected a power of two >= 16")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InputError(f"kernel_options[{name!r}] = {value!r}: expected a positive int")

    @property
    def pins_tiles(self) -> bool:
        """Whether the user chose a tile configuration (tiles, warps or stages) themselves."""
        return bool(self.BLOCK_M or self.BLOCK_N or self.num_warps or self.num_stages)

    @classmethod
    def from_any(cls, options: "KernelOptions | Mapping[str, Any] | None") -> "KernelOptions":
        """Accept None, a KernelOptions, or a dict of the same field names."""
        if options is None:
            return _DEFAULT if cls is KernelOptions else cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise InputError(f"kernel_options must be a dict or flexcore.KernelOptions, got "
                             f"{type(options).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise InputError(f"unknown kernel_options {unknown}; valid keys: {valid}")
        return cls(**options)


_DEFAULT = KernelOptions()
