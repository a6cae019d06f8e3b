"""Context-parallel benchmark: flexcore.distributed at 1 and N GPUs, and torch's context parallel.

Run through torchrun (every rank runs this module; rank 0 prints and writes the results):

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.cp --config cp --out results/cp
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.cp --config cp-tiny --out results/cp-tiny

The run is a list of measurements (:func:`plan`), each made by every rank in step:

- ``flexlab``: flexcore on one device over the whole sequence. Every rank measures it on its own
  device at the same time, with no collective (so no rank waits on another, and the GPUs are
  compared); the row pools every rank's repetitions. Measured at S / world (the weak-scaling
  reference, first) and at S (last).
- ``flexlab_cp_allgather``, ``flexlab_cp_ring``: flexcore.distributed over all ranks.
- ``torch_cp``: torch's experimental context parallel for flex (CUDA only).

After each measurement the ranks exchange their outcome on a gloo group bounded by ``--timeout-s``
(an error on one rank is recorded for all, and the ranks start the next measurement together);
rank 0 then rewrites ``results.csv`` and ``results.json`` and prints one line, so a run that is
stopped keeps what it measured. ``--max-minutes`` stops the run between measurements (rank 0
decides, every rank follows); what was not measured gets a ``skipped`` row. ``--timeout-s`` bounds
every collective (the process group's timeout), so a rank stuck in one fails instead of waiting.

Rows (bench's long format, :class:`bench.runner.Row`) per (variant, S, provider):

- ``time_ms`` (median forward+backward step, the slowest rank's), ``time_ms_p20``, ``time_ms_p80``;
- ``compile_s``: the first call (compilation, autotuning and one step), the slowest rank's;
- ``tflops``: per-GPU TFLOP/s, density-scaled forward+backward FLOPs (bench.flops) over the GPUs;
- ``world_size``: GPUs of the run (1 for the single-GPU ``flexlab`` rows);
- ``scaling_eff``: per-GPU TFLOP/s over one GPU's at the same tokens per GPU (S / world) where
  that was measured (weak scaling), else at the same S;
- ``speedup_vs_torch_cp``: per-GPU TFLOP/s over torch_cp's at the same S;
- ``comm_ms``: the strategy's collectives alone; ``compute_ms``: the rank's attention calls on
  local data; ``comm_hidden_ms`` = comm + compute - step time, clipped to [0, comm_ms];
- cp-tiny also checks the output against the float64 reference (``out_*`` metrics).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.flops import attention_flops
from bench.runner import COLUMNS, SCHEMA_VERSION, Row, write_csv

VARIANTS = ("causal", "document_causal", "sliding_window")
#: ``flexlab`` is flexcore on one device (the scaling reference); the others use every rank.
PROVIDERS = ("flexlab", "flexlab_cp_allgather", "flexlab_cp_ring", "torch_cp")
CP_PROVIDERS = PROVIDERS[1:]
#: Bound on every collective of a run, in seconds (--timeout-s).
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class CPConfig:
    seqs: tuple
    variants: tuple = VARIANTS
    providers: tuple = PROVIDERS
    batch: int = 1
    heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    block: int = 128
    window: int = 4096          #: sliding window, in tokens
    doc_len: int = 8192         #: mean document length of document_causal
    reps: int = 5
    warmup: int = 2
    device: str = "cuda"
    check: bool = False          #: compare the output with the float64 reference (tiny shapes)


CONFIGS = {
    "cp": CPConfig(seqs=(32768, 65536, 131072, 262144)),
    "cp-tiny": CPConfig(seqs=(128,), heads=2, head_dim=16, dtype="float32", block=32, window=24,
                        doc_len=32, reps=1, warmup=0, device="cpu", check=True),
}
CONFIG_HELP = {"cp": "S=32k..256k, causal / documents / sliding window, bf16 D=128 H=16, 1 and N GPUs",
               "cp-tiny": "2 gloo processes on the CPU at S=128: exercises the whole path"}


def mask_mod_of(variant: str, seq: int, cfg: CPConfig, device):
    if variant == "causal":
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        return causal
    if variant == "sliding_window":
        window = cfg.window

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        return sliding_window
    if variant == "document_causal":
        g = torch.Generator().manual_seed(1)
        n_docs = max(1, seq // cfg.doc_len)
        cuts = torch.randperm(seq - 1, generator=g)[: n_docs - 1].sort().values + 1
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([seq])]))
        doc = torch.repeat_interleave(torch.arange(n_docs), lengths).to(device)

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return document_causal
    raise ValueError(f"variant {variant!r}; expected one of {VARIANTS}")


# ---- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One measurement: ``provider`` on ``world`` devices at global length ``seq``."""

    variant: str
    seq: int
    provider: str
    world: int

    def label(self) -> str:
        return f"{self.variant} S={self.seq} {self.provider} world={self.world}"


