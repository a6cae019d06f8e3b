"""Hand-scheduled kernels for Hopper GPUs, written in Gluon (triton's explicit-layout dialect).

The forward (the template `forward_hopper.py.tmpl`) serves the identity score_mod, in bf16 or fp16,
on an sm_90 GPU, at head dim 64 or 128: with its DENSE constexpr set, a mask whose blocks are all
full (no mask, ``noop_mask``; DENSE_TILES); filled with the lowered mask_mod, any other mask over
128x128 blocks whose rows average the policy's gluon.masked_min_mean_blocks key blocks or more, in
calls of at least gluon.masked_min_flops (MASKED_TILES).
It runs FlashAttention-3's schedule, which triton 3.6 does not produce from ``tl`` code
(docs/decisions.md#gluon-scope and docs/decisions.md#dense-warp-specialization and docs/decisions.md#gluon-dense-forward and docs/decisions.md#gluon-masked-forward and docs/decisions.md#gluon-three-warpgroups):

- one loader warp brings K and V tiles (128 keys) by TMA into three slots each, with a "ready"
  and an "empty" mbarrier per slot;
- two compute warpgroups, each a partition of its own, own 64 of the program's 128 query rows (at
  head dim 64: three, 192 rows, FlashAttention-3's tile there);
  each issues S(j) = Q K(j)^T and O += P(j-1) V(j-1) back to back, asynchronously, waits for
  S(j) only, and runs the softmax of S(j) while P(j-1) V(j-1) is still on the tensor cores;
- a slot is released when both warpgroups have arrived on its "empty" barrier (count 2).

Under a mask, a program walks the blocks the mask lists for its 128-row block, partial ones first
(the mask_mod applied) and then full ones. A 192-row program of three warpgroups spans two mask
blocks: it walks the union of their lists (:func:`union_tables`), and each warpgroup computes the
run of it that its own block lists (docs/decisions.md#gluon-union-lists). Everything else (score_mods, other
head dims and dtypes, other GPUs, the interpreter, masks with short rows, mask_mods whose Gluon
source does not build) takes the Triton template (flexcore.kernels.forward), and so does a call
whose layout the descriptors cannot express.

The outputs are the template's: out, lse (natural log) and row_stats (the row max in log2 units of
the scaled scores, and 1/l), so either backward reads them. With sinks (one logit per query head,
flexcore.sinks) the epilogue adds each to its rows' denominator, as the template's does.

Both forwards also take float8 e4m3 q, k, v at head dim 128 (FP8_HEAD_DIMS) with their descales
(flexcore.fp8), where the policy forces them (flexcore.kernels.policy.fp8_policy: the template
measured as fast): both products on the FP8 tensor cores, V read key-major through a descriptor
over its transpose (:func:`_v_view`), P rounded to e4m3, a bfloat16 output
(docs/decisions.md#fp8-forward).

The backward (the template `backward_hopper.py.tmpl`, after the Triton preprocessing kernel of
flexcore.kernels.backward) serves the same calls, with masks whose rows, and their transpose's,
average gluon.backward_min_mean_blocks blocks or more, in calls of at least gluon.masked_min_flops:
a dK/dV kernel (128 keys per program, 64-query tiles of Q and dO streamed) and a dQ kernel (128
queries per program, 64-key tiles of K and V streamed), each with one loader warp and two compute
warpgroups (flexcore/README.md, docs/decisions.md#gluon-backward).
"""
from __future__ import annotations

import ast
import collections
import functools
import re
import types
import warnings
from typing import NamedTuple

import torch

from flexcore._runtime import capturing, use_interpreter
from flexcore.blockmask import block_map_of
from flexcore.errors import InputError, KernelFallbackWarning
from flexcore.fp8 import FP8_DTYPE, OUTPUT_DTYPE

# Which kernel serves a call is decided by the policy's ``gluon`` family (flexcore.kernels.policy):
# - masked_min_flops: under a mask, calls smaller than this take the template, forward and
#   backward: there the Gluon kernels' calls took longer than the template's
#   (docs/decisions.md#gluon-masked-size).
# - masked_min_mean_blocks: each program of the masked kernel sets up barriers, partitions and
#   registers, which rows of a few blocks feel; below it the template serves the mask
#   (docs/decisions.md#gluon-masked-forward).
# - union_yields: at head dim 64 the masked kernel yields to the template over finer tables where
#   those are taken (docs/decisions.md#gluon-union-lists).
# - union_max_exclusive: where the two mask blocks of a 192-row program list different key blocks,
#   the warpgroups of one wait while the others compute the blocks only theirs lists (the loader
#   walks one list), so masks with many such tiles keep the template.
# - union_min_mean_blocks: masked_min_mean_blocks of the three-warpgroup kernel, whose 192-row
#   programs of half-size tiles feel their setup more on short rows.
HEAD_DIMS = frozenset({128})  # the backward
FP8_HEAD_DIMS = frozenset({128})  # the FP8 forwards (two warpgroups; 148 KB of shared memory)
BLOCK_M = 128  # query rows per program of the masked forward: two warpgroups of 64
BLOCK_N = 128  # keys per tile
NUM_STAGES = 3  # K and V slots: 3 x 2 x 32 KB + Q 32 KB at head dim 128
WG_REGS = 240  # registers per thread of the second compute warpgroup; the loader gets 24
MAX_REGS = 168  # the kernel's launch limit: 12 warps x 32 x 168 fit the register file


