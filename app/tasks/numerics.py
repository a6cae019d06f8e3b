"""Check and Gradients (run in the worker): flexcore and the providers against float64.

Inputs are drawn from the experiment's seed, and every candidate of one action reads the same
mods (:func:`app.tasks.mods.mods_for`), hence the same captured tensors. A result passes when its
error is at most twice that of the eager reference in the same dtype plus a small epsilon
(:func:`flexcore.testing.tolerance_check`), for outputs and gradients alike.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from app.tasks.mods import device, mods_for
from app.tasks.views import block_mask_of, pool
from bench.context import make_context
from bench.grid import Case, Settings
from bench.providers import PROVIDERS, Unsupported
from flexcore import flex_attention
from flexcore.reference import flex_attention_reference
from flexcore.testing import DEFAULT_EPS, error_metrics, tolerance_check, within_tolerance


def inputs(shape: dict, dtype: str, seed: int, requires_grad: bool = False):
    """q, k, v of the shape in ``dtype``, standard normal from ``seed`` (drawn in float32)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, dtype)

    def make(heads, length):
        t = torch.randn(shape["B"], heads, length, shape["D"], generator=g).to(device(), dt)
        return t.requires_grad_(requires_grad)

    return (make(shape["Hq"], shape["Q_LEN"]), make(shape["Hkv"], shape["KV_LEN"]),
            make(shape["Hkv"], shape["KV_LEN"]))


def check(code: str, shape: dict, seed: int, dtypes: list[str], b: int, h: int) -> dict:
    """flexcore against the float64 reference, per dtype, with torch's own error as the baseline.

    Returns:
        ``{"rows": [{dtype, max_abs, mean_abs, rel_fro, torch_max_abs, threshold, passed}],
        "heatmaps": {dtype: pooled |out - golden| of head (b, h), (Q_LEN, D)}}``.
    """
    mods = mods_for(code, shape, seed)
    bm = block_mask_of(mods, shape)
    gqa = shape["Hq"] != shape["Hkv"]
    sinks = mods.sinks
    rows, heatmaps = [], {}
    for i, dtype in enumerate(dtypes):
        q, k, v = inputs(shape, dtype, seed + i)
        with torch.no_grad():
            golden = flex_attention_reference(q, k, v, score_mod=mods.score_mod, block_mask=bm,
                                              enable_gqa=gqa, sinks=sinks)
            baseline = flex_attention_reference(q, k, v, score_mod=mods.score_mod, block_mask=bm,
                                                enable_gqa=gqa, upcast=False, sinks=sinks)
            out = flex_attention(q, k, v, score_mod=mods.score_mod, block_mask=bm, enable_gqa=gqa,
                                 sinks=sinks)
        res = tolerance_check(out, golden, baseline)
        rows.append({"dtype": dtype, "max_abs": res.errors["max_abs"],
                     "mean_abs": res.errors["mean_abs"], "rel_fro": res.errors["rel_fro"],
                     "torch_max_abs": res.baseline_errors["max_abs"], "threshold": res.threshold,
                     "passed": bool(res.passed)})
        err = (out[b, h].double() - golden[b, h]).abs().cpu().numpy()
        heatmaps[dtype] = pool(err)[0]
    return {"rows": rows, "heatmaps": heatmaps}


def learnable_of(mods) -> dict:
    """The tensors whose gradients are compared, by name: the learnable captured tensors, and the
    attention sinks ("sinks") when they require grad."""
    learnable = dict(mods.learnable)
    sinks = mods.sinks
    if sinks is not None and sinks.requires_grad and all(t is not sinks for t in learnable.values()):
        learnable["sinks"] = sinks
    return learnable


@contextlib.contextmanager
def upcast_learnable(learnable: dict):
    """The learnable captured tensors in float64 for the golden run, restored bit for bit after."""
    saved = {}
    try:
        for name, t in learnable.items():
            if t.is_leaf and t.is_floating_point():
                saved[name] = t.data
                t.data = t.data.double()
        yield
    finally:
        for name, data in saved.items():
            learnable[name].data = data