def plan(cfg: CPConfig, world: int) -> list[Task]:
    """The measurements of a run, the same on every rank. Per (variant, S): one device at S / world
    first (the reference of the scaling efficiency), then the providers in ``cfg.providers``' order,
    then one device at S (the longest single-device run, the first to go out of memory)."""
    tasks: list[Task] = []
    single = "flexlab" in cfg.providers
    for variant in cfg.variants:
        for seq in cfg.seqs:
            lengths = (seq // world, seq) if single else ()
            todo = [Task(variant, s, "flexlab", 1) for s in lengths[:1]]
            todo += [Task(variant, seq, p, world) for p in cfg.providers if p != "flexlab"]
            todo += [Task(variant, s, "flexlab", 1) for s in lengths[1:]]
            for task in todo:
                # One device needs at least two blocks; a length is measured once per variant.
                if task.provider == "flexlab" and task.seq < 2 * cfg.block:
                    continue
                if task not in tasks:
                    tasks.append(task)
    return tasks


# ---- timing -------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group, device):
    if device.type == "cuda":  # NCCL: name the device instead of letting it guess
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def _time(fn, cfg: CPConfig, device, group=None) -> tuple[list[float], float | None]:
    """Milliseconds of each repetition of ``fn`` (the slowest rank's when ``group`` is given), and
    the seconds of the first warm-up call (compilation and autotuning included; None without one)."""
    first = None
    for i in range(cfg.warmup):
        if i == 0:
            _sync(device)
        t0 = time.perf_counter()
        fn()
        if i == 0:
            _sync(device)
            first = time.perf_counter() - t0
    times = []
    for _ in range(max(1, cfg.reps)):
        if group is not None:
            _barrier(group, device)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ms = (time.perf_counter() - t0) * 1e3
        if group is not None:
            slowest = torch.tensor(ms, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            ms = float(slowest)
        times.append(ms)
    return times, first


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    ordered = sorted(times)
    pick = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return statistics.median(ordered), pick(0.2), pick(0.8)


def _inputs(cfg: CPConfig, seq: int, device, seed: int = 0):
    """q, k, v and the output gradient over the whole sequence, drawn on ``device`` (a host draw of
    long sequences takes seconds); the same on every rank of one device type."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (cfg.batch, cfg.heads, seq, cfg.head_dim)
    return [torch.randn(shape, generator=g, device=device, dtype=getattr(torch, cfg.dtype))
            for _ in range(4)]


def _fwd_bwd(attend, q, k, v, dout):
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

    def step():
        out = attend(qq, kk, vv)
        out.backward(dout)
    return step


# ---- the measurements ---------------------------------------------------------------------------


class _Skip(Exception):
    """A provider that does not run here; its message is the row's note."""


def _single_gpu(cfg, variant, seq, device) -> dict:
    """flexcore on this rank's device over the whole sequence (no collective)."""
    from flexcore import create_block_mask, flex_attention

    from bench.flops import block_density

    bm = create_block_mask(mask_mod_of(variant, seq, cfg, device), None, None, seq, seq,
                           device=device, BLOCK_SIZE=cfg.block)
    q, k, v, dout = _inputs(cfg, seq, device)
    times, first = _time(_fwd_bwd(lambda a, b, c: flex_attention(a, b, c, block_mask=bm), q, k, v, dout),
                         cfg, device)
    return {"times": times, "compile_s": first, "density": block_density(bm)}


def _cp_case(cfg, variant, seq, strategy, device, world, rank, timeout_s) -> tuple[dict, object]:
    """Times, this rank's density, comm-alone and compute-alone times of one strategy; and the
    unsharded output when the config checks it."""
    from flexcore import distributed as cp

    mask = cp.create_block_mask_for_rank(mask_mod_of(variant, seq, cfg, device), None, None, seq,
                                         BLOCK_SIZE=cfg.block, device=device, timeout_s=timeout_s)
    q, k, v, dout = (cp.shard_sequence(t) for t in _inputs(cfg, seq, device))

    def attend(a, b, c):
        return cp.flex_attention(a, b, c, block_mask=mask, strategy=strategy, timeout_s=timeout_s)

    world_group = dist.group.WORLD
    times, first = _time(_fwd_bwd(attend, q, k, v, dout), cfg, device, world_group)
    comm, _ = _time(lambda: _comm_only(strategy, k, v, world, rank), cfg, device, world_group)
    compute, _ = _time(_compute_only(mask, q, k, v, dout), cfg, device, world_group)
    out = None
    if cfg.check:
        with torch.no_grad():
            out = cp.unshard_sequence(attend(q, k, v))
    return {"times": times, "compile_s": first, "density": mask.density(),
            "comm_ms": statistics.median(comm), "compute_ms": statistics.median(compute)}, out


def _comm_only(strategy, k, v, world, rank):
    """The strategy's collectives of one forward+backward, on tensors of the real sizes."""
    from flexcore.distributed import _all_gather, _reduce_scatter

    if strategy == "allgather":
        for t in (k, v):
            buf = t.new_empty((world * t.shape[0], *t.shape[1:]))
            _all_gather(buf, t.contiguous(), None, False)
            out = t.new_empty(t.shape)
            _reduce_scatter(out, buf, None, False)
        return
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for _ in range(2 * (world - 1)):  # W-1 hops of K/V forward, W-1 of dK/dV backward
        recv = [torch.empty_like(k), torch.empty_like(v)]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt) for t in (k, v)]
        ops += [dist.P2POp(dist.irecv, t, prv) for t in recv]
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _compute_only(mask, q, k, v, dout):
    """This rank's attention calls, each source's shard replaced by local data, merged by lse."""
    from flexcore import AuxRequest, flex_attention
    from flexcore.distributed import merge_by_lse

    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

    def step():
        parts = []
        for bm in mask.sources:
            if bm is not None:
                out, aux = flex_attention(qq, kk, vv, block_mask=bm, return_aux=AuxRequest(lse=True))
                parts.append((out, aux.lse))
        if not parts:
            return
        merged, _ = merge_by_lse(parts, q.dtype)
        merged.backward(dout)
    return step


