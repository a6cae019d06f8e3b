"""flex_attention: torch.nn.attention.flex_attention's API on flexlab's own Triton kernels.

An eager call keeps what depends only on its inputs' shapes, dtypes and devices, the BlockMask's
state and the options (checks, options, the tables' views) in a small cache of prepared calls, and
runs the kernels through an autograd Function. Under ``torch.compile`` the same call becomes the
custom ops of :mod:`flexcore.ops`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
import warnings
import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from flexcore import ops
from flexcore._runtime import capturing, prepare_triton, use_interpreter
from flexcore._types import ScoreMod
from flexcore._validate import check_block_mask, check_qkv
from flexcore.errors import InputError, ModError
from flexcore.fp8 import FP8_DTYPE, check_fp8_inputs, fp8_options, key_major
from flexcore.interop import coerce_block_mask
from flexcore.options import KernelOptions
from flexcore.sinks import apply_sinks, check_finite_sinks, check_sinks, sink_gradient

__all__ = ["flex_attention", "AuxRequest", "AuxOutput"]

try:  # torch's own classes where torch has them (2.9 and later): isinstance checks then agree
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:  # pragma: no cover - older torch
    class AuxRequest(NamedTuple):
        """Which auxiliary outputs flex_attention computes (torch's ``AuxRequest``)."""

        lse: bool = False
        max_scores: bool = False

    class AuxOutput(NamedTuple):
        """flex_attention's auxiliary outputs, None unless requested (torch's ``AuxOutput``)."""

        lse: Tensor | None = None
        max_scores: Tensor | None = None


# The kernel modules, imported by ready() (they import triton, which must come after
# prepare_triton) and kept here, so that a call reaches them without an import statement.
_forward = _decode = _backward = _lowering = _vjp = None


def ready() -> None:
    """Choose the interpreter before any kernel module is imported (flexcore._runtime) and import
    the kernel modules; once per process (later imports of triton decorate for the interpreter by
    themselves)."""
    global _forward, _decode, _backward, _lowering, _vjp
    if _vjp is None:
        prepare_triton()
        import flexcore.kernels.backward as _backward
        import flexcore.kernels.decode as _decode
        import flexcore.kernels.forward as _forward
        import flexcore.lowering as _lowering
        import flexcore.lowering.vjp as _vjp


def check_call(query, key, value, score_mod, block_mask, scale, enable_gqa,
               rows_may_be_empty: bool = False) -> None:
    """Raise InputError naming the argument when the inputs cannot be attended by the kernels
    (the checks that read shapes, dtypes and devices only, which torch.compile traces too)."""
    if not isinstance(enable_gqa, bool):  # "no" would read as True
        raise InputError(f"enable_gqa must be True or False, got {enable_gqa!r}")
    check_qkv(query, key, value, enable_gqa, rows_may_be_empty=rows_may_be_empty)
    refuse_torch_func(query, key, value)
    D, Dv = query.shape[-1], value.shape[-1]
    if max(D, Dv) > 256:
        raise InputError(f"head dims up to 256 are supported; got D={D}, Dv={Dv}")
    if scale is not None:
        check_scale(scale)
    if score_mod is not None and not callable(score_mod):
        raise InputError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, "
                         f"got {type(score_mod).__name__}")
    if block_mask is not None:
        check_block_mask(block_mask, query.shape[0], query.shape[1], query.shape[2], key.shape[2],
                         query.device)