class GluonTiles(NamedTuple):
    """A Gluon forward's shape: compute warpgroups of 64 query rows each (a program covers
    num_wg * 64 rows), K/V slots, the worker warpgroups' registers and the launch limit (the default
    warpgroup gets what the others leave)."""
    num_wg: int
    stages: int
    wg_regs: int
    max_regs: int


# Per head dim, dense and masked alike: at 128 two warpgroups (one 128-row mask block per program);
# at 64 FlashAttention-3's 192-row tile, three compute warpgroups (16 warps x 32 x 128 at launch; the
# compute warpgroups then run at 168, 160 and 160 registers, the loader's at 24; docs/decisions.md#gluon-three-warpgroups and docs/decisions.md#gluon-union-lists), whose programs span two mask blocks under a mask (union_tables).
DENSE_TILES = types.MappingProxyType({128: GluonTiles(2, NUM_STAGES, WG_REGS, MAX_REGS),
                                      64: GluonTiles(3, 4, 160, 128)})
MASKED_TILES = DENSE_TILES
# FP8 (head dim 128): K and V tiles take half the shared memory of 16-bit ones (148 KB at 3 slots).
FP8_TILES = types.MappingProxyType({128: GluonTiles(2, NUM_STAGES, WG_REGS, MAX_REGS)})
# Two warpgroups only, in its launch and in the masked tables it reads: FP8 over union lists
# (three) gave wrong results (docs/decisions.md#fp8-forward).
assert all(FP8_TILES[d].num_wg == 2 and MASKED_TILES[d].num_wg == 2 for d in FP8_HEAD_DIMS)
_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def _gluon_host():
    """The host side of the Gluon kernels (TMA descriptors), imported on first use (None where this
    triton has no Hopper Gluon)."""
    try:
        from flexcore.kernels import gluon_host
    except (ImportError, AttributeError):
        return None
    return gluon_host


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def gluon_unavailable() -> str | None:
    """Why the Gluon kernels cannot run on this machine's current GPU, or None where they can."""
    if use_interpreter() or not torch.cuda.is_available():
        return "no CUDA GPU (Triton interpreter)" if use_interpreter() else "no CUDA GPU"
    index = torch.cuda.current_device()
    if not _device_ok(index):
        major, minor = torch.cuda.get_device_capability(index)
        return f"GPU {index} is sm_{major}{minor}"
    if _gluon_host() is None:
        import triton

        return f"triton {triton.__version__} has no Gluon Hopper API"
    return None


def _refuse(kernel: str, setting: str) -> InputError:
    return InputError(f"the Gluon {kernel} kernel was required (kernel_options backend='gluon' or "
                      f"policy.gluon.{setting}='on') but cannot serve this call: it takes the identity "
                      f"score_mod in bf16/fp16 at head dim {sorted(DENSE_TILES)} (float8_e4m3fn at "
                      f"{sorted(FP8_HEAD_DIMS)}) with lengths that are multiples of {BLOCK_M}, on an sm_90 "
                      f"GPU; use backend='auto' to fall back to the Triton kernels (flexcore.explain shows why)")


def _rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows spanned, batch stride, head stride), in rows, where ``t`` (B, H, N, D) can be read as
    one (rows, D) matrix of row stride t.stride(2): unit last stride, batch and head strides
    multiples of the row stride, 16-byte aligned, row indices within int32. None otherwise."""
    B, H, N, D = t.shape
    sb, sh, sr, sd = t.stride()
    sb, sh = (0 if B == 1 else sb), (0 if H == 1 else sh)  # a dimension of size 1 is never stepped
    if sd != 1 or sr < D or t.data_ptr() % 16 or (sr * t.element_size()) % 16:
        return None
    if sb % sr or sh % sr:
        return None
    rb, rh = sb // sr, sh // sr
    rows = (B - 1) * rb + (H - 1) * rh + N
    if rows >= 2**31 or (B > 1 and rb < 0) or (H > 1 and rh < 0):
        return None
    return rows, rb, rh


def _v_view(v: torch.Tensor) -> torch.Tensor:
    """The view of V that the kernels' descriptor reads: V itself, or for FP8 (key-major V) its
    transpose (B, H, D, S), whose rows are V's columns."""
    return v.transpose(2, 3) if v.dtype == FP8_DTYPE else v