_TORCH_CP: dict = {}  # the mesh and the compiled flex_attention, made once per run


def _torch_cp(cfg, variant, seq, device, world) -> dict:
    """Times of torch's context parallel for flex (all-gather of K/V, compiled flex_attention)."""
    if device.type != "cuda":
        raise _Skip("torch's context parallel for flex needs CUDA (flex_attention's backward does "
                    f"not run on {device.type}); not run here")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (_context_parallel_shard, _ContextParallel,
                                                                  _HeadTailLoadBalancer)
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    except ImportError:  # torch releases before the _context_parallel package
        from torch.distributed.tensor.experimental._attention import _create_cp_block_mask

    if not _TORCH_CP:
        _TORCH_CP["mesh"] = init_device_mesh(device.type, (world,))
        _TORCH_CP["flex"] = torch.compile(flex_attention, dynamic=False)
    mesh, compiled = _TORCH_CP["mesh"], _TORCH_CP["flex"]

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return compiled(q, k, v, block_mask=block_mask)

    attn = parallelize_module(Attention(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    balancer = _HeadTailLoadBalancer(seq, world, device)
    q, k, v, dout = _context_parallel_shard(mesh, _inputs(cfg, seq, device), [2, 2, 2, 2],
                                            load_balancer=balancer)
    # The rank's BlockMask, built by the call _context_parallel_shard makes for a BlockMask, but
    # without one over the whole sequence first (torch's eager create_block_mask holds S x S).
    bm = _create_cp_block_mask(mask_mod_of(variant, seq, cfg, device), 1, 1, seq, seq, mesh, balancer)
    times, first = _time(_fwd_bwd(lambda a, b, c: attn(a, b, c, block_mask=bm), q, k, v, dout), cfg, device,
                         dist.group.WORLD)
    return {"times": times, "compile_s": first}


def _execute(task: Task, cfg, device, world, rank, timeout_s):
    """Run one measurement on this rank: (status, note, payload, output to check)."""
    out = None
    try:
        if task.provider == "flexlab":
            payload = _single_gpu(cfg, task.variant, task.seq, device)
        elif task.provider == "torch_cp":
            payload = _torch_cp(cfg, task.variant, task.seq, device, world)
        else:
            strategy = task.provider.removeprefix("flexlab_cp_")
            payload, out = _cp_case(cfg, task.variant, task.seq, strategy, device, world, rank, timeout_s)
        return "ok", "", payload, out
    except _Skip as exc:
        return "skipped", str(exc), None, None
    except Exception as exc:  # noqa: BLE001 - recorded in the row; the other providers still run
        text = " ".join(str(exc).split())[:300]
        # torch's experimental API may be missing or refuse the case on this torch.
        status = "unsupported" if task.provider == "torch_cp" else "error"
        return status, f"{type(exc).__name__}: {text}", None, None
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


class RankMismatchError(RuntimeError):
    """The ranks did not all reach the end of a measurement within the timeout."""


def _exchange(side, entry, timeout_s: float, where: str) -> list:
    """Every rank's entry, on the gloo group ``side`` (host only, bounded by its timeout)."""
    entries: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(entries, entry, group=side)
    except RuntimeError as exc:
        raise RankMismatchError(
            f"{where}: the ranks did not all arrive within {timeout_s:g} s "
            f"({' '.join(str(exc).split())[:300]})") from None
    return entries


# ---- rows ---------------------------------------------------------------------------------------


class _Rows:
    def __init__(self, cfg: CPConfig, run_id: str):
        self.cfg, self.run_id, self.rows = cfg, run_id, []

    def add(self, variant, seq, world, provider, metric, value, unit, status="ok", note="", density=None):
        cfg = self.cfg
        self.rows.append(Row(self.run_id, f"cp|{variant}|S={seq}|gpus={world}", variant, cfg.batch,
                             cfg.heads, cfg.heads, seq, seq, cfg.head_dim, cfg.head_dim, cfg.dtype,
                             "fwd_bwd", density, provider, metric, value, unit, status, note).to_dict())

    def timing(self, variant, seq, world, provider, times, density, extra=(), note=""):
        med, p20, p80 = _quantiles(times)
        flops = attention_flops(self.cfg.batch, self.cfg.heads, seq, seq, self.cfg.head_dim,
                                self.cfg.head_dim, density, "fwd_bwd")
        tflops = flops / world / (med * 1e-3) / 1e12
        for metric, value, unit in (("time_ms", med, "ms"), ("time_ms_p20", p20, "ms"),
                                    ("time_ms_p80", p80, "ms"), ("reps", len(times), "count"),
                                    ("tflops", tflops, "TFLOP/s"), ("world_size", world, "count"),
                                    *extra):
            self.add(variant, seq, world, provider, metric, value, unit, density=density,
                     note=note if metric == "time_ms" else "")
        return tflops


class _Results:
    """Rank 0's record of a run: the rows, and the per-GPU TFLOP/s that derived rows compare."""

    def __init__(self, cfg: CPConfig, tasks: list[Task]):
        self.cfg, self.rows = cfg, _Rows(cfg, uuid.uuid4().hex[:12])
        self.pending = list(tasks)
        self.single: dict = {}      # (variant, S) -> per-GPU TFLOP/s of one device
        self.cp: dict = {}          # (variant, S, provider) -> (per-GPU TFLOP/s, density, world)
        self.torch: dict = {}       # (variant, S) -> per-GPU TFLOP/s of torch_cp
        self.density: dict = {}     # (variant, S) -> global block density
        self.derived: dict = {}     # (variant, S, provider, metric) -> value

    def record(self, task: Task, entries: list, out, device) -> str:
        """Add the rows of one measurement from every rank's (status, note, payload, stop); return
        the text of its progress line."""
        self.pending.remove(task)
        v, s, p, w = task.variant, task.seq, task.provider, task.world
        failed = [(r, e[0], e[1]) for r, e in enumerate(entries) if e[0] != "ok"]
        if failed:
            status = failed[0][1]
            notes = {n for _, _, n in failed}
            note = notes.pop() if len(notes) == 1 and len(failed) == len(entries) else \
                "; ".join(f"rank {r}: {n}" for r, _, n in failed)
            self.rows.add(v, s, w, p, "status", None, "", status, note)
            return f"{status}: {note}"
        payloads = [e[2] for e in entries]
        first = [x["compile_s"] for x in payloads if x.get("compile_s") is not None]
        extra = [("compile_s", max(first), "s")] if first else []
        tail = ""
        if p == "flexlab":  # every rank measured its own device: pool their repetitions
            times = [t for x in payloads for t in x["times"]]
            density = payloads[0]["density"]
            medians = ", ".join(f"{statistics.median(x['times']):.4g}" for x in payloads)
            note = f"median ms of each rank's device: {medians}" if len(payloads) > 1 else ""
            tflops = self.rows.timing(v, s, 1, p, times, density, extra, note=note)
            self.single[(v, s)] = tflops
            self.density[(v, s)] = density
            tail = f" ({note})" if note else ""
        elif p == "torch_cp":
            times = payloads[0]["times"]
            tflops = self.rows.timing(v, s, w, p, times, self._density(v, s, device), extra)
            self.torch[(v, s)] = tflops
        else:
            x = payloads[0]
            times = x["times"]
            density = sum(y["density"] for y in payloads) / len(payloads)
            self.density.setdefault((v, s), density)
            comm, compute = x["comm_ms"], x["compute_ms"]
            hidden = min(comm, max(0.0, comm + compute - statistics.median(times)))
            extra += [("comm_ms", comm, "ms"), ("compute_ms", compute, "ms"), ("comm_hidden_ms", hidden, "ms")]
            tflops = self.rows.timing(v, s, w, p, times, density, extra)
            self.cp[(v, s, p)] = (tflops, density, w)
            if out is not None:
                _check_rows(self.rows, self.cfg, v, s, w, p, out, density)
            tail = f", comm {comm:.4g} ms ({hidden:.4g} hidden)"
        self.derive()
        line = f"{statistics.median(times):.4g} ms, {tflops:.4g} TFLOP/s/GPU"
        if (v, s, p, "scaling_eff") in self.derived:
            line += f", scaling eff {self.derived[(v, s, p, 'scaling_eff')]:.3f}"
        if (v, s, p, "speedup_vs_torch_cp") in self.derived:
            line += f", {self.derived[(v, s, p, 'speedup_vs_torch_cp')]:.3g}x torch_cp"
        if p == "torch_cp":
            line += "".join(f", {q} is {val:.3g}x" for (vv, ss, q, m), val in self.derived.items()
                            if (vv, ss, m) == (v, s, "speedup_vs_torch_cp"))
        if first:
            line += f", first call {max(first):.3g} s"
        return line + tail

    def skip_rest(self, reason: str) -> None:
        for task in list(self.pending):
            self.rows.add(task.variant, task.seq, task.world, task.provider, "status", None, "",
                          "skipped", reason)
        self.pending.clear()

    def _density(self, variant, seq, device) -> float:
        if (variant, seq) not in self.density:
            from flexcore import create_block_mask

            from bench.flops import block_density

            bm = create_block_mask(mask_mod_of(variant, seq, self.cfg, device), None, None, seq, seq,
                                   device=device, BLOCK_SIZE=self.cfg.block)
            self.density[(variant, seq)] = block_density(bm)
        return self.density[(variant, seq)]

    def derive(self) -> None:
        """Scaling efficiency and the ratio to torch_cp of each CP row, once their references are
        measured. The reference is one device at S / world; one at S only when S / world will not
        come (not planned, failed, or the run stopped)."""
        waiting = {(t.variant, t.seq) for t in self.pending if t.provider == "flexlab"}
        for (v, s, p), (tflops, density, world) in self.cp.items():
            key = (v, s, p, "scaling_eff")
            weak = s // world
            ref = weak if (v, weak) in self.single else None
            if ref is None and (v, weak) not in waiting and (v, s) in self.single:
                ref = s
            if key not in self.derived and ref is not None:
                self.derived[key] = tflops / self.single[(v, ref)]
                self.rows.add(v, s, world, p, "scaling_eff", self.derived[key], "rel", density=density,
                              note="per-GPU TFLOP/s over one GPU's at "
                                   + ("S/world" if ref == weak else "the same S"))
            key = (v, s, p, "speedup_vs_torch_cp")
            if key not in self.derived and (v, s) in self.torch:
                self.derived[key] = tflops / self.torch[(v, s)]
                self.rows.add(v, s, world, p, "speedup_vs_torch_cp", self.derived[key], "rel",
                              density=density, note="per-GPU TFLOP/s over torch_cp's on the same run")


def run(cfg: CPConfig, name: str, out_dir: Path | None, *, max_minutes: float | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S, log=None) -> list[dict]:
    """Make every measurement of :func:`plan` on every rank of the default group, in step.

    Rank 0 rewrites ``out_dir``'s results after each measurement, prints one line per measurement
    through ``log`` (default: stdout, flushed) and returns the rows; other ranks return [].
    ``max_minutes``: no measurement starts after that long (decided on rank 0, followed by all).
    Raises RankMismatchError when the ranks do not all finish a measurement within ``timeout_s``.
    """
    log = log or (lambda text: print(text, flush=True))
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    # The ranks' outcomes travel on a host group, so that exchanging them neither syncs a GPU nor
    # waits unbounded. Twice the timeout: a rank whose measurement failed early waits there while
    # the others time out of the measurement's collectives, and all go on together.
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * timeout_s))
    tasks = plan(cfg, world)
    results = _Results(cfg, tasks) if rank == 0 else None
    writer = _Writer(out_dir, name, device) if rank == 0 and out_dir is not None else None
    start = time.monotonic()
    if rank == 0:
        where = f", writing {out_dir / 'results.csv'}" if out_dir is not None else ""
        log(f"bench.cp {name}: {len(tasks)} measurements on {world} ranks ({device.type}){where}")
    stopped = None
    for i, task in enumerate(tasks, 1):
        head = f"[{i}/{len(tasks)}] {task.label()}"
        if rank == 0:
            log(f"{head}: started at {time.monotonic() - start:.0f} s")
        status, note, payload, out = _execute(task, cfg, device, world, rank, timeout_s)
        if status not in ("ok", "skipped"):  # said at once: a rank left in a collective may hang
            print(f"bench.cp rank {rank}: {head}: {status}: {note}", file=sys.stderr, flush=True)
        elapsed = time.monotonic() - start
        stop = rank == 0 and max_minutes is not None and i < len(tasks) and elapsed >= max_minutes * 60
        entries = _exchange(side, (status, note, payload, stop), 2 * timeout_s, head)
        if rank == 0:
            line = results.record(task, entries, out, device)
            if writer is not None:
                writer.write(results.rows.rows, complete=False)
            log(f"{head}: {line}")
        if entries[0][3]:
            stopped = (f"not measured: --max-minutes {max_minutes:g} reached after {elapsed:.0f} s "
                       f"({i} of {len(tasks)} measurements)")
            break
    if rank != 0:
        return []
    if stopped:
        results.skip_rest(stopped)
        log(f"stopped: {stopped}")
    results.derive()
    if writer is not None:
        writer.write(results.rows.rows, complete=stopped is None)
    for line in scaling_markdown(results.rows.rows).splitlines():
        log(line)
    return results.rows.rows