def refuse_torch_func(query, key, value) -> None:
    """InputError naming the argument that is a torch.func transform's tensor: its wrapper hides
    the storage the kernels read (vmap) or the gradient they track (grad, jacrev), which would
    fail deep inside the lowering. Not under torch.compile (Dynamo cannot trace the test; the
    tensors it traces are its own fakes)."""
    if torch.compiler.is_compiling():
        return
    for name, t in (("query", query), ("key", key), ("value", value)):
        if isinstance(t, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise InputError(f"{name} is a tensor of a torch.func transform (grad, vmap, jacrev, ...): "
                             f"flexcore's kernels run outside torch.func; differentiate with "
                             f"torch.autograd (loss.backward(), torch.autograd.grad) and batch along B")


def check_scale(scale) -> None:
    """InputError unless ``scale`` is a finite real number (a Python or NumPy float or int, not a
    bool): NaN or infinity would make every output NaN."""
    if isinstance(scale, (torch.SymFloat, torch.SymInt)):
        return  # symbolic under torch.compile: its value is not known here
    if isinstance(scale, (bool, torch.Tensor)) or not isinstance(scale, numbers.Real):
        hint = " (pass a Python float, e.g. scale.item())" if isinstance(scale, torch.Tensor) else ""
        raise InputError(f"scale must be a finite real number (a float) or None, got "
                         f"{type(scale).__name__}{hint}")
    # Under torch.compile the value may be symbolic: flexcore's ops check it (check_scale_value).
    if not torch.compiler.is_compiling():
        check_scale_value(float(scale))


def check_scale_value(scale: float) -> None:
    """InputError unless the (Python float) scale is finite; a symbolic one passes (a traced op
    body sees it so, and its run checks the value)."""
    if isinstance(scale, (torch.SymFloat, torch.SymInt)):
        return
    if not math.isfinite(scale):
        raise InputError(f"scale must be a finite real number (a float) or None, got {scale}")


def validate_inputs(query, key, value, block_mask, scale, enable_gqa) -> None:
    """Raise InputError naming the argument when the inputs cannot be attended by the kernels."""
    check_call(query, key, value, None, block_mask, scale, enable_gqa)
    if query.device.type != "cuda" and not use_interpreter():
        raise InputError(f"flexcore's kernels run on CUDA tensors on this machine; query is on "
                         f"{query.device}. Move the inputs with .cuda(), or use flexcore.reference")


@functools.lru_cache(maxsize=64)
def full_block_mask(L: int, S: int, device: torch.device):
    """The all-full BlockMask of an (L, S) problem, broadcast over batch and heads."""
    from flexcore.blockmask import create_block_mask
    from flexcore.masks import noop_mask

    return create_block_mask(noop_mask, None, None, L, S, device=device)


# BlockTensors views of the last few masks, by (id(mask), B, Hq, kind); see _mask_views.
_views_cache: collections.OrderedDict = collections.OrderedDict()
# Per BlockMask, the forward's launch orders (BlockTensors.schedule): they live as long as the mask,
# as its own tables do, so that a captured CUDA graph that reads one never outlives it.
_schedules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mask_views(block_mask, B, Hq, kind, build, stamp=None):
    """``build()`` remembered for the last few masks (a training or decoding loop calls with the
    same mask at every step): entries hold the mask weakly and leave with it, so the cache never
    keeps tables alive. ``stamp``: a value that must be unchanged for an entry to be reused."""
    key = (id(block_mask), B, Hq, kind)
    stamp = (block_mask.version, stamp)  # an assigned attribute (mask_mod, tables) drops the entry
    hit = _views_cache.get(key)
    if hit is not None and hit[0]() is block_mask and hit[1] == stamp:
        return hit[2]
    try:
        ref = weakref.ref(block_mask)
    except TypeError:  # not weak-referenceable: do not remember it
        return build()
    views = build()
    if hit is None:
        weakref.finalize(block_mask, _views_cache.pop, key, None)
    _views_cache[key] = (ref, stamp, views)
    _views_cache.move_to_end(key)
    while len(_views_cache) > 32:
        _views_cache.popitem(last=False)
    return views


def kv_blocks(block_mask, B, Hq):
    """The BlockMask's key-block tables viewed as (B, Hq, ...) (the views share its storage)."""
    from flexcore.kernels.tables import BlockTensors

    def build():
        try:
            entry = _schedules.get(block_mask)
            if entry is None or entry[0] != block_mask.version:
                entry = _schedules[block_mask] = (block_mask.version, {})
            orders = entry[1]
        except TypeError:  # not weak-referenceable: its orders live with these views
            orders = None
        try:
            refine = functools.partial(_refine_kv, weakref.ref(block_mask), B, Hq)
        except TypeError:  # not weak-referenceable: no finer tables (they would keep it alive)
            refine = None
        return BlockTensors.expanded(block_mask.kv_num_blocks, block_mask.kv_indices,
                                     block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                     block_mask.BLOCK_SIZE, B, Hq, orders, refine)

    return _mask_views(block_mask, B, Hq, "kv", build)


def _refine_kv(mask_ref, B, Hq, mask_lowered, compute: bool):
    """``BlockTensors.refine`` of a mask's key-block tables (flexcore.kernels.forward.finer_tables):
    the tables over REFINE_BLOCK-sized blocks and their transpose, expanded to (B, Hq, ...), and
    their cost relative to the mask's own; None where the mask has none (see flexcore.blockmask.refine_block_map). Kept with
    the mask while the lowered mask_mod and its captured tensors are unchanged (tables.refine_key); with
    ``compute`` False only a kept answer is given (inside a CUDA graph capture)."""
    block_mask = mask_ref()
    if block_mask is None:
        return None
    from flexcore.kernels.tables import reads_batch_head, refine_key

    stamp = refine_key(mask_lowered)
    hit = _views_cache.get((id(block_mask), B, Hq, "kv_fine"))
    if hit is not None and hit[0]() is block_mask and hit[1] == (block_mask.version, stamp):
        return hit[2]
    if not compute:
        return None
    reads = reads_batch_head(mask_lowered)
    return _mask_views(block_mask, B, Hq, "kv_fine", lambda: _finer_tables(block_mask, B, Hq, reads), stamp)


def _finer_tables(block_mask, B, Hq, reads):
    from flexcore.kernels.tables import refine_tables

    return refine_tables(block_mask, B, Hq, kv_blocks(block_mask, B, Hq), reads)


def _q_blocks(block_mask, B, Hq):
    """The backward's transposed tables (``flexcore.kernels.backward.q_block_tensors``). A mask
    built without them (``compute_q_blocks=False``) has them computed once, not at every backward;
    that transpose is reused while the key-block tables are unmodified (their version counters)."""
    from flexcore.kernels.tables import q_block_tensors

    stamp = None
    if block_mask.q_indices is None:
        stamp = tuple(None if t is None else (id(t), t._version)
                      for t in (block_mask.kv_num_blocks, block_mask.kv_indices,
                                block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    return _mask_views(block_mask, B, Hq, "q", lambda: q_block_tensors(block_mask, B, Hq), stamp)


def _decodes(query, opts) -> bool:
    """Whether the decode kernel runs the forward (short queries), rather than the forward kernel.
    float64 and FP8 calls take the forward kernel at every length."""
    ready()
    return query.dtype not in (torch.float64, FP8_DTYPE) and _decode.use_decode_kernel(query.shape[2], opts)


def _prefetch_stats(block_mask, blocks, query, key, value, score_lowered, opts) -> None:
    """Before a forward that autograd will differentiate: read back the transposed tables'
    statistics that the backward will ask for together with the key-block tables' ones that the
    forward asks for (one wait on the GPU per new mask instead of two; nothing when both are known)."""
    from flexcore.kernels.backward import uses_runs
    from flexcore.kernels.forward import pad_head_dim
    from flexcore.kernels.tables import gather_stats

    if _decodes(query, opts):
        return
    head_dim_pad = max(pad_head_dim(query.shape[-1]), pad_head_dim(value.shape[-1]))
    if not uses_runs(head_dim_pad, score_lowered.is_trivial, opts):
        return
    B, Hq, L = query.shape[:3]
    sparse_q, sparse_kv = blocks.sparse_block
    gather_stats([(blocks, math.ceil(L / sparse_q)),
                  (_q_blocks(block_mask, B, Hq), math.ceil(key.shape[2] / sparse_kv))])


def sinks_in_kernel(query, opts, descales=None, sinks=None) -> bool:
    """Whether the forward kernel applies ``sinks`` in its epilogue (flexcore.kernels.forward.forward)
    rather than flex_attention after the kernels (flexcore.sinks.apply_sinks): everywhere but the
    decode kernel (short queries), and an FP8 call whose sinks want a gradient (the FP8 kernels
    have no autograd node; the pass after them gives the sinks theirs)."""
    if descales is not None:
        return not (sinks is not None and sinks.requires_grad and torch.is_grad_enabled())
    return not _decodes(query, opts)


def forward_kernels(query, key, value, score_lowered, mask_lowered, blocks, scale, opts,
                    want_max: bool = False, descales=None, sinks=None):
    """(out, lse, row_stats, max_scores) of the forward or the decode kernel. row_stats is None
    from decode (the backward derives it, :func:`decode_row_stats`); max_scores is None unless
    ``want_max``. ``descales``: the :class:`flexcore.fp8.Descales` of float8 inputs (the forward
    kernel's FP8 path). ``sinks``: (Hq,) logits that the forward kernel adds to each row's
    denominator (only where :func:`sinks_in_kernel`)."""
    if _decodes(query, opts):
        if sinks is not None:
            raise ValueError("the decode kernel takes no sinks: flex_attention applies them after it")
        if want_max:
            out, lse, max_scores = _decode.decode(query, key, value, score_lowered, mask_lowered,
                                                  blocks, scale, opts, return_max_scores=True)
            return out, lse, None, max_scores
        out, lse = _decode.decode(query, key, value, score_lowered, mask_lowered, blocks, scale, opts)
        return out, lse, None, None
    B = query.shape[0]
    if descales is not None:  # V key-major before a shared cache's expand: one copy, not B
        value = key_major(value)
    if key.shape[0] != B:  # a shared (batch 1) cache is read through stride-0 views
        key, value = key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1)
    out, lse, row_stats = _forward.forward(query, key, value, score_lowered, mask_lowered, blocks,
                                           scale, opts, descales, sinks)
    return out, lse, row_stats, (_forward.max_scores(row_stats) if want_max else None)


def decode_row_stats(lse: Tensor, max_scores: Tensor | None) -> Tensor:
    """The forward kernel's row statistics (row max in log2 units, 1/row sum) for the decode
    kernel's lse (and row max, when it returned one: then the first row holds the true max, so
    that ``max_scores`` can be read from it)."""
    if max_scores is None:
        return _forward.row_stats_from_lse(lse)
    # p = exp2(s * log2(e) - m) / l with m = max * log2(e) and 1/l = exp(max - lse): 0 on rows
    # without a kept key (max = lse = -inf).
    inv_l = torch.where(torch.isfinite(lse), torch.exp(max_scores - lse), torch.zeros_like(lse))
    return torch.stack([max_scores * (1.0 / math.log(2.0)), inv_l])


def backward_kernels(query, key, value, out, row_stats, grad_out, grad_lse, score_lowered,
                     score_bwd_lowered, mask_lowered, block_mask, blocks, scale, opts,
                     return_delta: bool = False):
    """(dq, dk, dv, captured_grads) of flexcore.kernels.backward.backward (``blocks``: the
    forward's, ``kv_blocks(block_mask, B, Hq)``); a shared (batch 1) key/value cache gets its
    gradient summed over the batch. ``return_delta``: also the rows' delta that the kernels
    computed, rowsum(dO * O) - grad_lse (B, Hq, L)."""
    B, Hq = query.shape[:2]
    shared = key.shape[0] != B
    dq, dk, dv, captured_grads, *delta = _backward.backward(
        query, key.expand(B, -1, -1, -1) if shared else key,
        value.expand(B, -1, -1, -1) if shared else value, out, row_stats, grad_out, score_lowered,
        score_bwd_lowered, mask_lowered, blocks, _q_blocks(block_mask, B, Hq), scale, opts,
        grad_lse=grad_lse, return_delta=return_delta)
    if shared:
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return (dq, dk, dv, captured_grads, *delta)


def row_delta_kernels(query, key, value, out, row_stats, grad_out, grad_lse, score_lowered,
                      score_bwd_lowered, mask_lowered, block_mask, blocks, scale, opts):
    """The rows' delta of :func:`backward_kernels` alone (flexcore.kernels.backward.row_deltas),
    for a backward that wants no other gradient."""
    B, Hq = query.shape[:2]
    if key.shape[0] != B:
        key, value = key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1)
    return _backward.row_deltas(query, key, value, out, row_stats, grad_out, score_lowered, score_bwd_lowered,
                                mask_lowered, blocks, _q_blocks(block_mask, B, Hq), scale, opts, grad_lse)


def _not_twice_differentiable(backward):
    """torch's ``once_differentiable``, also where the incoming gradients do not require grad:
    under ``create_graph`` every gradient the kernels return raises when it is differentiated (a
    gradient penalty would otherwise lose its own gradient in silence: the kernels' gradients
    have none)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # no create_graph
            return outputs
        error = torch._C._functions.DelayedError(
            b"flex_attention's gradients are not differentiable: a double backward (a gradient "
            b"penalty, a Hessian-vector product) through flex_attention is not supported", len(outputs))

        def differentiable(t):
            if t is None:
                return None
            t = t.detach()
            t.requires_grad = True
            return t

        return error(*(differentiable(t) for t in outputs))
    return wrapper


class _FlexAttention(torch.autograd.Function):
    """Forward (or decode) kernel; fused backward kernels, differentiating out and lse. Captured
    tensors of the score_mod are inputs of ``apply`` so that autograd routes their gradients.
    ``sinks`` (or None) are applied by the forward kernel's epilogue (:func:`sinks_in_kernel`):
    its out and lse include them, and so do the row statistics, so the backward kernels need no
    change; the sinks' own gradient is a reduction over the rows' delta (flexcore.sinks)."""

    # Inputs before the captured tensors, and the position of ``sinks`` among them.
    N_INPUTS = 10
    SINKS_INPUT = 9

    @staticmethod
    def forward(ctx, query, key, value, call, block_mask, blocks, score_bwd, score_lowered,
                mask_lowered, sinks, *captured):
        out, lse, row_stats, max_scores = forward_kernels(query, key, value, score_lowered,
                                                          mask_lowered, blocks, call.scale,
                                                          call.opts, call.want_max, sinks=sinks)
        # The mods' captured tensors are saved too (as torch's flex_attention saves its
        # score_mod/mask_mod buffers): the backward re-reads them, so an in-place edit between
        # forward and backward must raise autograd's version-counter error, not give gradients
        # of a different function. (Inference tensors cannot be saved; they are left out.)
        watched = tuple(t for t in (*score_lowered.captured, *mask_lowered.captured)
                        if not t.is_inference())
        if row_stats is None:  # the decode kernel keeps lse (and the row max): derived later
            ctx.save_for_backward(query, key, value, out, None, lse, max_scores, None, *watched)
        elif sinks is not None:  # the sinks' gradient reads lse (p_sink = exp(sink - lse))
            ctx.save_for_backward(query, key, value, out, row_stats, lse, None, sinks, *watched)
        else:
            ctx.save_for_backward(query, key, value, out, row_stats, None, None, None, *watched)
        ctx.call, ctx.block_mask, ctx.blocks, ctx.score_bwd = call, block_mask, blocks, score_bwd
        ctx.score_lowered, ctx.mask_lowered = score_lowered, mask_lowered
        if max_scores is not None:
            ctx.mark_non_differentiable(max_scores)
        # Unused outputs need no zero gradients filled in at every backward (gradcheck also
        # sends undefined ones).
        ctx.set_materialize_grads(False)
        return out, lse, max_scores

    @staticmethod
    @_not_twice_differentiable
    def backward(ctx, grad_out, grad_lse, _grad_max):
        n_captured = len(ctx.score_lowered.captured)
        if grad_out is None and grad_lse is None:
            return (None,) * (_FlexAttention.N_INPUTS + n_captured)
        # Unpacking checks every saved tensor's version (q, k, v and the mods' captured tensors);
        # the mask's tables, which the backward reads too, are checked as every eager call does.
        query, key, value, out, row_stats, lse, max_scores, sinks = ctx.saved_tensors[:8]
        ctx.block_mask.check_unmodified()
        if row_stats is None:
            row_stats = decode_row_stats(lse, max_scores)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        needs = ctx.needs_input_grad
        want_sinks = sinks is not None and needs[_FlexAttention.SINKS_INPUT]
        dq = dk = dv = grad_sinks = None
        captured_grads = [None] * n_captured
        call = ctx.call
        score_bwd = ctx.score_bwd
        if isinstance(score_bwd, Exception):  # its lowering failed in the forward: say so now
            raise score_bwd
        if any(needs[:3]) or any(needs[_FlexAttention.N_INPUTS:]):
            dq, dk, dv, captured_grads, *delta = backward_kernels(
                query, key, value, out, row_stats, grad_out, grad_lse, ctx.score_lowered, score_bwd,
                ctx.mask_lowered, ctx.block_mask, ctx.blocks, call.scale, call.opts,
                return_delta=want_sinks)
        elif want_sinks:  # only the sinks learn: the delta alone, no gradient kernel
            delta = [row_delta_kernels(query, key, value, out, row_stats, grad_out, grad_lse, ctx.score_lowered,
                                       score_bwd, ctx.mask_lowered, ctx.block_mask, ctx.blocks, call.scale,
                                       call.opts)]
        if want_sinks:
            grad_sinks = sink_gradient(lse, sinks, delta[0])
        return (dq, dk, dv, *(None,) * 6, grad_sinks, *captured_grads)


# Lowered score_mod gradients per lowered score_mod (the lowering returns the same LoweredMod
# while the mod is unchanged) and per (requires_grad of its captured tensors, score dtype).
_score_backwards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _score_backward_now(score_mod, score_lowered, score_dtype):
    """:func:`_score_backward`, or the ModError its lowering raised (raised by the backward, so
    that a forward whose gradient is never taken still runs)."""
    try:
        return _score_backward(score_mod, score_lowered, score_dtype)
    except ModError as error:
        return error


def _score_backward(score_mod, score_lowered, score_dtype):
    """``flexcore.lowering.vjp.lower_score_mod_backward``, remembered with the forward's lowering."""
    key = (tuple(t.requires_grad for t in score_lowered.captured), score_dtype)
    kept = _score_backwards.get(score_lowered)
    if kept is None:
        kept = _score_backwards[score_lowered] = {}
    found = kept.get(key)
    if found is None:
        found = kept[key] = _vjp.lower_score_mod_backward(score_mod, score_lowered, score_dtype)
    return found


class _Call:
    """What a call derives from its inputs' shapes, dtypes and devices, the BlockMask's state,
    the scale and the options: checked once, reused by every call that matches (_prepared). It
    holds the mask weakly, and leaves the cache with it."""

    __slots__ = ("mask_ref", "scale", "opts", "want_max", "B", "Hq", "score_dtype", "fast_math",
                 "prefetched", "checked", "blocks")

    def __init__(self, query, mask_ref, scale, opts, want_max):
        self.mask_ref = mask_ref
        self.scale = scale
        self.opts = opts
        self.want_max = want_max
        self.B, self.Hq = query.shape[:2]
        self.score_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        # 16-bit and FP8 inputs round scores far more coarsely than approximate transcendentals err.
        self.fast_math = query.dtype in (torch.float16, torch.bfloat16, FP8_DTYPE)
        self.prefetched = False
        # (score, mask) LoweredMods whose indices passed check_indices at this call's shapes, where
        # that verdict cannot change (no run-time checks); the mask's kv_blocks views.
        self.checked = None
        self.blocks = None


# Prepared calls by (input signature, mask state, scale, options): see _prepared.
_calls: dict = {}
_CALLS_LIMIT = 256


def _mask_state(block_mask):
    """What identifies a BlockMask's current state: the object, and its version where it has one
    (assignments to a BlockMask change it)."""
    if block_mask is None:
        return None
    return id(block_mask), getattr(block_mask, "version", None)


def _options_key(kernel_options):
    if kernel_options is None or isinstance(kernel_options, KernelOptions):
        return kernel_options
    if isinstance(kernel_options, dict):  # by contents (a dict can change in place) and types
        return tuple((k, type(v), v) for k, v in kernel_options.items())
    return id(kernel_options)


def _prepared(query, key, value, block_mask, scale, enable_gqa, kernel_options, want_max):
    """(call, block_mask): the checked, prepared call for these inputs, from the cache where an
    earlier call had the same shapes, dtypes, devices, mask state, scale and options, else checked
    and prepared now; and the BlockMask the kernels read (the all-full one for None)."""
    # Before the memo: a wrapped tensor shows the shape and dtype of the call it would reuse.
    refuse_torch_func(query, key, value)
    try:
        # Types too: 1 == True, and a call that the checks would refuse must not find one they
        # passed.
        ident = (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
                 query.device, key.device, value.device, _mask_state(block_mask), scale, type(scale),
                 enable_gqa, type(enable_gqa), _options_key(kernel_options), want_max)
        call = _calls.get(ident)
    except (TypeError, AttributeError):  # an unhashable argument (an odd scale or options) or
        ident = call = None                # not a tensor (validate_inputs says which): no reuse
    if call is not None:
        mask = call.mask_ref()
        if mask is not None and (block_mask is None or mask is block_mask):
            return call, mask._within(query.shape[2], key.shape[2])
    validate_inputs(query, key, value, block_mask, scale, enable_gqa)
    opts = KernelOptions.from_any(kernel_options)
    if query.dtype == FP8_DTYPE:  # the FP8 rules (flexcore.kernels.policy.fp8_policy)
        opts = fp8_options(opts)
    if block_mask is None:
        block_mask = full_block_mask(query.shape[2], key.shape[2], query.device)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    try:
        mask_ref = weakref.ref(block_mask)
    except TypeError:  # not weak-referenceable: this call is not kept
        mask_ref, ident = (lambda: block_mask), None
    call = _Call(query, mask_ref, scale, opts, want_max)
    if ident is not None:
        if len(_calls) >= _CALLS_LIMIT:
            _calls.clear()
        _calls[ident] = call
        weakref.finalize(block_mask, _calls.pop, ident, None)
    return call, block_mask._within(query.shape[2], key.shape[2])


def _eager(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, want_max,
           descales=None, sinks=None):
    """(out, lse, max_scores, sinks applied) of an eager call (``descales``: FP8 inputs'
    flexcore.fp8.Descales). ``sinks`` are applied by the forward kernel where
    :func:`sinks_in_kernel`; the last item says whether they were (else the caller applies them)."""
    ready()
    if score_mod is not None and not callable(score_mod):
        raise InputError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, "
                         f"got {type(score_mod).__name__}")
    call, block_mask = _prepared(query, key, value, block_mask, scale, enable_gqa, kernel_options,
                                 want_max)
    block_mask.check_unmodified()  # tables edited in place since the mask was built are refused
    # Lowering is cached on the mods' structure and checked at every call: a closure cell or a
    # global that a mod reads may have been rebound since.
    score_lowered = _lowering.lower_score_mod(score_mod, call.score_dtype, fast_math=call.fast_math)
    mask_lowered = _lowering.lower_mask_mod(block_mask.mask_mod)
    checked = call.checked
    if checked is None or checked[0] is not score_lowered or checked[1] is not mask_lowered:
        check_captured_values(query.device, score_lowered, mask_lowered)
        if check_indices(score_lowered, mask_lowered, call.B, call.Hq, query.shape[2], key.shape[2], call.opts):
            call.checked = (score_lowered, mask_lowered)
    blocks = call.blocks
    if blocks is None:  # the call is kept per mask state (id and version): so are its views
        blocks = call.blocks = kv_blocks(block_mask, call.B, call.Hq)
    if sinks is not None and not sinks_in_kernel(query, call.opts, descales, sinks):
        sinks = None
    applied = sinks is not None
    if descales is not None:
        _check_forward_only(query, key, value, descales, score_lowered)
        out, lse, _, max_scores = forward_kernels(query, key, value, score_lowered, mask_lowered,
                                                  blocks, call.scale, call.opts, want_max, descales,
                                                  sinks)
        return out, lse, max_scores, applied
    if torch.is_grad_enabled():
        kernel_grads = (query.requires_grad or key.requires_grad or value.requires_grad
                        or any(t.requires_grad for t in score_lowered.captured))
        if kernel_grads or (applied and sinks.requires_grad):
            if not call.prefetched:
                _prefetch_stats(block_mask, blocks, query, key, value, score_lowered, call.opts)
                call.prefetched = True
            # The score_mod's gradient is lowered now: the mod may read a closure cell that
            # changes before the backward runs (mods defined in a loop over layers).
            score_bwd = _score_backward_now(score_mod, score_lowered, call.score_dtype)
            return (*_FlexAttention.apply(query, key, value, call, block_mask, blocks, score_bwd,
                                          score_lowered, mask_lowered, sinks, *score_lowered.captured),
                    applied)
    # Inference (decoding steps above all): no autograd node, no saved tensors.
    out, lse, _, max_scores = forward_kernels(query, key, value, score_lowered, mask_lowered,
                                              blocks, call.scale, call.opts, want_max, sinks=sinks)
    return out, lse, max_scores, applied