def _common(q, k, v, score_lowered, scale: float, opts, head_dims=HEAD_DIMS) -> bool:
    """What both kernels need: see the module's docstring."""
    B, Hq, L, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    ok = (
        D in head_dims and Dv == D
        and (q.dtype in (torch.bfloat16, torch.float16) or (q.dtype == FP8_DTYPE and D in FP8_HEAD_DIMS))
        and k.dtype == q.dtype and v.dtype == q.dtype
        and score_lowered.is_trivial and not score_lowered.captured and scale > 0
        and L % BLOCK_M == 0 and S % BLOCK_N == 0 and L > 0 and S > 0
        and not opts.pins_tiles and _device_ok(q.device.index or 0)
        and all(_rows(t) is not None for t in (q, k, _v_view(v))) and _gluon_host() is not None
    )
    return ok


def _output_contiguous(q: torch.Tensor) -> bool:
    """Whether the output in q's stride order (flexcore.kernels.forward.empty_output) is contiguous,
    as the forwards' descriptor over its rows needs. Other orders take the template."""
    if q.is_contiguous():
        return True
    from flexcore.kernels.forward import output_strides

    expected = 1
    for size, stride in zip(reversed(q.shape), reversed(output_strides(tuple(q.shape), q.stride()))):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def applies(q, k, v, score_lowered, dense: bool, scale: float, opts) -> bool:
    """Whether the dense kernel serves the call (see the module's docstring and the policy's
    gluon.dense)."""
    rule = opts.dispatch.gluon.dense
    if rule == "off" or not dense or use_interpreter() or not q.is_cuda:
        return False
    ok = _common(q, k, v, score_lowered, scale, opts, DENSE_TILES) and _output_contiguous(q)
    if not ok and rule == "on":
        raise _refuse("dense", "dense")
    return ok


def _tables_ok(blocks) -> bool:
    """Tables over 128x128 blocks whose index rows the kernels can step through (unit stride)."""
    return (tuple(blocks.sparse_block) == (BLOCK_M, BLOCK_N) and blocks.indices.stride(-1) == 1
            and (blocks.full_indices is None or blocks.full_indices.stride(-1) == 1))


