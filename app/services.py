"""Glue between the pages and the libraries: every call the pages make goes through here.

Pages read widgets and call these functions; these call ``flexcore``, ``variants`` and ``bench``.
Results are plain data (dicts, numpy arrays) so that ``st.cache_data`` can keep them; live objects
(the user's mods, BlockMasks, hence their compiled kernels) are kept with ``st.cache_resource``.

A feature whose library piece is missing raises :class:`Unavailable`, which the pages show as
"unavailable, and why" instead of a traceback.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import streamlit as st

from app import sandbox
from app.usercode import CodeProblem, UserCodeError, UserMods, problem_from_exception, run_code

DTYPES = ("float32", "float16", "bfloat16")
#: Largest side of a heatmap; larger masks are pooled down to it.
MAX_PIXELS = 256


class Unavailable(Exception):
    """A feature needs a library piece that this checkout or machine does not have."""


def need(module: str, *names: str):
    """Import ``module`` and return it (or the named attributes), or raise Unavailable saying why."""
    try:
        mod = importlib.import_module(module)
        values = [getattr(mod, n) for n in names]
    except (ImportError, AttributeError) as e:
        wanted = f"{module}.{names[0]}" if len(names) == 1 else module
        raise Unavailable(f"`{wanted}` is not available in this checkout ({e}).") from None
    if not names:
        return mod
    return values[0] if len(values) == 1 else values


# ---------------------------------------------------------------------------------------------
# Machine, limits and environment
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """What the shape controls allow on this machine.

    In CPU mode Triton kernels run under Triton's interpreter (about 3 ms per inner-loop step), so
    shapes are capped to what it runs in seconds and timings are not representative.
    """

    cpu_mode: bool
    device: str
    max_len: int
    max_bh: int
    max_d: int
    block_sizes: tuple[int, ...]
    default_block: int

    def describe(self) -> str:
        if not self.cpu_mode:
            return "GPU mode: flexcore's Triton kernels run on the GPU."
        return (f"CPU mode: no CUDA GPU, so flexcore's kernels run under Triton's interpreter. "
                f"Shapes are limited to Q_LEN, KV_LEN ≤ {self.max_len}, B·Hq ≤ {self.max_bh} and "
                f"D ≤ {self.max_d} so that every action finishes in seconds; timings measured here "
                f"are not representative of GPU performance.")


@st.cache_resource
def limits() -> Limits:
    import torch

    if torch.cuda.is_available():
        return Limits(False, "cuda", 65536, 256, 256, (64, 128, 256), 128)
    return Limits(True, "cpu", 256, 8, 64, (16, 32, 64, 128), 32)


def default_shape() -> dict:
    lim = limits()
    if lim.cpu_mode:
        return dict(B=1, Hq=2, Hkv=2, Q_LEN=128, KV_LEN=128, D=32, dtype="float32",
                    BLOCK_SIZE=lim.default_block)
    return dict(B=2, Hq=16, Hkv=16, Q_LEN=4096, KV_LEN=4096, D=128, dtype="bfloat16",
                BLOCK_SIZE=lim.default_block)


def shape_problem(shape: dict) -> CodeProblem | None:
    """Why a shape cannot be attended, or None."""
    lim = limits()
    if shape["Hq"] % shape["Hkv"]:
        return CodeProblem("shape", "Impossible shape",
                           f"Hq = {shape['Hq']} query heads cannot be shared among Hkv = "
                           f"{shape['Hkv']} key/value heads: Hq must be a multiple of Hkv "
                           "(grouped-query attention). Change Hq or Hkv.")
    if lim.cpu_mode:
        over = [f"{k} = {shape[k]}" for k in ("Q_LEN", "KV_LEN") if shape[k] > lim.max_len]
        if shape["B"] * shape["Hq"] > lim.max_bh:
            over.append(f"B·Hq = {shape['B'] * shape['Hq']}")
        if shape["D"] > lim.max_d:
            over.append(f"D = {shape['D']}")
        if over:
            return CodeProblem("shape", "Shape too large for CPU mode",
                               f"{', '.join(over)} exceeds what the interpreter runs in seconds. "
                               + limits().describe())
    return None


def code_shape(shape: dict) -> dict:
    """The part of the shape the user's code sees (it is what the sandbox result depends on)."""
    return {k: shape[k] for k in ("B", "Hq", "Hkv", "Q_LEN", "KV_LEN", "D")} | {"device": limits().device}


