"""Launching with a fixed tile configuration that may not fit the GPU.

A mod that keeps many values live (a gather from a captured table, say) can push a tile
configuration past the shared memory of the GPU. Triton only finds out when the kernel is loaded,
so a launch that runs out is retried with the next smaller configuration, and the configuration
that worked is remembered for the same kernel and constexprs.
"""
from __future__ import annotations

import warnings
from typing import Callable, Iterator

import torch

from flexcore._runtime import capturing

_fallback_cache: dict = {}


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
           tile_names: tuple[str, str] = ("BLOCK_M", "BLOCK_N")) -> tuple[int, int, dict]:
    """Launch ``kernel[grid(bm, bn)](*args, BLOCK_M=bm, BLOCK_N=bn, **meta, **kwargs)`` (the tile
    constexprs are named by ``tile_names``).

    On the GPU a configuration that runs out of shared memory is replaced by the next of
    :func:`smaller_configs`. ``pinned`` says the user chose the configuration in ``kernel_options``;
    they are then warned once which configuration ran instead. Returns the configuration that ran.
    """
    key = (id(kernel), tile_names, bm, bn, tuple(sorted(meta.items())),
           tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    requested = (bm, bn, meta)
    bm, bn, meta = _fallback_cache.get(key, requested)
    error = None
    for bm, bn, meta in smaller_configs(bm, bn, meta):
        try:
            kernel[grid(bm, bn)](*args, **{tile_names[0]: bm, tile_names[1]: bn}, **meta, **kwargs)
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
                              stacklevel=3)
        return bm, bn, meta
    raise error


class Tuned:
    """A triton autotuner whose choices are remembered on the host.

    The first call for a key autotunes (the autotuner times its configurations); later calls
    launch the chosen configuration on the kernel directly. That skips the autotuner's per-call
    work over every argument, which costs more than a decoding step's kernel on the GPU.
    """

    def __init__(self, tuner):
        self.tuner = tuner
        self.chosen: dict = {}

    def launch(self, grid, args: tuple, kwargs: dict, key: tuple = ()) -> None:
        """``tuner[grid](*args, **kwargs)``; ``key`` holds the values of the tuner's ``key`` arguments
        (the dtypes of the tensor arguments are added here, as the autotuner does)."""
        full_key = (key, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        config = self.chosen.get(full_key)
        if config is None and capturing():
            # Timing configurations inside a CUDA graph capture would break it: run the first one
            # and tune at the next call outside a capture (warm up before capturing to get the
            # tuned configuration into the graph).
            config = self.tuner.configs[0]
        elif config is None:
            self.tuner[grid](*args, **kwargs)
            self.chosen[full_key] = self.tuner.best_config
            return
        self.tuner.fn[grid](*args, **kwargs, **config.all_kwargs())