class _Writer:
    """Rank 0's output folder: env.json once, results.csv and results.json after each measurement."""

    def __init__(self, out_dir: Path, name: str, device):
        from bench.env import capture

        self.out_dir, self.name = Path(out_dir), name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.env = capture(device)
        (self.out_dir / "env.json").write_text(json.dumps({"runs": [self.env]}, indent=1))

    def write(self, rows: list[dict], complete: bool) -> None:
        _write_results(self.out_dir, self.name, rows, self.env, complete)


def _write_results(out_dir: Path, name: str, rows: list[dict], env: dict, complete: bool) -> None:
    from bench.runner import _atomic_write

    payload = {"schema": SCHEMA_VERSION, "name": name, "columns": COLUMNS, "complete": complete,
               "envs": [env], "config": {"name": name}, "rows": rows}
    _atomic_write(out_dir / "results.json", json.dumps(payload, indent=1))
    write_csv(out_dir / "results.csv", rows)


def write(out_dir: Path, name: str, rows: list[dict], device) -> list[Path]:
    """Write a finished run's env.json, results.json and results.csv into ``out_dir``."""
    from bench.env import capture

    out_dir.mkdir(parents=True, exist_ok=True)
    env = capture(device)
    (out_dir / "env.json").write_text(json.dumps({"runs": [env]}, indent=1))
    _write_results(out_dir, name, rows, env, True)
    return [out_dir / "results.csv", out_dir / "results.json", out_dir / "env.json"]