@st.cache_data(show_spinner=False)
def environment() -> dict:
    """Device, versions and providers, for the Environment page."""
    import platform

    import torch

    lim = limits()
    info: dict[str, Any] = {"mode": "GPU" if not lim.cpu_mode else "CPU",
                            "limits": lim.describe(), "python": platform.python_version(),
                            "torch": torch.__version__}
    import importlib.metadata

    # Package metadata only: importing triton would run its @jit decorators before the
    # interpreter is selected (see flexcore._runtime.prepare_triton).
    for dist in ("triton", "streamlit", "plotly", "streamlit-ace"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = "not installed"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        capture = need("bench.env", "capture")
        info["bench_env"] = {k: v for k, v in capture(lim.device).items()
                             if isinstance(v, (str, int, float, bool)) or v is None}
    except Unavailable as e:
        info["bench_env_error"] = str(e)
    except Exception as e:  # noqa: BLE001 - environment capture is informative only
        info["bench_env_error"] = f"{type(e).__name__}: {e}"
    return info


@st.cache_data(show_spinner=False)
def providers() -> list[dict]:
    """Each attention provider bench knows, whether it runs here, and why not.

    Returns:
        ``[{"name", "available", "reason", "description"}]``.
    """
    import torch

    availability, PROVIDERS = need("bench.providers", "availability", "PROVIDERS")
    out = []
    for name, (ok, why) in availability(torch.device(limits().device)).items():
        out.append({"name": name, "available": bool(ok), "reason": why,
                    "description": getattr(PROVIDERS.get(name), "description", "")})
    return out


# ---------------------------------------------------------------------------------------------
# The user's code: checked in a child process, then run here
# ---------------------------------------------------------------------------------------------

class _CheckerFailed(Exception):
    """The child process itself failed (not the user's code): never cached."""


@st.cache_data(show_spinner=False, max_entries=64)
def _sandbox_result(code: str, shape: dict, timeout_s: float) -> dict:
    result = sandbox.check_code(code, shape, timeout_s)
    if not result["ok"] and result["problem"]["kind"] == "internal":
        raise _CheckerFailed(result["problem"]["message"])
    return result


def prepare(code: str, shape: dict, timeout_s: float | None = None) -> dict:
    """Check the user's code safely (child process, time limit).

    The limit is ``sandbox.DEFAULT_TIMEOUT_S`` on the CPU and three times that on a GPU, where each
    worker also creates its CUDA context.

    Returns:
        ``{"ok": True, "score_source", "mask_source", "tensors"}`` or
        ``{"ok": False, "problem": CodeProblem}``.
    """
    problem = shape_problem(shape)
    if problem is not None:
        return {"ok": False, "problem": problem}
    if timeout_s is None:
        timeout_s = sandbox.DEFAULT_TIMEOUT_S * (1 if limits().cpu_mode else 3)
    try:
        result = dict(_sandbox_result(code, code_shape(shape), timeout_s))
    except _CheckerFailed as e:
        return {"ok": False, "problem": CodeProblem("internal", "The code checker failed", str(e))}
    if not result["ok"]:
        result["problem"] = CodeProblem.from_dict(result["problem"])
    return result


@st.cache_resource(show_spinner=False, max_entries=16)
def compiled_mods(code: str, shape_key: tuple) -> UserMods:
    """The user's mods, run in this process (only after :func:`prepare` succeeded). Never mutate."""
    return run_code(code, dict(shape_key))


def load_mods(code: str, shape: dict) -> UserMods:
    return compiled_mods(code, tuple(sorted(code_shape(shape).items())))


def fresh_mods(code: str, shape: dict) -> UserMods:
    """A new run of the code, for work that writes to its tensors (gradients)."""
    return run_code(code, code_shape(shape))


def as_problem(exc: BaseException, code: str, stage: str) -> CodeProblem:
    """A CodeProblem for an exception from the libraries while working on the user's code."""
    if isinstance(exc, NotImplementedError):
        return CodeProblem("unavailable", "Not available yet", str(exc))
    return problem_from_exception(exc, code, stage)


def _slice_mod(fn: Callable, b0: int, h0: int, score: bool, q0: int = 0) -> Callable:
    """``fn`` seen from one (b, h) and a row offset: index 0 means ``(b0, h0, q0)``."""
    if score:
        def sliced(s, b, h, q_idx, kv_idx):
            return fn(s, b + b0, h + h0, q_idx + q0, kv_idx)
    else:
        def sliced(b, h, q_idx, kv_idx):
            return fn(b + b0, h + h0, q_idx + q0, kv_idx)
    sliced.__name__ = getattr(fn, "__name__", "mod")
    return sliced


def _pool_factors(rows: int, cols: int, max_side: int = MAX_PIXELS) -> tuple[int, int]:
    return max(1, math.ceil(rows / max_side)), max(1, math.ceil(cols / max_side))


def _pool_sums(array, rs: int, cs: int):
    """Sums over rs x cs tiles of a 2-D array (ragged edges padded with zeros)."""
    import numpy as np

    rows, cols = array.shape
    padded = np.pad(array.astype(np.float64), ((0, (-rows) % rs), (0, (-cols) % cs)))
    return padded.reshape(padded.shape[0] // rs, rs, padded.shape[1] // cs, cs).sum(axis=(1, 3))


def _pool(array, max_side: int = MAX_PIXELS):
    """Average-pool a 2-D array so neither side exceeds ``max_side``; returns (array, (rs, cs))."""
    import numpy as np

    rs, cs = _pool_factors(*array.shape, max_side)
    if (rs, cs) == (1, 1):
        return array.astype(np.float32), (1, 1)
    sums = _pool_sums(np.nan_to_num(array), rs, cs)
    counts = _pool_sums(np.ones(array.shape), rs, cs)
    return (sums / np.maximum(counts, 1)).astype(np.float32), (rs, cs)


#: Positions evaluated at once when drawing a long mask (bounded memory at any sequence length).
_CHUNK_POSITIONS = 1 << 24


def _pooled_rows(evaluate: Callable, L: int, S: int) -> dict:
    """Evaluate a (rows, S) slab at a time and pool it, so long sequences never materialise L x S.

    ``evaluate(q0, rows) -> (kept bool array, values float array or None)``.

    Returns:
        ``{"kept": exact kept count, "frac": pooled fraction kept, "mean": pooled mean of the
        values over kept positions (or None), "pool": (rs, cs)}``.
    """
    import numpy as np

    rs, cs = _pool_factors(L, S)
    step = max(rs, (_CHUNK_POSITIONS // max(S, 1)) // rs * rs)
    kept_sum, frac, mean = 0, [], []
    for q0 in range(0, L, step):
        rows = min(step, L - q0)
        keep, values = evaluate(q0, rows)
        kept_sum += int(keep.sum())
        k = _pool_sums(keep, rs, cs)
        n = _pool_sums(np.ones(keep.shape), rs, cs)
        frac.append(k / np.maximum(n, 1))
        if values is not None:
            v = _pool_sums(np.where(keep, values, 0.0), rs, cs)
            mean.append(np.where(k > 0, v / np.maximum(k, 1), np.nan))
    return {"kept": kept_sum, "frac": np.concatenate(frac).astype(np.float32),
            "mean": np.concatenate(mean).astype(np.float32) if mean else None, "pool": (rs, cs)}


def _mask_pooled(mask_mod: Callable | None, b: int, h: int, L: int, S: int) -> dict:
    """Pooled token-level mask of head (b, h), with the exact number of kept positions."""
    import numpy as np

    if mask_mod is None:
        return _pooled_rows(lambda q0, rows: (np.ones((rows, S), dtype=bool), None), L, S)
    create_mask = need("flexcore", "create_mask")

    def evaluate(q0, rows):
        dense = create_mask(_slice_mod(mask_mod, b, h, False, q0), 1, 1, rows, S,
                            device=limits().device)[0, 0]
        return dense.cpu().numpy(), None

    return _pooled_rows(evaluate, L, S)


@st.cache_data(show_spinner=False, max_entries=64)
def mask_view(code: str, shape: dict, b: int, h: int) -> dict:
    """The token-level mask of head (b, h): pooled for display, with exact counts."""
    mods = load_mods(code, shape)
    L, S = shape["Q_LEN"], shape["KV_LEN"]
    pooled = _mask_pooled(mods.mask_mod, b, h, L, S)
    return {"pooled": pooled["frac"], "pool": pooled["pool"], "kept": pooled["kept"],
            "total": L * S, "has_mask": mods.mask_mod is not None}


@st.cache_resource(show_spinner=False, max_entries=16)
def block_mask(code: str, shape_key: tuple, block_size: int):
    """The BlockMask of the user's mask_mod at this shape (kept, never mutated)."""
    shape = dict(shape_key)
    create_block_mask, noop_mask = need("flexcore", "create_block_mask", "noop_mask")
    mods = compiled_mods(code, tuple(sorted(code_shape(shape).items())))
    return create_block_mask(mods.mask_mod or noop_mask, shape["B"], shape["Hq"], shape["Q_LEN"],
                             shape["KV_LEN"], device=limits().device, BLOCK_SIZE=block_size)


def _shape_key(shape: dict) -> tuple:
    return tuple(sorted(code_shape(shape).items()))


@st.cache_data(show_spinner=False, max_entries=64)
def block_view(code: str, shape: dict, b: int, h: int) -> dict:
    """Block map of head (b, h) (0 empty, 1 partial, 2 full), counts, sparsity and FLOPs saved."""
    bm = block_mask(code, _shape_key(shape), shape["BLOCK_SIZE"])
    block_map = bm.block_map()
    bb, hh = min(b, block_map.shape[0] - 1), min(h, block_map.shape[1] - 1)
    counts = bm.counts()
    view = {"map": block_map[bb, hh].cpu().numpy(), "full": counts.full, "partial": counts.partial,
            "empty": counts.empty, "sparsity": bm.sparsity(), "block_size": tuple(bm.BLOCK_SIZE)}
    try:
        attention_flops, block_density = need("bench.flops", "attention_flops", "block_density")
        density = block_density(bm)
        args = (shape["B"], shape["Hq"], shape["Q_LEN"], shape["KV_LEN"], shape["D"], shape["D"])
        dense = attention_flops(*args, 1.0, "fwd")
        view.update(density=density, flops_dense=dense,
                    flops_sparse=attention_flops(*args, density, "fwd"))
    except Unavailable as e:
        view["flops_error"] = str(e)
    return view


@st.cache_data(show_spinner=False, max_entries=64)
def score_view(code: str, shape: dict, b: int, h: int, zero_scores: bool) -> dict:
    """Post-score_mod scores of head (b, h) through the generated Triton code (masked = NaN).

    Pooled pixels show the mean over the kept positions they cover.
    """
    import numpy as np
    import torch

    evaluate_mods = need("flexcore.lowering", "evaluate_mods")
    mods = load_mods(code, shape)
    L, S = shape["Q_LEN"], shape["KV_LEN"]
    generator = torch.Generator().manual_seed(0)
    bounds = [np.inf, -np.inf]

    def evaluate(q0, rows):
        score_mod = _slice_mod(mods.score_mod, b, h, True, q0) if mods.score_mod else None
        mask_mod = _slice_mod(mods.mask_mod, b, h, False, q0) if mods.mask_mod else None
        score = (torch.zeros(1, 1, rows, S) if zero_scores
                 else torch.randn(1, 1, rows, S, generator=generator))
        scores, mask = evaluate_mods(score_mod, mask_mod, 1, 1, rows, S, device=limits().device,
                                     score=score)
        keep, values = mask[0, 0].cpu().numpy(), scores[0, 0].cpu().numpy()
        if keep.any():
            bounds[0] = min(bounds[0], float(values[keep].min()))
            bounds[1] = max(bounds[1], float(values[keep].max()))
        return keep, values

    pooled = _pooled_rows(evaluate, L, S)
    finite = bool(np.isfinite(bounds).all())
    return {"pooled": pooled["mean"], "pool": pooled["pool"],
            "min": bounds[0] if finite else float("nan"), "max": bounds[1] if finite else float("nan"),
            "has_score_mod": mods.score_mod is not None}


# ---------------------------------------------------------------------------------------------
# Check, gradients, benchmark, export
# ---------------------------------------------------------------------------------------------

def _inputs(shape: dict, dtype: str, seed: int, requires_grad: bool = False):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, dtype)
    dev = limits().device

    def make(heads, length):
        t = torch.randn(shape["B"], heads, length, shape["D"], generator=g).to(dev, dt)
        return t.requires_grad_(requires_grad)

    return make(shape["Hq"], shape["Q_LEN"]), make(shape["Hkv"], shape["KV_LEN"]), \
        make(shape["Hkv"], shape["KV_LEN"])


@st.cache_data(show_spinner=False, max_entries=32)
def check(code: str, shape: dict, dtypes: tuple[str, ...], b: int, h: int, seed: int = 0) -> dict:
    """flexcore against the float64 reference, per dtype, with torch's own error as the baseline.

    Returns:
        ``{"rows": [{dtype, max_abs, mean_abs, baseline_max_abs, threshold, passed}],
        "heatmaps": {dtype: pooled |out - golden| of head (b, h), (Q_LEN, D)}}`` or
        ``{"problem": CodeProblem}`` (never raises for the user's mistakes).
    """
    import torch

    flex_attention = need("flexcore", "flex_attention")
    reference = need("flexcore.reference", "flex_attention_reference")
    tolerance_check = need("flexcore.testing", "tolerance_check")
    mods = load_mods(code, shape)
    bm = block_mask(code, _shape_key(shape), shape["BLOCK_SIZE"])
    gqa = shape["Hq"] != shape["Hkv"]
    rows, heatmaps = [], {}
    for i, dtype in enumerate(dtypes):
        q, k, v = _inputs(shape, dtype, seed + i)
        try:
            with torch.no_grad():
                golden = reference(q, k, v, score_mod=mods.score_mod, block_mask=bm, enable_gqa=gqa)
                baseline = reference(q, k, v, score_mod=mods.score_mod, block_mask=bm,
                                     enable_gqa=gqa, upcast=False)
                out = flex_attention(q, k, v, score_mod=mods.score_mod, block_mask=bm,
                                     enable_gqa=gqa)
        except Exception as e:  # noqa: BLE001 - shown inline, with the user's line where known
            return {"problem": as_problem(e, code, f"while checking {dtype}")}
        res = tolerance_check(out, golden, baseline)
        rows.append({"dtype": dtype, "max_abs": res.errors["max_abs"],
                     "mean_abs": res.errors["mean_abs"], "rel_fro": res.errors["rel_fro"],
                     "torch_max_abs": res.baseline_errors["max_abs"], "threshold": res.threshold,
                     "passed": bool(res.passed)})
        err = (out[b, h].double() - golden[b, h]).abs().cpu().numpy()
        heatmaps[dtype] = _pool(err)[0]
    return {"rows": rows, "heatmaps": heatmaps}


@st.cache_data(show_spinner=False, max_entries=16)
def gradients(code: str, shape: dict, dtype: str, seed: int = 0) -> dict:
    """dQ, dK, dV and captured-tensor gradients of flexcore and of the providers, against float64.

    Every candidate gets the same q, k, v and output gradient; captured tensors with
    ``requires_grad`` are the user's learnable parameters.

    Returns:
        ``{"rows": [{source, tensor, max_abs, mean_abs, rel_fro}], "notes": [str]}`` or
        ``{"problem": CodeProblem}``.
    """
    import torch

    flex_attention = need("flexcore", "flex_attention")
    reference = need("flexcore.reference", "flex_attention_reference")
    error_metrics = need("flexcore.testing", "error_metrics")
    gqa = shape["Hq"] != shape["Hkv"]
    notes: list[str] = []

    def grads_of(call: Callable, learnable: dict, upcast: bool) -> dict:
        q, k, v = _inputs(shape, dtype, seed)
        if upcast:
            q, k, v = q.double(), k.double(), v.double()
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = call(q, k, v)
        g = torch.Generator().manual_seed(seed + 99)
        d_out = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
        names = ["dQ", "dK", "dV", *[f"d{n}" for n in learnable]]
        grads = torch.autograd.grad(out, [q, k, v, *learnable.values()], d_out, allow_unused=True)
        return {n: gr for n, gr in zip(names, grads) if gr is not None}

    def mods_call(fn: Callable, upcast: bool):
        mods = fresh_mods(code, shape)
        learn = mods.learnable
        if upcast:
            for t in learn.values():
                t.data = t.data.double()
        bm = block_mask(code, _shape_key(shape), shape["BLOCK_SIZE"])
        bm = bm.with_mask_mod(mods.mask_mod) if mods.mask_mod is not None else bm
        return (lambda q, k, v: fn(q, k, v, mods.score_mod, bm)), learn

    try:
        golden = grads_of(*mods_call(lambda q, k, v, sm, bm: reference(
            q, k, v, score_mod=sm, block_mask=bm, enable_gqa=gqa), True), True)
    except UserCodeError as e:
        return {"problem": e.problem}
    except Exception as e:  # noqa: BLE001
        return {"problem": as_problem(e, code, "while computing reference gradients")}
    candidates = {
        "flexcore": lambda: mods_call(lambda q, k, v, sm, bm: flex_attention(
            q, k, v, score_mod=sm, block_mask=bm, enable_gqa=gqa), False),
        f"eager reference ({dtype})": lambda: mods_call(lambda q, k, v, sm, bm: reference(
            q, k, v, score_mod=sm, block_mask=bm, enable_gqa=gqa, upcast=False), False),
    }
    candidates.update(_provider_grad_calls(code, shape, dtype, notes))
    rows = []
    for source, make in candidates.items():
        try:
            grads = grads_of(*make(), False)
        except NotImplementedError as e:
            notes.append(f"{source}: backward not available ({e})")
            continue
        except Exception as e:  # noqa: BLE001 - one provider failing must not hide the others
            notes.append(f"{source}: {type(e).__name__}: {e}")
            continue
        for name, gold in golden.items():
            if name in grads:
                rows.append({"source": source, "tensor": name, **error_metrics(grads[name], gold)})
            else:
                notes.append(f"{source}: gives no {name}")
    return {"rows": rows, "notes": notes}


def _provider_grad_calls(code: str, shape: dict, dtype: str, notes: list[str]) -> dict:
    """bench providers (other than flexlab) that can express and differentiate the variant here."""
    import torch

    try:
        Case, Settings = need("bench.grid", "Case", "Settings")
        make_context = need("bench.context", "make_context")
        PROVIDERS, Unsupported = need("bench.providers", "PROVIDERS", "Unsupported")
    except Unavailable as e:
        notes.append(f"providers: {e}")
        return {}
    device = torch.device(limits().device)
    case = Case(_variant_file(code, shape), shape["B"], shape["Hq"], shape["Hkv"], shape["Q_LEN"],
                shape["KV_LEN"], shape["D"], shape["D"], dtype, "fwd_bwd")
    try:
        ctx = make_context(case, Settings(block_size=shape["BLOCK_SIZE"]), device, n_sets=1)
    except Exception as e:  # noqa: BLE001
        notes.append(f"providers: the bench case could not be set up ({type(e).__name__}: {e})")
        return {}
    named = getattr(ctx, "learnable_named", None)
    learnable = dict(named) if named is not None else {}
    out = {}
    for name, provider in PROVIDERS.items():
        if name == "flexlab" or (provider.passes is not None and "fwd_bwd" not in provider.passes):
            continue  # flexlab itself, and providers that measure other passes only
        ok, why = provider.available(device)
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
        call = prepared.grad_call or prepared.call
        out[name] = (lambda call=call: (call, learnable))
    return out


def experiment_record(code: str, shape: dict, results: dict) -> dict:
    """Everything about one Playground experiment, as JSON-ready data."""
    import json

    def plain(x):
        try:
            json.dumps(x)
            return x
        except TypeError:
            if hasattr(x, "tolist"):
                return x.tolist()
            if isinstance(x, CodeProblem):
                return asdict(x)
            if isinstance(x, dict):
                return {str(k): plain(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [plain(v) for v in x]
            return str(x)

    env = environment()
    return {"kind": "flexlab-playground-experiment", "code": code, "shape": shape,
            "environment": plain(env), "results": plain(results)}


# ---------------------------------------------------------------------------------------------
# Benchmarks (bench's runner and reports)
# ---------------------------------------------------------------------------------------------

_WRAPPER = '''"""The workbench Playground's code, as a bench variant file (generated; do not edit)."""
CODE = {code!r}
HKV = {hkv!r}


def make(B, H, Q_LEN, KV_LEN, D, device):
    from app.usercode import run_code

    mods = run_code(CODE, {{"B": B, "Hq": H, "Hkv": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "D": D,
                           "device": str(device)}})
    return {{"score_mod": mods.score_mod, "mask_mod": mods.mask_mod, "captured": mods.tensors}}
'''


def results_root():
    """Where the workbench writes bench runs (git-ignored ``results/``)."""
    from pathlib import Path

    return results_dir() / "workbench"


def results_dir():
    """bench's results folder: ``$FLEXLAB_RESULTS_DIR``, else ``results/`` of the repository."""
    import os
    from pathlib import Path

    return Path(os.environ.get("FLEXLAB_RESULTS_DIR") or Path(sandbox.REPO_ROOT) / "results")


def _variant_file(code: str, shape: dict) -> str:
    import hashlib

    folder = results_root() / "playground-variants"
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(f"{code}\0{shape['Hkv']}".encode()).hexdigest()[:12]
    path = folder / f"playground_{digest}.py"
    if not path.exists():
        path.write_text(_WRAPPER.format(code=code, hkv=shape["Hkv"]))
    return str(path)


def _progress_log(progress: Callable[[float, str], None] | None, total: int):
    """A bench ``log`` callback that turns its ``[i/N] case`` lines into progress fractions."""
    import re

    def log(msg: str) -> None:
        if progress is None:
            return
        m = re.match(r"\[(\d+)/(\d+)\]\s*(.*)", msg)
        if m:
            done, n = int(m.group(1)), int(m.group(2))
            progress(done / max(n, 1), f"{done}/{n}: {m.group(3)[:80]}")
        else:
            progress(0.0 if total else 1.0, msg[:100])

    return log


def run_grid(grid, name: str, progress: Callable[[float, str], None] | None = None) -> dict:
    """Run a bench grid into ``results/workbench/<name>`` and return its loaded results."""
    run, load_results = need("bench.runner", "run", "load_results")
    out_dir = results_root() / name
    path = run(grid, out_dir, device=limits().device, force=True, progress=False,
               log=_progress_log(progress, len(grid.cases)))
    if progress is not None:
        progress(1.0, "done")
    data = load_results(path)
    data["path"] = str(out_dir)
    return data


def benchmark(code: str, shape: dict, progress: Callable[[float, str], None] | None = None) -> dict:
    """Time flexcore and every provider available here on the Playground's variant (forward).

    Returns:
        ``{"rows": [{provider, status, ms, tflops, out_max_abs, note}], "raw": bench rows}`` or
        ``{"problem": CodeProblem}``.
    """
    Case, Grid, Settings = need("bench.grid", "Case", "Grid", "Settings")
    availability, PROVIDERS = need("bench.providers", "availability", "PROVIDERS")
    import torch

    names = list(PROVIDERS)
    avail = availability(torch.device(limits().device), names)
    case = Case(_variant_file(code, shape), shape["B"], shape["Hq"], shape["Hkv"], shape["Q_LEN"],
                shape["KV_LEN"], shape["D"], shape["D"], shape["dtype"], "fwd")
    settings = Settings(block_size=shape["BLOCK_SIZE"], cpu_reps=3)
    grid = Grid("playground", [case], names, settings)
    try:
        data = run_grid(grid, "playground", progress)
    except Exception as e:  # noqa: BLE001
        return {"problem": as_problem(e, code, "while benchmarking")}
    return {"rows": summarize_rows(data["rows"], avail), "raw": data["rows"], "path": data["path"]}


def summarize_rows(rows: list[dict], avail: dict | None = None) -> list[dict]:
    """One row per provider: status, median ms, TFLOP/s, output error, note."""
    out: dict[str, dict] = {}
    for r in rows:
        p = r["provider"]
        if p == "baseline":
            continue
        entry = out.setdefault(p, {"provider": p, "status": "ok", "ms": None, "tflops": None,
                                   "out_max_abs": None, "note": ""})
        metric = r["metric"]
        if metric == "status" or r["status"] != "ok":
            entry["status"] = r["status"]
            entry["note"] = r.get("note") or entry["note"]
        elif metric == "time_ms":
            entry["ms"] = r["value"]
        elif metric == "tflops":
            entry["tflops"] = r["value"]
        elif metric == "out_max_abs":
            entry["out_max_abs"] = r["value"]
        if metric in ("time_ms",) and r.get("note") and not entry["note"]:
            entry["note"] = r["note"]
    if avail:
        for name, (ok, why) in avail.items():
            if not ok and name in out and not out[name]["note"]:
                out[name]["note"] = why
    return list(out.values())


def presets() -> dict[str, str]:
    """bench's preset names and what each measures."""
    preset_names = need("bench.grid", "preset_names")
    help_ = getattr(importlib.import_module("bench.grid"), "PRESET_HELP", {})
    return {n: help_.get(n, "") for n in preset_names()}


def preset_grid(name: str):
    load_config, build_grid = need("bench.grid", "load_config", "build_grid")
    return build_grid(load_config(name), name)


def run_preset(name: str, progress: Callable[[float, str], None] | None = None) -> dict:
    """Run a bench preset on this machine; returns its loaded results (``rows``, ``envs``, ``path``)."""
    return run_grid(preset_grid(name), f"preset-{name}", progress)


def load_uploaded(name: str, data: bytes) -> dict:
    """Load an uploaded results.json / results.csv with bench's loader (kept for reports)."""
    path = save_upload(name, data)
    try:
        loaded = load_results_path(path)
    except Unavailable:
        raise
    except Exception as e:  # noqa: BLE001 - a file that is not bench's results
        raise ValueError(f"{name} is not a bench results file: {e}") from None
    loaded["name"] = name
    return loaded


def short_variant(variant: str) -> str:
    """A variant spec for display: a mod file's stem instead of its full path."""
    from pathlib import Path

    if variant.endswith(".py") or "/" in variant:
        return Path(variant.split(":", 1)[0]).stem
    return variant


def timing_table(results: dict, label: str) -> list[dict]:
    """Long-form rows of time_ms / tflops per case and provider, tagged with ``label``."""
    out = []
    for r in results.get("rows", []):
        timed = r.get("metric") in ("time_ms", "tflops") and r.get("status") == "ok"
        if timed and r.get("value") is not None:
            variant = short_variant(str(r["variant"]))
            case = str(r["case_id"]).replace(str(r["variant"]), variant, 1)
            out.append({"file": label, "case": case, "variant": variant,
                        "provider": r["provider"], "metric": r["metric"], "value": r["value"],
                        "dtype": r["dtype"], "pass": r.get("pass", r.get("pass_"))})
    return out


def status_table(results: dict, label: str) -> list[dict]:
    """(provider, case) pairs that did not run or failed, with bench's reason."""
    out = []
    for r in results.get("rows", []):
        if r.get("metric") == "status" or r.get("status") not in ("ok", None):
            variant = short_variant(str(r["variant"]))
            out.append({"file": label, "provider": r["provider"], "status": r["status"],
                        "case": str(r["case_id"]).replace(str(r["variant"]), variant, 1),
                        "metric": r["metric"], "reason": r.get("note", "")})
    return out


def report_files(paths: list[str], labels: list[str] | None = None) -> dict[str, bytes]:
    """``{"html": ..., "md": ...}``: bench's report (``bench.report.write_report``) of result files."""
    import tempfile
    from pathlib import Path

    write_report = need("bench.report", "write_report")
    with tempfile.TemporaryDirectory() as tmp:
        written = write_report(list(paths), Path(tmp) / "report", force=True, labels=labels)
        files = {}
        for path in map(Path, written):
            if path.suffix in (".html", ".md"):
                files[path.suffix[1:]] = path.read_bytes()
    if not files:
        raise Unavailable("bench's report code wrote no HTML or markdown file.")
    return files


def _experiment_markdown(code: str, shape: dict, results: dict) -> str:
    lines = ["# flexlab Playground experiment", "",
             "Shape: " + ", ".join(f"{k}={v}" for k, v in shape.items()), "",
             "```python", code.rstrip(), "```", ""]
    for key, title in (("check", "Check against float64"), ("grad", "Gradients against float64"),
                       ("bench", "Benchmark")):
        rows = results.get(key)
        if not rows:
            continue
        cols = list(rows[0])
        lines += [f"## {title}", "", "| " + " | ".join(cols) + " |",
                  "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def _experiment_html(code: str, shape: dict, results: dict) -> str:
    import html

    parts = ["<h1>flexlab Playground experiment</h1>",
             "<p>Shape: " + html.escape(", ".join(f"{k}={v}" for k, v in shape.items())) + "</p>",
             f"<pre><code>{html.escape(code)}</code></pre>"]
    for key, title in (("check", "Check against float64"), ("grad", "Gradients against float64"),
                       ("bench", "Benchmark")):
        rows = results.get(key)
        if not rows:
            continue
        cols = list(rows[0])
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in cols)
                       + "</tr>" for r in rows)
        parts.append(f"<h2>{title}</h2><table border='1' cellspacing='0' cellpadding='4'>"
                     f"<tr>{head}</tr>{body}</table>")
    return "\n".join(parts)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ") if value is not None else ""


def export_json(code: str, shape: dict, results: dict) -> bytes:
    import json

    return json.dumps(experiment_record(code, shape, results), indent=1).encode()


def export(code: str, shape: dict, results: dict, bench_path: str | None = None) -> dict[str, bytes]:
    """The Playground experiment as markdown and HTML plus JSON.

    The experiment (code, shape, check and gradient tables) comes first; the benchmark part is
    bench's own report (``bench.report.write_report``) of the Playground's last benchmark run.
    """
    md = _experiment_markdown(code, shape, results)
    html_part = _experiment_html(code, shape, results)
    files = {"md": md.encode(), "html": ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
                                         "<title>flexlab Playground experiment</title></head><body>"
                                         + html_part + "</body></html>").encode()}
    if bench_path:
        report = report_files([bench_path], ["this machine"])
        if "md" in report:
            files["md"] = (md + "\n\n" + report["md"].decode()).encode()
        if "html" in report:
            page = report["html"].decode()
            files["html"] = page.replace("<body>", "<body>" + html_part + "<hr>", 1).encode()
    else:
        note = "\n\n_No benchmark in this experiment: run Benchmark to include bench's report._\n"
        files["md"] += note.encode()
        files["html"] = files["html"].replace(
            b"</body>", b"<p><i>No benchmark in this experiment: run Benchmark to include bench's "
                        b"report.</i></p></body>")
    files["json"] = export_json(code, shape, results)
    return files


# ---------------------------------------------------------------------------------------------
# Gallery (variants)
# ---------------------------------------------------------------------------------------------

def variant_catalog() -> list[dict]:
    """Every registered variant: name, title, kind, description and reference."""
    names, get = need("variants", "names", "get")
    out = []
    for n in names():
        v = get(n)
        out.append({"name": n, "title": v.title, "kind": v.kind, "description": v.description,
                    "reference": str(v.reference.title), "link": v.reference.link})
    return out


def variant(name: str):
    get = need("variants", "get")
    return get(name)


def gallery_shape(name: str, q_len: int, heads: int, params: dict) -> dict:
    """The shape a gallery preview uses (the variant's own KV_LEN for cross-attention)."""
    v = variant(name)
    kv_len = v.default_kv_len(q_len, **params)
    return {"B": 1, "H": heads, "Q_LEN": q_len, "KV_LEN": int(kv_len)}


@st.cache_resource(show_spinner=False, max_entries=32)
def variant_mods(name: str, params_key: tuple, q_len: int, heads: int):
    params = dict(params_key)
    shape = gallery_shape(name, q_len, heads, params)
    return variant(name).make(B=1, H=heads, Q_LEN=q_len, KV_LEN=shape["KV_LEN"],
                              device=limits().device, **params)


@st.cache_data(show_spinner=False, max_entries=64)
def gallery_view(name: str, params_key: tuple, q_len: int, heads: int, h: int, block_size: int) -> dict:
    """Mask heatmap data and block map of a variant at the given parameters, for head ``h``."""
    mods = variant_mods(name, params_key, q_len, heads)
    L, S = mods.shape.Q_LEN, mods.shape.KV_LEN
    pooled_mask = _mask_pooled(mods.mask_mod, 0, h, L, S)
    pooled, pool, kept = pooled_mask["frac"], pooled_mask["pool"], pooled_mask["kept"]
    bm = mods.create_block_mask(BLOCK_SIZE=block_size)
    block_map = bm.block_map()
    hh = min(h, block_map.shape[1] - 1)
    counts = bm.counts()
    return {"mask": {"pooled": pooled, "pool": pool, "kept": kept, "total": L * S,
                     "has_mask": mods.mask_mod is not None},
            "blocks": {"map": block_map[0, hh].cpu().numpy(), "full": counts.full,
                       "partial": counts.partial, "empty": counts.empty,
                       "sparsity": bm.sparsity(), "block_size": tuple(bm.BLOCK_SIZE)},
            "Q_LEN": L, "KV_LEN": S, "captured": sorted(mods.captured)}


def variant_source(name: str, params: dict, shape: dict) -> str:
    """The variant's standalone snippet at the Playground's shape (for "Open in Playground")."""
    return variant(name).source(B=shape["B"], H=shape["Hq"], Q_LEN=shape["Q_LEN"],
                                KV_LEN=shape["KV_LEN"], device=limits().device, **params)


def discovered_results() -> dict[str, str]:
    """Result folders under ``results/`` (bench's default output): label -> path."""
    from pathlib import Path

    root = results_dir()
    found = {}
    if root.is_dir():
        for path in sorted(root.rglob("results.json")):
            found[str(path.parent.relative_to(root))] = str(path.parent)
    return found


def load_results_path(path: str) -> dict:
    load_results = need("bench.runner", "load_results")
    data = load_results(path)
    data["path"] = path
    return data


def save_upload(name: str, data: bytes) -> str:
    """Keep an uploaded results file under ``results/workbench/uploads`` (for reports)."""
    import hashlib

    folder = results_root() / "uploads" / hashlib.sha256(data).hexdigest()[:10]
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".csv" if name.lower().endswith(".csv") else ".json"
    path = folder / f"results{suffix}"
    path.write_bytes(data)
    return str(path)