def gradients(code: str, shape: dict, seed: int, dtype: str) -> dict:
    """dQ, dK, dV and captured-tensor gradients of flexcore and the providers, against float64.

    Every candidate gets the same q, k, v, output gradient and captured tensors. The threshold of
    each gradient is ``2 * (error of the eager reference in dtype) + eps(dtype)``, as Check's.

    Returns:
        ``{"rows": [{source, tensor, max_abs, mean_abs, rel_fro, threshold, passed}],
        "notes": [str]}``.
    """
    mods = mods_for(code, shape, seed)
    learnable = learnable_of(mods)
    sinks = mods.sinks
    bm = block_mask_of(mods, shape)
    gqa = shape["Hq"] != shape["Hkv"]
    notes: list[str] = []
    q0, k0, v0 = inputs(shape, dtype, seed)
    g = torch.Generator().manual_seed(seed + 99)
    d_out = torch.randn(q0.shape[:-1] + (shape["D"],), generator=g).to(q0.device, q0.dtype)

    def grads_of(call: Callable, upcast: bool) -> dict:
        q, k, v = (t.detach().double() if upcast else t.detach() for t in (q0, k0, v0))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        out = call(q, k, v)
        names = ["dQ", "dK", "dV", *[f"d{n}" for n in learnable]]
        grads = torch.autograd.grad(out, [q, k, v, *learnable.values()],
                                    d_out.to(out.dtype), allow_unused=True)
        return {n: gr for n, gr in zip(names, grads) if gr is not None}

    with upcast_learnable(learnable):
        golden = grads_of(lambda q, k, v: flex_attention_reference(
            q, k, v, score_mod=mods.score_mod, block_mask=bm, enable_gqa=gqa, sinks=sinks), True)
    baseline_name = f"eager reference ({dtype})"
    candidates: dict[str, Callable] = {
        baseline_name: lambda q, k, v: flex_attention_reference(
            q, k, v, score_mod=mods.score_mod, block_mask=bm, enable_gqa=gqa, upcast=False,
            sinks=sinks),
        "flexcore": lambda q, k, v: flex_attention(q, k, v, score_mod=mods.score_mod,
                                                   block_mask=bm, enable_gqa=gqa, sinks=sinks),
    }
    candidates.update(_provider_grad_calls(mods, shape, seed, dtype, notes))
    eps = DEFAULT_EPS.get(getattr(torch, dtype), 1e-5)
    results: dict[str, dict] = {}
    for source, call in candidates.items():
        try:
            results[source] = grads_of(call, False)
        except NotImplementedError as e:
            notes.append(f"{source}: backward not available ({e})")
        except Unsupported as e:
            notes.append(f"{source}: cannot express this variant ({e})")
        except Exception as e:  # noqa: BLE001 - one provider failing must not hide the others
            if source in (baseline_name, "flexcore"):
                raise
            notes.append(f"{source}: {type(e).__name__}: {e}")
    baseline = results.get(baseline_name, {})
    rows = []
    for source, grads in results.items():
        for name, gold in golden.items():
            if name not in grads:
                notes.append(f"{source}: gives no {name}")
                continue
            errors = error_metrics(grads[name], gold)
            base = error_metrics(baseline[name], gold)["max_abs"] if name in baseline else None
            threshold = None if base is None else 2.0 * base + eps
            rows.append({"source": source, "tensor": name, **errors, "threshold": threshold,
                         "passed": None if threshold is None else within_tolerance(errors["max_abs"],
                                                                                   threshold)})
    return {"rows": rows, "notes": notes, "baseline": baseline_name}


def _provider_grad_calls(mods, shape: dict, seed: int, dtype: str, notes: list[str]) -> dict:
    """bench providers (other than flexcore) that can express and differentiate the variant here,
    built on the worker's own mods of the code (so on the same captured tensors)."""
    dev = torch.device(device())
    case = Case("playground", shape["B"], shape["Hq"], shape["Hkv"], shape["Q_LEN"],
                shape["KV_LEN"], shape["D"], shape["D"], dtype, "fwd_bwd")
    try:
        ctx = make_context(case, Settings(block_size=shape["BLOCK_SIZE"], seed=seed), dev, n_sets=1,
                           mods=mods)
    except Exception as e:  # noqa: BLE001
        notes.append(f"providers: the bench case could not be set up ({type(e).__name__}: {e})")
        return {}
    out = {}
    for name, provider in PROVIDERS.items():
        if name.startswith("flexlab") or (provider.passes is not None
                                          and "fwd_bwd" not in provider.passes):
            continue  # flexcore itself, and providers that measure other passes only
        ok, why = provider.available(dev)
        if not ok:
            notes.append(f"{name}: not available here ({why})")
            continue
        try:
            prepared = provider.prepare(ctx)
        except Unsupported as e:
            notes.append(f"{name}: cannot express this variant ({e})")
            continue
        except Exception as e:  # noqa: BLE001
            notes.append(f"{name}: {type(e).__name__}: {e}")
            continue
        out[name] = prepared.grad_call or prepared.call
    return out


def output_difference(code_a: str, code_b: str, shape: dict, seed: int, b: int, h: int) -> dict:
    """flexcore's outputs of two mods on the same q, k, v (the shape's dtype): how they differ.

    Returns:
        ``{"max_abs", "mean_abs", "rel_fro", "heatmap": pooled |out_a - out_b| of (b, h)}``.
    """
    gqa = shape["Hq"] != shape["Hkv"]
    q, k, v = inputs(shape, shape["dtype"], seed)
    outs = []
    for code in (code_a, code_b):
        mods = mods_for(code, shape, seed)
        with torch.no_grad():
            outs.append(flex_attention(q, k, v, score_mod=mods.score_mod,
                                       block_mask=block_mask_of(mods, shape), enable_gqa=gqa,
                                       sinks=mods.sinks))
    metrics = error_metrics(outs[0], outs[1])
    diff = (outs[0][b, h].double() - outs[1][b, h].double()).abs().cpu().numpy()
    return {**metrics, "heatmap": pool(diff)[0]}