def check_captured_values(device: torch.device, *lowered_mods) -> None:
    """ModError naming a captured tensor the kernels cannot read: a meta tensor (no values), or
    one on another device than the query's. (The lowering itself traces meta tensors:
    flexcore.ops lowers on stand-ins.)"""
    for lowered in lowered_mods:
        for i, t in enumerate(lowered.captured):
            if not t.is_meta and t.device == device:
                continue
            named = i < len(lowered.cap_names) and lowered.cap_names[i]
            name = lowered.cap_names[i] if named else f"a captured tensor of shape {tuple(t.shape)}"
            what = "a meta tensor: it holds no values for the kernel to read" if t.is_meta else (
                f"on {t.device}, and the query on {device}: the kernels read it there")
            move = f" ({name}.to({str(device)!r}))" if named else ""
            raise ModError(f"{name} is {what}; move it to the query's device{move}",
                           mod_name=lowered.mod_name)


def _check_forward_only(query, key, value, descales, score_lowered) -> None:
    """InputError where autograd would want gradients through an FP8 call: its kernels have no
    backward (the sinks' gradient needs none: flexcore.sinks differentiates out and lse, applied
    after the kernels there, see sinks_in_kernel)."""
    if not torch.is_grad_enabled():
        return
    named = [("query", query), ("key", key), ("value", value), ("descale_q", descales.q),
             ("descale_k", descales.k), ("descale_v", descales.v)]
    named += [(f"the score_mod's captured tensor {i} {tuple(t.shape)}", t)
              for i, t in enumerate(score_lowered.captured)]
    wanting = [name for name, t in named if t.requires_grad]
    if wanting:
        raise InputError(f"the FP8 (float8_e4m3fn) path of flex_attention is forward-only, but "
                         f"{', '.join(wanting)} requires grad (out and lse would need a backward). "
                         f"Call it under torch.no_grad() or on detached tensors, or train with "
                         f"bfloat16 inputs")