def _check_rows(rows, cfg, variant, seq, world, provider, out, density):
    from flexcore import create_block_mask
    from flexcore.reference import flex_attention_reference
    from flexcore.testing import tolerance_check

    q, k, v, _ = _inputs(cfg, seq, out.device)
    bm = create_block_mask(mask_mod_of(variant, seq, cfg, out.device), None, None, seq, seq,
                           device=out.device, BLOCK_SIZE=cfg.block)
    golden = flex_attention_reference(q, k, v, block_mask=bm, upcast=True)
    same = flex_attention_reference(q, k, v, block_mask=bm, upcast=False)
    result = tolerance_check(out, golden, same)
    status = "ok" if result.passed else "fail"
    for metric, value, unit in (("out_max_abs", result.errors["max_abs"], "abs"),
                                ("out_rel_fro", result.errors["rel_fro"], "rel"),
                                ("out_tolerance", result.threshold, "abs"),
                                ("out_correct", float(result.passed), "bool")):
        rows.add(variant, seq, world, provider, metric, value, unit, status=status, density=density,
                 note="2 * baseline max_abs + eps(dtype)" if metric == "out_tolerance" else "")


# ---- what the app plots -------------------------------------------------------------------------


def is_cp_results(rows: list[dict]) -> bool:
    """Whether a results file holds this benchmark's rows."""
    return any(r.get("metric") == "world_size" for r in rows)