def applies_masked(q, k, v, score_lowered, blocks, dense: bool, scale: float, opts) -> bool:
    """Whether the masked kernel may serve the call: a mask that is not dense, over 128x128
    blocks, with the identity score_mod (the mask_mod may capture tensors); see the policy's
    gluon.masked."""
    policy = opts.dispatch.gluon
    rule = policy.masked
    if rule == "off" or dense or use_interpreter() or not q.is_cuda:
        return False
    ok = (_tables_ok(blocks) and _common(q, k, v, score_lowered, scale, opts, MASKED_TILES)
          and _output_contiguous(q))
    if ok and rule != "on":
        least = (policy.union_min_mean_blocks if MASKED_TILES[q.shape[3]].num_wg == 3
                 else policy.masked_min_mean_blocks)
        ok = large_enough(q, k, v, policy) and blocks.visits_on_average(q.shape[2] // BLOCK_M, least)
    if not ok and rule == "on":
        raise _refuse("masked", "masked")
    return ok


# Gluon kernels (by key) that the Triton template serves instead, with the reason: a first launch
# or a module that failed, or a mask_mod they cannot take. And how many calls each turned away.
_unsupported: dict = {}
_declined: collections.Counter = collections.Counter()
_compiled: set = set()


def fallbacks() -> dict:
    """The Gluon kernels (by key) that do not serve calls in this process, each with its reason: a
    first launch or a module build that failed (each gave one KernelFallbackWarning), or a
    mask_mod whose helpers have no Gluon form (no warning). A failed backward launch is listed
    under its kernel's key and under its module's."""
    return dict(_unsupported)


def fallback_counts() -> dict:
    """How many calls each key of :func:`fallbacks` has turned to the template so far on the
    dispatch path (the failing one included; calls replayed from a kept plan are not counted): a
    caller compares two snapshots to learn which reasons applied between them."""
    return dict(_declined)


def kept_reason(key) -> str | None:
    """The reason kept for ``key`` (:func:`dense_key`, :func:`masked_forward_key`,
    :func:`module_key`), or None."""
    return _unsupported.get(key)


def dense_key(dtype: torch.dtype, head_dim: int, sinks: bool = False) -> tuple:
    return ("dense", dtype, head_dim) + (("sinks",) if sinks else ())


def dense_reason(dtype: torch.dtype, head_dim: int, sinks: bool = False) -> str | None:
    """The reason kept for the dense forward's launch, or for its module, or None."""
    return kept_reason(dense_key(dtype, head_dim, sinks)) or kept_reason(
        module_key("forward_hopper.py.tmpl", _noop_lowered()))


def masked_forward_key(mask_lowered, dtype: torch.dtype, head_dim: int, sinks: bool = False) -> tuple:
    return ("forward_hopper.py.tmpl", mask_lowered.source, dtype, head_dim, sinks)


def backward_key(mask_lowered, dense: bool, dtype: torch.dtype, row_sums: int) -> tuple:
    """The backward kernels' key (each launch adds its kernel's name); it starts with the
    backward module's :func:`module_key`, under which a failed launch is kept too."""
    return module_key("backward_hopper.py.tmpl", mask_lowered) + (dense, dtype, row_sums)


def module_key(template: str, mask_lowered) -> tuple:
    """The key of a Gluon template's module for a mask_mod; a failed backward launch is kept here
    too, so that the mask's later backwards skip the module."""
    return (template, mask_lowered.source)


def _keep(key, reason: str) -> None:
    """Keep ``key`` in :func:`fallbacks` with its reason, counting the call it turned away."""
    _unsupported[key] = reason
    _declined[key] += 1


def _turned_away(key) -> bool:
    """Whether ``key`` is kept in :func:`fallbacks` (then the call is counted)."""
    if key not in _unsupported:
        return False
    _declined[key] += 1
    return True


def _reason(error: BaseException) -> str:
    """One line: the innermost cause's message. triton's CompilationError wraps the error of a
    called function in one whose text is a source location and lines, its message last."""
    while error.__cause__ is not None:
        error = error.__cause__
    compile_error = hasattr(error, "error_message")
    lines = [line.strip() for line in str((error.error_message if compile_error else None) or error).splitlines()
             if line.strip()]
    line = (lines[-1] if compile_error else lines[0]) if lines else ""
    return f"{type(error).__name__}: {line[:300]}"


_ACCELERATOR_ERRORS = tuple(filter(None, [getattr(torch, "AcceleratorError", None)]))


def _not_a_build_failure(error: BaseException) -> bool:
    # Out of memory, or a device error (torch's, or the one triton's launcher raises): the template
    # would fail alike, and taking it for every later call would hide the error.
    if isinstance(error, (torch.cuda.OutOfMemoryError, *_ACCELERATOR_ERRORS)):
        return True
    text = str(error)
    return "Triton Error [CUDA]" in text or "CUDA error" in text


def _fall_back(key, what: str, error: BaseException) -> None:
    """Say once that ``key`` failed (which kernel, the error, what serves the call instead), then
    remember it: where the warning is turned into an error, the key is not remembered and the
    next call raises too."""
    reason = _reason(error)
    warnings.warn(f"flexcore: the Gluon {what} failed to build or launch ({reason}); the Triton template "
                  f"serves this call and the calls like it in this process (same results, the "
                  f"template's speed)", KernelFallbackWarning, stacklevel=3)
    _keep(key, reason)


def _launch_once(key, launch, what: str = "kernel") -> bool:
    """Run ``launch``; on the first launch of ``key`` a failure (a Gluon compile error: an
    experimental API that another triton may change, a mod Gluon does not take) is warned about
    (KernelFallbackWarning), remembered and reported as False, so that the caller and later calls
    take the template. Out-of-memory and device errors are raised, not remembered."""
    if key in _compiled:
        launch()
        return True
    try:
        launch()
    except Exception as error:  # noqa: BLE001
        if _not_a_build_failure(error):
            raise
        _fall_back(key, what, error)
        return False
    _compiled.add(key)
    return True


def _gluon_source(src: str) -> str:
    """A lowered mod's Triton source as Gluon: the decorator and the language module's name."""
    return re.sub(r"\btl\.", "gl.", src.replace("@triton.jit", "@gluon.jit"))


_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def _module_names(body) -> set:
    """Names that statements at a module's level bind (imports, assignments; inside if and try
    blocks too), not those bound inside functions or classes."""
    names = set()
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", ())),
                          getattr(node, "finalbody", [])):
                names |= _module_names(block)
    return names


@functools.lru_cache(maxsize=1)
def _gluon_helpers() -> tuple[dict, frozenset]:
    """The Triton helpers of flexcore.lowering.triton_helpers (floor division, remainder, ...) that
    generated mods call: ({name: (Gluon form, the helpers it reads)} of those with a Gluon form,
    every helper's name). A helper defined at the module's level has one unless it reads a module
    name other than ``tl`` and ``triton`` (libdevice, the interpreter switch, a constant) or uses
    inline PTX; those defined inside an if block (the interpreter's and the GPU's variants) have
    none. Read from the helpers' source, which is not imported here."""
    from pathlib import Path

    import flexcore.lowering

    text = (Path(flexcore.lowering.__file__).parent / "triton_helpers.py").read_text()
    tree = ast.parse(text)
    helpers = frozenset(node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))
    foreign = _module_names(tree.body) - {"tl", "triton"}
    forms = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        reads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if reads & foreign or any(isinstance(n, ast.Attribute) and n.attr == "inline_asm_elementwise"
                                  for n in ast.walk(node)):
            continue
        forms[node.name] = ("@gluon.jit\n" + _gluon_source(ast.get_source_segment(text, node)),
                            frozenset(reads & helpers - {node.name}))
    return forms, helpers


@functools.lru_cache(maxsize=256)
def _helpers_for(source: str) -> tuple[str, str | None]:
    """(the Gluon forms of the helpers ``source`` reads, directly or through each other, None), or
    ("", a helper it reads that has none)."""
    forms, helpers = _gluon_helpers()
    todo, done = [name for name in _NAME.findall(source) if name in helpers], {}
    while todo:
        name = todo.pop()
        if name in done:
            continue
        if name not in forms:
            return "", name
        done[name], reads = forms[name]
        todo.extend(reads)
    return "\n\n\n".join(done[name] for name in sorted(done)), None


