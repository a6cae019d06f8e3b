"""How long a new mod takes to its first result: tracing, code generation and compilation.

``python -m bench first-call`` measures, for each variant and provider, the time from a mod the
process has never seen to its first synchronised forward output, with cold caches:

- every provider runs in its own fresh Python process, with empty Triton and TorchInductor cache
  directories, so nothing compiled earlier (in this run or another) is reused;
- the process first runs an unrelated warm-up mod, so that imports, the CUDA context and compile
  workers (torch.compile's) are up, as they are in a working session; that warm-up is reported
  as the ``process`` row;
- per variant: ``mask_s`` builds the BlockMask (flexlab lowers and compiles the mask_mod;
  torch's ``create_block_mask`` runs eagerly), ``first_s`` is the first forward call
  (flexlab: trace, lower, generate, compile and autotune the forward kernel; torch flex:
  dynamo, Inductor and Triton compilation), and ``second_ms`` the next call, for scale.

Providers are the benchmark's own (``bench.providers``), called as in ``python -m bench run``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

#: A mod no variant uses, run first in each process.
_WARMUP_VARIANT = "relative_bias(max_distance=64)+chunked"


@dataclass(frozen=True)
class Shape:
    batch: int = 4
    heads: int = 16
    seq: int = 4096
    head_dim: int = 128
    dtype: str = "bfloat16"


class FirstCallError(RuntimeError):
    """A worker process failed; the message holds the end of its output."""


def _measure_variant(provider, variant: str, shape: Shape, device) -> dict:
    import torch

    from bench.context import make_context
    from bench.grid import Case, Settings
    from bench.timing import synchronize

    case = Case(variant, shape.batch, shape.heads, shape.heads, shape.seq, shape.seq, shape.head_dim,
                shape.head_dim, shape.dtype, "fwd")
    ctx = make_context(case, Settings(), device, n_sets=1)
    ctx.mask_dims()  # the bench's broadcast check of the mask, not part of either provider's work
    x = ctx.inputs[0]
    synchronize(device)
    start = time.perf_counter()
    prepared = provider.prepare(ctx)
    synchronize(device)
    mask_s = time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        prepared.call(x.q, x.k, x.v)
        synchronize(device)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        prepared.call(x.q, x.k, x.v)
        synchronize(device)
        second_ms = (time.perf_counter() - start) * 1e3
    return {"variant": variant, "mask_s": mask_s, "first_s": first_s, "total_s": mask_s + first_s,
            "second_ms": second_ms}


def worker(provider_name: str, variants: list[str], shape: Shape, device_name: str) -> dict:
    """Measure in this process (meant to be a fresh one, see :func:`measure`)."""
    start = time.perf_counter()
    import torch

    from bench import providers

    device = torch.device(device_name)
    provider = providers.get(provider_name)
    ok, why = provider.available(device)
    if not ok:
        return {"provider": provider_name, "skipped": why, "rows": []}
    warm = _measure_variant(provider, _WARMUP_VARIANT, shape, device)
    elapsed = time.perf_counter() - start
    process = {"variant": "process", "mask_s": None, "first_s": elapsed, "total_s": elapsed,
               "second_ms": warm["second_ms"]}
    rows = [process] + [_measure_variant(provider, v, shape, device) for v in variants]
    return {"provider": provider_name, "skipped": None, "rows": rows}


def measure(providers: list[str], variants: list[str], shape: Shape, device: str,
            timeout_s: float = 900) -> list[dict]:
    """One fresh process per provider, each with empty compile caches; rows of all of them.

    Raises VariantError for a spec that does not resolve (checked here, before any process starts)
    and FirstCallError when a worker fails.
    """
    from bench.mods import resolve

    for spec in variants:
        resolve(spec, B=shape.batch, H=shape.heads, KV_HEADS=shape.heads, Q_LEN=shape.seq,
                KV_LEN=shape.seq, D=shape.head_dim, device="cpu")
    rows = []
    for name in providers:
        with tempfile.TemporaryDirectory(prefix="flexlab-first-call-") as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp) / "triton"),
                       TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                       TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
            result_path = Path(tmp) / "result.json"
            spec = json.dumps({"provider": name, "variants": variants, "shape": asdict(shape),
                               "device": device, "out": str(result_path)})
            proc = subprocess.run([sys.executable, "-m", "bench.first_call", spec], env=env,
                                  cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                                  text=True, timeout=timeout_s)
            if proc.returncode != 0 or not result_path.exists():
                tail = (proc.stdout + proc.stderr)[-3000:]
                raise FirstCallError(f"the {name} worker exited with {proc.returncode}:\n{tail}")
            result = json.loads(result_path.read_text())
        if result["skipped"]:
            rows.append({"provider": name, "variant": "-", "status": "skipped", "note": result["skipped"]})
            continue
        for row in result["rows"]:
            rows.append({"provider": name, "status": "ok", **row})
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table of the rows, one line per variant, providers side by side."""
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["status"] == "ok"))
    by = {(r["provider"], r["variant"]): r for r in rows}

    def cell(r, key, fmt):
        return "—" if r is None or r.get(key) is None else format(r[key], fmt)

    head = ["variant"] + [f"{p} {what}" for p in providers
                          for what in ("mask s", "first call s", "total s", "2nd call ms")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        cells = [v]
        for p in providers:
            r = by.get((p, v))
            cells += [cell(r, "mask_s", ".2f"), cell(r, "first_s", ".2f"), cell(r, "total_s", ".2f"),
                      cell(r, "second_ms", ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"\n{r['provider']}: skipped ({r['note']})")
    return "\n".join(lines)


def write(rows: list[dict], out: Path, *, force: bool, meta: dict) -> list[Path]:
    """results.json and summary.md in ``out``, written atomically; existing files need ``force``."""
    from bench.runner import _atomic_write

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "summary.md"]
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists; pass --force to replace it")
    _atomic_write(paths[0], json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    _atomic_write(paths[1], f"# First result of a new mod ({meta.get('gpu', '')})\n\n"
                  f"Shape: {meta['shape']}. Command: `{meta['command']}`.\n\n{table(rows)}\n")
    return paths


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = worker(spec["provider"], spec["variants"], Shape(**spec["shape"]), spec["device"])
    Path(spec["out"]).write_text(json.dumps(result))