def scaling_table(rows: list[dict]) -> list[dict]:
    """One entry per (variant, S, provider, GPUs): per-GPU TFLOP/s, scaling efficiency, times."""
    table: dict = {}
    for r in rows:
        if r.get("status") != "ok" or r.get("value") is None or not str(r.get("case_id", "")).startswith("cp|"):
            continue
        gpus = int(str(r["case_id"]).rsplit("gpus=", 1)[1])
        key = (r["variant"], int(r["q_len"]), r["provider"], gpus)
        entry = table.setdefault(key, {"variant": r["variant"], "seq": int(r["q_len"]),
                                       "provider": r["provider"], "gpus": gpus})
        if r["metric"] in ("tflops", "scaling_eff", "time_ms", "comm_ms", "comm_hidden_ms",
                           "compute_ms", "speedup_vs_torch_cp"):
            entry[r["metric"]] = float(r["value"])
    return sorted(table.values(), key=lambda e: (e["variant"], e["seq"], e["provider"], e["gpus"]))


def scaling_markdown(rows: list[dict]) -> str:
    """The scaling table of a run as markdown (rank 0 prints it at the end, and ``python -m bench
    summary`` of a results folder): per mask, length, provider and GPU count, the median step,
    per-GPU TFLOP/s, the efficiency against one GPU at S/W, the speedup over torch's context
    parallel, and the communication the step hid; then the measurements that gave no time, with
    their reasons."""
    def cell(x, spec: str, suffix: str = "") -> str:
        return "" if x is None else format(x, spec) + suffix

    lines = ["| mask | S | provider | GPUs | ms | TFLOP/s per GPU | efficiency | ÷ torch CP | "
             "compute alone (ms) | comm hidden (ms of ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in scaling_table(rows):
        comm = e.get("comm_ms")
        hidden = "" if comm is None else f"{e.get('comm_hidden_ms', 0.0):.1f} of {comm:.1f}"
        lines.append(f"| {e['variant']} | {e['seq']} | {e['provider']} | {e['gpus']} | "
                     f"{cell(e.get('time_ms'), '.4g')} | {cell(e.get('tflops'), '.0f')} | "
                     f"{cell(e.get('scaling_eff'), '.2f')} | "
                     f"{cell(e.get('speedup_vs_torch_cp'), '.2f', '×')} | "
                     f"{cell(e.get('compute_ms'), '.4g')} | {hidden} |")
    missing = [r for r in rows if r.get("metric") == "status"]
    if missing:
        lines += ["", "Not measured:", ""]
        lines += [f"- {r['variant']} S={r['q_len']} {r['provider']}: {r['status']}, {r['note']}" for r in missing]
    return "\n".join(lines)


# ---- the command line ---------------------------------------------------------------------------


def _names(text: str, allowed: tuple, option: str, parser) -> tuple:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        parser.error(f"{option}: unknown {unknown or text!r}; expected a comma-separated list from "
                     f"{', '.join(allowed)}")
    return tuple(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cp", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="cp-tiny", choices=sorted(CONFIGS),
                        help="; ".join(f"{k}: {v}" for k, v in CONFIG_HELP.items()))
    parser.add_argument("--out", help="output folder (default results/<config>)")
    parser.add_argument("--seq", help="comma-separated global sequence lengths (overrides the config's)")
    parser.add_argument("--variants", help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--providers",
                        help=f"comma-separated, run in this order, from {', '.join(PROVIDERS)} "
                             "(flexlab: one device, the scaling reference; default all)")
    parser.add_argument("--reps", type=int, help="timed repetitions of each measurement")
    parser.add_argument("--warmup", type=int, help="untimed calls first (the first one compiles)")
    parser.add_argument("--max-minutes", type=float,
                        help="start no measurement after this many minutes; the rest are recorded as "
                             "skipped (default: no limit)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds after which a collective that not every rank joined fails "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    cfg = CONFIGS[args.config]
    changes = {}
    if args.seq:
        try:
            changes["seqs"] = tuple(int(s) for s in args.seq.split(","))
        except ValueError:
            parser.error(f"--seq {args.seq!r}: expected comma-separated integers")
    if args.variants:
        changes["variants"] = _names(args.variants, VARIANTS, "--variants", parser)
    if args.providers:
        changes["providers"] = _names(args.providers, PROVIDERS, "--providers", parser)
    for key in ("reps", "warmup"):
        if getattr(args, key) is not None:
            if getattr(args, key) < (1 if key == "reps" else 0):
                parser.error(f"--{key} {getattr(args, key)}: expected at least {1 if key == 'reps' else 0}")
            changes[key] = getattr(args, key)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s {args.timeout_s:g}: expected a positive number of seconds")
    if changes:
        cfg = dataclasses.replace(cfg, **changes)
    if "RANK" not in os.environ:
        parser.error("run it through torchrun: python -m torch.distributed.run --standalone "
                     "--nproc-per-node N -m bench.cp ...")
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--config {args.config} needs CUDA GPUs; cp-tiny runs on the CPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo",
                            timeout=timedelta(seconds=args.timeout_s))
    out_dir = Path(args.out or Path("results") / args.config)
    try:
        rows = run(cfg, args.config, out_dir, max_minutes=args.max_minutes, timeout_s=args.timeout_s)
    except RankMismatchError as exc:
        print(f"bench.cp: rank {dist.get_rank()}: {exc}", file=sys.stderr, flush=True)
        # A rank stuck in a collective would block the group's teardown: leave without it.
        os._exit(1)
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(out_dir / "results.csv", flush=True)
        failed = [r for r in rows if r["status"] == "fail"]
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