def _mask_module(template: str, mask_lowered):
    """The module of a Gluon template filled with this mask_mod, or None where it does not build."""
    from flexcore.kernels import codegen
    key = module_key(template, mask_lowered)
    if _turned_away(key):
        return None
    helpers, missing = _helpers_for(mask_lowered.source)
    if missing is not None:  # a known limit, not a failure: no warning
        _keep(key, f"the mask_mod calls {missing} (a Triton helper of the lowering), which has no Gluon "
                   f"form (libdevice, inline PTX, or an interpreter or GPU variant)")
        return None

    def build():
        # The helpers' Gluon forms follow the header's import of their Triton forms, and replace them.
        values = {"MOD_FUNCTIONS": "\n\n\n".join(filter(None, [helpers, _gluon_source(mask_lowered.source)])),
                  "MASK_CAPS": codegen.cap_list(mask_lowered.cap_params)}
        return codegen.HEADER + codegen.fill_template(codegen.read_template(template), values)

    try:
        return codegen.cached_module(key, build, template.split(".")[0])
    except Exception as error:  # the mod's source does not import as Gluon: the template serves it
        _fall_back(key, f"kernel module {template.split('.')[0]} (for this mod)", error)
        return None


def masked_module(mask_lowered):
    """The forward's module for this mask_mod, or None where it does not build."""
    return _mask_module("forward_hopper.py.tmpl", mask_lowered)


@functools.lru_cache(maxsize=None)
def _noop_lowered():
    from flexcore.lowering import lower_mask_mod
    from flexcore.masks import noop_mask
    return lower_mask_mod(noop_mask)


def dense_module():
    """The forward's module for dense masks (DENSE: no mask_mod runs; noop_mask fills the template)."""
    return masked_module(_noop_lowered())


def tables(blocks) -> tuple:
    """The BlockMask tables and strides the masked kernels read (a plan keeps them)."""
    full_n, full_i = blocks.full_tables()
    return ((blocks.num_blocks, blocks.indices, full_n, full_i,
             *blocks.num_blocks.stride(), *blocks.indices.stride()[:3],
             *full_n.stride(), *full_i.stride()[:3]), blocks.full_num_blocks is not None)