def check_indices(score_lowered, mask_lowered, B: int, Hq: int, L: int, S: int, opts) -> bool:
    """Refuse mods that index a captured tensor out of range on this call's grid
    (flexcore.lowering.check_indices): proven or evaluated once per mod and shape; indices read
    from captured values are checked at every call on the interpreter and under
    ``KernelOptions(check_indices=True)`` (one min/max per such tensor, a GPU sync).

    Returns whether the verdict holds for every later call of these mods at this grid: no
    run-time checks, and not inside a CUDA graph capture (which defers evaluations)."""
    runtime = use_interpreter() or opts.check_indices
    _lowering.check_indices(score_lowered, "score", B, Hq, L, S, runtime=runtime)
    _lowering.check_indices(mask_lowered, "mask", B, Hq, L, S, runtime=runtime)
    return not (runtime or capturing())


_warned_return_lse = False


def _without_rows(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                  sinks):
    """(out, lse, max_scores) of a call with a batch or query length of 0: empty tensors of the
    usual shapes and dtypes, after the checks a call with rows gets. They are tied to q, k, v and
    the sinks by a zero term, so a backward gives those inputs zero gradients (their values reach
    no row); tensors the score_mod captures get none."""
    block_mask = coerce_block_mask(block_mask)
    check_call(query, key, value, score_mod, block_mask, scale, enable_gqa, rows_may_be_empty=True)
    KernelOptions.from_any(kernel_options)  # refused options are refused here too
    B, Hq, L = query.shape[:3]
    fp8 = query.dtype == FP8_DTYPE
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = query.new_zeros((B, Hq, L, value.shape[-1]), dtype=torch.bfloat16 if fp8 else query.dtype)
    lse = query.new_full((B, Hq, L), float("-inf"), dtype=acc)
    max_scores = lse.clone()
    # FP8 inputs are forward-only, but their sinks learn (as at L > 0: flexcore.sinks.apply_sinks).
    tied = (sinks,) if fp8 else (query, key, value, sinks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tied):
        tie = sum((t.sum() * 0 for t in tied if t is not None and t.requires_grad),
                  torch.zeros((), dtype=acc, device=query.device))
        out, lse = out + tie.to(out.dtype), lse + tie.to(acc)
    return out, lse, max_scores