def masked_tables(blocks, q_len: int, kv_len: int, head_dim: int, opts) -> tuple | None:
    """(table arguments, has full blocks) of the masked forward at ``head_dim``: the mask's tables
    for two-warpgroup programs, :func:`union_tables` for three. None (the template then serves the
    call) where more than the policy's gluon.union_max_exclusive of the union's tiles are one
    block's own (unless gluon.masked is "on"), or inside a CUDA graph capture before the lists are
    known."""
    tiles = MASKED_TILES[head_dim]
    if tiles.num_wg == 2:
        return tables(blocks)
    policy = opts.dispatch.gluon
    found = union_tables(blocks, q_len, kv_len, tiles.num_wg * BLOCK_M // 2)
    if found is None or (found[2] > policy.union_max_exclusive and policy.masked != "on"):
        return None
    counts, entries, _ = found
    return (counts, entries, counts, entries, *counts.stride()[:3], *entries.stride()[:3],
            *counts.stride()[:3], *entries.stride()[:3]), False


def _base(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, ...) without its broadcast batch and head dimensions (stride 0: size 1)."""
    if t.shape[0] > 1 and t.stride(0) == 0:
        t = t[:1]
    if t.shape[1] > 1 and t.stride(1) == 0:
        t = t[:, :1]
    return t


def union_tables(blocks, q_len: int, kv_len: int, rows: int) -> tuple | None:
    """The lists that ``rows``-row programs (192: three warpgroups of 64) walk over the mask of
    ``blocks`` (128x128 blocks), as (counts, entries, exclusive), the tables expanded to the
    tables' (B, H):

    - program p spans mask blocks A = 192p // 128 and B = A + 1 (a warpgroup's 64 rows lie in one
      of them); its list holds the key blocks that only A lists, then those both list, then those
      only B lists, each run in ascending order;
    - counts (B, H, programs, 3) int32: (B's first tile, A's end, the list's length), so A's
      warpgroups compute tiles [0, A's end) and B's [B's first tile, length);
    - entries (B, H, programs, key blocks) int32: 4 * block + 1 where A lists it partial + 2 where
      B lists it partial (the mask_mod runs on those tiles for that block's rows);
    - exclusive: the fraction of the lists' tiles that only one of the two blocks lists, where both
      have rows (the other block's warpgroups wait meanwhile).

    Computed on the GPU with one read-back, once per mask and shape (kept with the tables'
    schedules); None inside a CUDA graph capture until computed outside one."""
    key = ("gluon_union", *blocks.num_blocks.shape[:2], q_len, kv_len, rows)
    found = blocks._orders.get(key)
    if found is not None:
        return found
    if capturing():
        return None
    B, H = blocks.num_blocks.shape[:2]
    sparse_q, sparse_kv = blocks.sparse_block
    n_rows = -(-q_len // sparse_q)
    n_cols = -(-kv_len // sparse_kv)
    tables = [blocks.num_blocks, blocks.indices, blocks.full_num_blocks, blocks.full_indices]
    tables = [None if t is None else _base(t)[:, :, :n_rows] for t in tables]
    base = [max(t.shape[d] for t in tables if t is not None) for d in (0, 1)]
    tables = [None if t is None else t.expand(*base, *t.shape[2:]) for t in tables]
    # code[b, h, row, col]: 0 not listed, 1 partial, 2 full (BlockMask.block_map's), and a row of
    # zeros past the last
    code = torch.nn.functional.pad(block_map_of(*tables)[..., :n_cols], (0, 0, 0, 1))
    device = code.device
    programs = -(-q_len // rows)
    row_a = torch.arange(programs, device=device) * rows // sparse_q
    a, b = code[:, :, row_a], code[:, :, row_a + 1]  # (B', H', programs, n_cols)
    in_a, in_b = a > 0, b > 0
    run = torch.where(in_a & in_b, 1, torch.where(in_a, 0, torch.where(in_b, 2, 3)))
    cols = torch.arange(n_cols, device=device)
    order = torch.argsort(run * n_cols + cols, dim=-1)  # the columns in list order
    entries = order * 4 + (a == 1).gather(-1, order) + 2 * (b == 1).gather(-1, order)
    only_a, both, only_b = ((run == r).sum(-1) for r in range(3))
    counts = torch.stack([only_a, only_a + both, only_a + both + only_b], dim=-1)
    # A program whose block B lies past the end has no warpgroup there to wait: not counted.
    waits = (only_a + only_b) * (row_a + 1 < n_rows)
    exclusive, total = torch.stack([waits.sum(), counts[..., 2].sum()]).tolist()
    found = (counts.to(torch.int32).expand(B, H, programs, 3),
             entries.to(torch.int32).expand(B, H, programs, n_cols), exclusive / max(total, 1))
    blocks._orders[key] = found
    return found


def _prepare(q, k, v):
    """The outputs, and the arguments both kernels take before their own: the four descriptors,
    lse, row_stats, and the batch and head strides in rows."""
    from flexcore.kernels.forward import empty_output

    mod = _gluon_host()
    B, Hq, L, D = q.shape
    fp8 = q.dtype == FP8_DTYPE
    # contiguous (applies, applies_masked), with the strides torch gives
    out = empty_output(q, D, OUTPUT_DTYPE if fp8 else None)
    lse = torch.empty((B, Hq, L), dtype=torch.float32, device=q.device)
    row_stats = torch.empty((2, B, Hq, L), dtype=torch.float32, device=q.device)
    v_view = _v_view(v)
    (q_rows, q_rb, q_rh), (k_rows, k_rb, k_rh), (v_rows, v_rb, v_rh) = _rows(q), _rows(k), _rows(v_view)
    half = BLOCK_M // 2
    # FP8's V^T tiles: all D rows of a head by BLOCK_N keys
    v_desc = (mod.descriptor(v_view, v_rows, D, BLOCK_N) if fp8 else mod.descriptor(v, v_rows, BLOCK_N))
    descs = (mod.descriptor(q, q_rows, half), mod.descriptor(k, k_rows, BLOCK_N),
             v_desc, mod.descriptor(out, B * Hq * L, half), lse, row_stats)
    return (out, lse, row_stats), descs, (q_rb, q_rh, k_rb, k_rh, v_rb, v_rh)


def _sizes(q, k, scale: float) -> tuple:
    B, Hq, L, _ = q.shape
    return (Hq, Hq // k.shape[1], L, k.shape[2], B * Hq * L, scale * _LOG2E)


def forward_masked(q, k, v, module, table_args: tuple, has_full: bool, scale: float, caps: tuple, key,
                   sinks=None, descales=None, policy=None):
    """As :func:`forward`, over the tables of :func:`masked_tables`. None where the kernel fails to
    compile for this mask (the first launch of ``key``; the caller then takes the template)."""
    if _turned_away(key):
        return None
    return _forward(q, k, v, module, table_args, False, has_full, scale, caps, key, sinks, descales, policy)


def forward(q, k, v, scale: float, sinks=None, descales=None, policy=None):
    """out (B, Hq, L, D), lse (B, Hq, L) and row_stats (2, B, Hq, L), as the template's forward;
    None where the kernel failed to build (see _launch_once; the caller takes the template).
    ``sinks``: (Hq,) logits of unit stride that join each row's denominator, or None
    (flexcore.kernels.forward.forward). ``descales``: flexcore.fp8.Descales of float8 q, k and
    key-major v (the output is then bfloat16), or None. ``policy``: the LaunchPolicy of the
    launches (flexcore.kernels.launch.run; None: the defaults)."""
    module = dense_module()
    if module is None:
        return None
    key = dense_key(q.dtype, q.shape[3], sinks is not None)
    if _turned_away(key):
        return None
    # DENSE reads no tables: any pointer and stride will do.
    return _forward(q, k, v, module, (q,) * 4 + (0,) * 12, True, False, scale, (), key, sinks, descales, policy)


def _forward(q, k, v, module, table_args: tuple, dense: bool, has_full: bool, scale: float, caps: tuple, key,
             sinks=None, descales=None, policy=None):
    from flexcore.kernels.launch import run
    from flexcore.kernels.policy import LaunchPolicy

    if descales is not None:  # the kernel's P operand holds each 32-key group in its own order
        from flexcore.kernels.layout import key_major_copy

        v = key_major_copy(v, v.shape[2], operand_order=True)
    result, descs, strides = _prepare(q, k, v)
    B, Hq, L, D = q.shape
    tiles = (FP8_TILES if descales is not None else DENSE_TILES if dense else MASKED_TILES)[D]
    rows = tiles.num_wg * (BLOCK_M // 2)
    union = not dense and tiles.num_wg == 3  # programs over two mask blocks: union_tables
    # lse stands in for the pointers a call does not read (sinks without HAS_SINKS, descales
    # without FP8).
    stand_in = descs[4]
    scales = (stand_in,) * 3 if descales is None else descales[:3]
    args = (*descs, stand_in if sinks is None else sinks, *scales, *table_args, *strides, *_sizes(q, k, scale),
            *((0,) * 7 if descales is None else descales.layout), *caps)
    constexprs = dict(DENSE=dense, HAS_FULL_BLOCKS=has_full, HAS_SINKS=sinks is not None,
                      FP8=descales is not None, BLOCK_M=BLOCK_M // 2, BLOCK_N=BLOCK_N, HEAD_DIM=D,
                      NUM_STAGES=tiles.stages, WG_REGS=tiles.wg_regs, NUM_WG=tiles.num_wg, UNION=union,
                      num_warps=4, maxnreg=tiles.max_regs)
    launch = functools.partial(run, module.flex_hopper_fwd, (-(-L // rows), B * Hq), args, constexprs,
                               LaunchPolicy() if policy is None else policy)
    return result if _launch_once(key, launch, f"{'dense' if dense else 'masked'} forward") else None


# ---------------------------------------------------------------------------------------------
# The backward (templates/backward_hopper.py.tmpl): a dK/dV kernel and a dQ kernel, each with one
# loader warp and two compute warpgroups of 64 rows, after the Triton preprocessing kernel of
# flexcore.kernels.backward (delta and lse2).

# The policy's gluon.backward decides; below gluon.backward_min_mean_blocks key (query) blocks per
# row of the mask (of its transpose) the Triton template serves a masked backward: rows of a few
# blocks run no faster under the Gluon kernels and pay more host time for their descriptors
# (docs/decisions.md#gluon-backward); so do masked calls under gluon.masked_min_flops
# (docs/decisions.md#gluon-masked-size).
BWD_TILE = 64  # rows per compute warpgroup, and rows per streamed tile (queries for dK/dV, keys for dQ)
BWD_DKDV_STAGES = 2  # Q and dO slots: 2 x 2 x 16 KB beside K and V's 64 KB
BWD_DQ_STAGES = 3  # K and V slots: 3 x 2 x 16 KB beside Q and dO's 64 KB


def backward_may_apply(q, opts) -> bool:
    """The cheap part of applies_backward: the policy allows it, a CUDA tensor, no interpreter
    (callers check it before reading the mask's statistics for ``dense``)."""
    return opts.dispatch.gluon.backward != "off" and q.is_cuda and not use_interpreter()


def applies_backward(q, k, v, grad_out, score_lowered, kv_blocks, q_blocks, dense: bool, scale: float,
                     opts) -> bool:
    """Whether the Gluon backward serves the call: what the forwards need (the identity score_mod, so
    no captured tensor wants a gradient), dO readable as (rows, D), and for a mask that is not dense
    both its tables over 128x128 blocks, rows long enough and a call of at least
    gluon.masked_min_flops (unless gluon.backward is "on")."""
    if not backward_may_apply(q, opts):
        return False
    policy = opts.dispatch.gluon
    ok = (grad_out.dtype == q.dtype and grad_out.shape == q.shape and _rows(grad_out) is not None
          and (dense or (_tables_ok(kv_blocks) and _tables_ok(q_blocks)))
          and _common(q, k, v, score_lowered, scale, opts))
    if ok and not dense and policy.backward != "on":
        ok = (large_enough(q, k, v, policy)
              and long_rows(kv_blocks, q_blocks, q.shape[2], k.shape[2], policy.backward_min_mean_blocks))
    if not ok and policy.backward == "on":
        raise _refuse("backward", "backward")
    return ok


def large_enough(q, k, v, policy) -> bool:
    """Whether a masked call is at least the Gluon policy's ``masked_min_flops`` (dense-equivalent
    FLOPs of the forward, flexcore.kernels.forward.dense_flops)."""
    from flexcore.kernels.forward import dense_flops

    return dense_flops(q, k, v) >= policy.masked_min_flops


def long_rows(kv_blocks, q_blocks, q_len: int, kv_len: int, blocks: float) -> bool:
    """Whether the mask's rows and its transpose's rows (dQ's and dK/dV's programs) visit ``blocks``
    blocks or more on average (BlockTensors.visits_on_average)."""
    return (kv_blocks.visits_on_average(q_len // BLOCK_M, blocks)
            and q_blocks.visits_on_average(kv_len // BLOCK_N, blocks))


def backward_module(mask_lowered):
    """The backward kernels' module for this mask_mod, or None where it does not build."""
    return _mask_module("backward_hopper.py.tmpl", mask_lowered)


class BackwardLaunches:
    """What the backward kernels of one call read besides the call's tensors: the module, the mask's
    tables and their strides, dense or not, the scale. A per-call plan keeps it with the two direct
    launches that ran (flexcore.kernels.backward)."""

    __slots__ = ("module", "q_tables", "kv_tables", "dense", "scale", "row_sums")

    def __init__(self, module, kv_blocks, q_blocks, dense: bool, scale: float, row_sums: int = 0):
        self.module, self.dense, self.scale, self.row_sums = module, dense, scale, row_sums
        self.q_tables, self.kv_tables = tables(q_blocks), tables(kv_blocks)

    def prepare(self, q, k, v, grad_out, lse2, delta, caps: tuple):
        """(dq, dk, dv) to fill, and the two launches as (kernel, grid, arguments, constexprs)."""
        mod = _gluon_host()
        B, Hq, L, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        rows = [_rows(t) for t in (q, k, v, grad_out)]
        ins = [mod.descriptor(t, r[0], BWD_TILE) for t, r in zip((q, k, v, grad_out), rows)]
        strides = [s for r in rows for s in r[1:]]
        sizes = (L, S, self.scale, self.scale * _LOG2E, *caps)
        (q_args, q_full), (kv_args, kv_full) = self.q_tables, self.kv_tables
        common = dict(DENSE=self.dense, BLOCK_M=BWD_TILE, BLOCK_N=BWD_TILE, HEAD_DIM=D, WG_REGS=WG_REGS,
                      num_warps=4, maxnreg=MAX_REGS)
        dkdv = (self.module.flex_hopper_bwd_dkdv, (S // BLOCK_N, B * Hkv),
                (*ins, mod.descriptor(dk, B * Hkv * S, BWD_TILE), mod.descriptor(dv, B * Hkv * S, BWD_TILE),
                 lse2, delta, *q_args, *strides, Hq, Hkv, *sizes),
                dict(GQA_GROUP=Hq // Hkv, HAS_FULL_BLOCKS=q_full, SPARSE_Q_BLOCK=BLOCK_M,
                     NUM_STAGES=BWD_DKDV_STAGES, **common))
        dq_launch = (self.module.flex_hopper_bwd_dq, (L // BLOCK_M, B * Hq),
                     (*ins, mod.descriptor(dq, B * Hq * L, BWD_TILE), lse2, delta, *kv_args, *strides, Hq,
                      Hq // Hkv, *sizes),
                     dict(HAS_FULL_BLOCKS=kv_full, SPARSE_KV_BLOCK=BLOCK_N, NUM_STAGES=BWD_DQ_STAGES,
                          **({"ROW_SUMS": self.row_sums} if self.row_sums else {}), **common))
        return (dq, dk, dv), (dkdv, dq_launch)

    def replay(self, entries, q, k, v, grad_out, lse2, delta, caps: tuple):
        """(dq, dk, dv) through the direct launches ``entries`` ((entry, grid) pairs) of an earlier call."""
        grads, launches = self.prepare(q, k, v, grad_out, lse2, delta, caps)
        for (entry, grid), (_, _, args, _) in zip(entries, launches):
            entry.launch(grid, args)
        return grads


def backward(q, k, v, grad_out, lse2, delta, launches: BackwardLaunches, caps: tuple, key, policy=None):
    """(dq, dk, dv) in the layouts of q, k, v made contiguous, from lse2 and delta (B, Hq, L) of the
    preprocessing kernel; None where a kernel fails to compile (see _launch_once). The launches go
    through flexcore.kernels.launch.run (direct launches, recorded for plans) under ``policy`` (a
    LaunchPolicy; None: the defaults)."""
    from flexcore.kernels.launch import run
    from flexcore.kernels.policy import LaunchPolicy

    policy = LaunchPolicy() if policy is None else policy
    grads, kernels = launches.prepare(q, k, v, grad_out, lse2, delta, caps)
    for name, (kernel, grid, args, kwargs) in zip(("dkdv", "dq"), kernels):
        if not _launch_once(key + (name,), functools.partial(run, kernel, grid, args, kwargs, policy),
                            f"backward {name} kernel"):
            _unsupported[key[:2]] = _unsupported[key + (name,)]  # the module's key (backward_key)
            return None
    return grads