def _without_decode(kernel_options):
    """``kernel_options`` with the decode kernel off where the query length would choose it (an
    explicit decode=True / BACKEND='TRITON_DECODE' is kept)."""
    opts = KernelOptions.from_any(kernel_options)
    if opts.decode is not None:
        return kernel_options
    return dataclasses.replace(opts, decode=False)


def _requested(return_lse, return_aux) -> tuple[bool, bool]:
    """(lse, max_scores) requested, with torch's rules: return_aux=AuxRequest(...) replaces the
    deprecated return_lse, and the two cannot be combined."""
    global _warned_return_lse
    if not isinstance(return_lse, bool):  # "yes" would read as True
        raise InputError(f"return_lse must be True or False, got {return_lse!r}")
    if return_aux is None:
        if return_lse and not _warned_return_lse and not torch.compiler.is_compiling():
            _warned_return_lse = True
            warnings.warn("return_lse is deprecated (as in torch.nn.attention.flex_attention); use "
                          "return_aux=AuxRequest(lse=True) instead", FutureWarning, stacklevel=3)
        return bool(return_lse), False
    if return_lse:
        raise InputError("Cannot specify both return_lse and return_aux: return_lse is deprecated, "
                         "use return_aux=AuxRequest(lse=True) instead")
    try:
        return bool(return_aux.lse), bool(return_aux.max_scores)
    except AttributeError:
        raise InputError(f"return_aux must be a flexcore.AuxRequest (lse=..., max_scores=...) or "
                         f"None, got {type(return_aux).__name__}") from None


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: ScoreMod | None = None,
                   block_mask=None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options=None, *, return_aux=None,
                   sinks: Tensor | None = None, descale_q: Tensor | None = None,
                   descale_k: Tensor | None = None, descale_v: Tensor | None = None):
    """Attention with a user score_mod and a block-sparse mask, in one fused Triton kernel.

    Same signature and semantics as ``torch.nn.attention.flex_attention.flex_attention``; it also
    works inside ``torch.compile`` (``fullgraph=True``, dynamic shapes, CUDA graphs), where it is
    captured as the custom ops of :mod:`flexcore.ops`.

    Args:
        query: (B, Hq, L, D); key: (B, Hkv, S, D); value: (B, Hkv, S, Dv). float16, bfloat16,
            float32 or float64; or all three float8_e4m3fn with descale factors (forward only).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to every computed score.
        block_mask: a :class:`flexcore.BlockMask`; None attends everywhere.
        scale: multiplies q·k; default ``1/sqrt(D)``.
        enable_gqa: allow Hq to be a multiple of Hkv (grouped-query attention).
        return_lse: deprecated (as in torch): also return the log-sum-exp of the scores.
        kernel_options: a :class:`flexcore.KernelOptions` or a dict of its fields.
        return_aux: an :class:`AuxRequest` of the auxiliary outputs to return.
        sinks: (Hq,) learnable attention sinks (gpt-oss): one finite logit per query head that
            joins every row's softmax denominator, ``out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} +
            e^{sinks[h]})``, with any score_mod, mask and GQA; differentiable (its gradient is
            deterministic). float16, bfloat16, float32 or float64, on the query's device.
        descale_q, descale_k, descale_v: for float8_e4m3fn q, k, v (required there, refused
            otherwise): float32 factors with x = x_fp8 · descale (FlashAttention-3's), shape ()
            or (1,) per tensor, or (B, Hkv) per batch and KV head (batch 1 broadcasts; descale_q
            may also be (B, Hq), per query head). The mods see the descaled, scaled scores, as
            with 16-bit inputs. Positive values (amax / 448, as :func:`flexcore.fp8.quantize`
            gives). Runs on GPUs with FP8 tensor cores (compute capability 8.9 or newer) and,
            upcast, under Triton's interpreter on the CPU; forward only (inputs that require grad
            are refused), not under torch.compile.

    Returns:
        out (B, Hq, L, Dv) in the inputs' dtype (bfloat16 for float8_e4m3fn inputs); with
        ``return_aux``, ``(out, AuxOutput(lse, max_scores))``, a field None unless requested; with
        ``return_lse``, ``(out, lse)``.
        lse (B, Hq, L) float32 (float64 for float64 inputs) is the natural-log log-sum-exp of each
        row's modded, masked scores and is differentiable (gradients reach q, k and the captured
        tensors); max_scores (same shape and dtype) is each row's largest of those scores, not
        differentiable. Rows without a kept key have lse and max_scores -inf. With ``sinks``
        the lse includes the sink, ``logaddexp(lse_of_scores, sinks[h])`` (so a row without a
        kept key has output 0 and lse ``sinks[h]``); max_scores remains the scores' max.

    Example:
        >>> def alibi(score, b, h, q_idx, kv_idx):
        ...     return score - slopes[h] * (q_idx - kv_idx).abs()
        >>> out = flex_attention(q, k, v, score_mod=alibi, block_mask=causal_mask)
        >>> out, aux = flex_attention(q, k, v, block_mask=causal_mask,
        ...                           return_aux=AuxRequest(lse=True, max_scores=True))
        >>> sinks = torch.nn.Parameter(torch.zeros(q.shape[1], device=q.device))
        >>> out = flex_attention(q, k, v, block_mask=window_mask, sinks=sinks)
        >>> (q8, dq), (k8, dk), (v8, dv) = (flexcore.fp8.quantize(t) for t in (q, k, v))
        >>> out = flex_attention(q8, k8, v8, block_mask=causal_mask, descale_q=dq, descale_k=dk,
        ...                      descale_v=dv)                                   # bfloat16
    """
    if isinstance(query, Tensor) and query.is_nested:  # a ragged batch as one stacked sequence
        if query.dtype == FP8_DTYPE or any(d is not None for d in (descale_q, descale_k, descale_v)):
            raise InputError("float8_e4m3fn inputs (descale_q, descale_k, descale_v) are not supported "
                             "with nested (jagged) query tensors; pad the batch to (B, H, L, D) tensors")
        if sinks is not None:
            raise InputError("sinks is not supported with nested (jagged) query tensors; pad the "
                             "batch to (B, H, L, D) tensors, or call without sinks")
        from flexcore.nested import nested_flex_attention

        return nested_flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                     return_lse, kernel_options, return_aux=return_aux)
    descales = check_fp8_inputs(query, key, value, descale_q, descale_k, descale_v)
    want_lse, want_max = _requested(return_lse, return_aux)
    if sinks is not None:
        check_sinks(sinks, query)
        if sinks.device.type == "cpu" and not torch.compiler.is_compiling():
            check_finite_sinks(sinks)
    if isinstance(query, Tensor) and query.dim() == 4 and (query.shape[0] == 0 or query.shape[2] == 0):
        # No rows: nothing to launch. torch's flex_attention returns an empty output too.
        out, lse, max_scores = _without_rows(query, key, value, score_mod, block_mask, scale,
                                             enable_gqa, kernel_options, sinks)
        sinks = None
    elif descales is not None and torch.compiler.is_compiling():
        # The FP8 path runs eagerly. A raise here does not reach the user without fullgraph=True:
        # dynamo turns it into a graph break and re-runs this frame with its callback still set on
        # the frames below (flexcore's and Triton's), which it cannot trace. Run it as a graph
        # break instead, with dynamo off below it (fullgraph=True reports the break).
        return _eager_flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                     return_lse, kernel_options, return_aux=return_aux, sinks=sinks,
                                     descale_q=descale_q, descale_k=descale_k, descale_v=descale_v)
    elif torch.compiler.is_compiling():
        block_mask = coerce_block_mask(block_mask)  # a torch BlockMask, as in an eager call
        # flexcore's forward op takes the sinks in, as an eager call's kernels do.
        out, lse, max_scores = ops.compiled_flex_attention(query, key, value, score_mod, block_mask,
                                                           scale, enable_gqa, kernel_options, want_max,
                                                           sinks)
        sinks = None
    else:
        block_mask = coerce_block_mask(block_mask)  # a torch BlockMask, converted once
        if (sinks is not None and descales is None and sinks.requires_grad
                and torch.is_grad_enabled()):
            # Learning sinks take the forward kernel at every length: the decode kernel's sinks
            # are applied after it (flexcore.sinks.apply_sinks), whose gradient sums the rounded
            # 16-bit output over every row (docs/decisions.md#sinks-post-pass, known limit).
            kernel_options = _without_decode(kernel_options)
        out, lse, max_scores, applied = _eager(query, key, value, score_mod, block_mask, scale,
                                               enable_gqa, kernel_options, want_max, descales, sinks)
        if applied:  # the forward kernel's epilogue took the sinks in (sinks_in_kernel)
            sinks = None
    if sinks is not None:
        # Eager calls of the decode kernel and FP8 calls whose sinks learn: after the kernels,
        # from their (out, lse), differentiated by autograd through the kernels' lse (flexcore.sinks).
        out, lse = apply_sinks(out, lse, sinks)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if want_lse else None,
                              max_scores=max_scores if want_max else None)
    return (out, lse) if return_lse else out


@functools.partial(torch.compiler.disable,
                   reason="the FP8 (float8_e4m3fn) path of flex_attention runs eagerly, not under "
                          "torch.compile")
def _eager_flex_attention(*args, **kwargs):
    """flex_attention run eagerly from a compiled region (the FP8 path): a graph break."""
    return flex_attention(*args, **kwargs)
