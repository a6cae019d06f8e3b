"""Which kernels a flex_attention call would run, and which rule of the dispatch policy chose them.

Example:
    >>> import flexcore
    >>> print(flexcore.explain(q, k, v, block_mask=bm))
    forward: Triton template (Triton interpreter)
      ...
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexcore.options import KernelOptions
from flexcore import fp8

__all__ = ["explain", "Explanation"]


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found. ``str()`` gives one line per decision.

    Attributes:
        backend: the options' backend ("auto", "triton" or "gluon").
        forward_kernel: "triton-decode", "gluon-dense", "gluon-masked", "triton", or "none"
            (a batch or query length of 0: an empty result, nothing launched).
        backward_kernel: "gluon", "triton" or "none".
        lines: the readable account, forward first.
    """

    backend: str
    forward_kernel: str
    backward_kernel: str
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _switch(family: str, name: str, value) -> str:
    return f"policy.{family}.{name}={value!r}"


def explain(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa: bool = False,
            kernel_options=None) -> Explanation:
    """Say which forward and backward kernels (and paths and tiles) flex_attention would run for
    these arguments, and which rule chose each, without running a kernel. Takes flex_attention's
    arguments. The mask's table statistics are read back from the device as the call would; the
    backward's choice assumes a gradient of the output laid out as the query.

    Raises InputError where flex_attention would (bad inputs, backend='gluon' without Hopper).
    """
    from flexcore import attention
    from flexcore._runtime import use_interpreter
    from flexcore.blockmask import create_block_mask
    from flexcore.lowering import lower_mask_mod, lower_score_mod
    from flexcore.masks import noop_mask

    attention.ready()
    attention.check_call(query, key, value, score_mod, block_mask, scale, enable_gqa, rows_may_be_empty=True)
    opts = KernelOptions.from_any(kernel_options)
    if query.shape[0] == 0 or query.shape[2] == 0:  # as flex_attention: an empty result, no kernel
        return Explanation(opts.backend, "none", "none", (
            f"no rows (batch {query.shape[0]}, query length {query.shape[2]}): flex_attention returns "
            f"an empty output and lse without launching a kernel",))
    attention.validate_inputs(query, key, value, block_mask, scale, enable_gqa)
    is_fp8 = query.dtype == fp8.FP8_DTYPE
    if is_fp8:  # the FP8 rules: a forward kernel (not the decoding one) at every query length
        opts = fp8.fp8_options(opts)
    policy = opts.dispatch
    from flexcore.kernels import backward as bwd
    from flexcore.kernels import decode, forward, hopper, tables

    B, Hq, L, D = query.shape
    S, Dv = key.shape[2], value.shape[3]
    if block_mask is None:
        block_mask = create_block_mask(noop_mask, None, None, L, S, device=query.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    score_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    score_lowered = lower_score_mod(score_mod, score_dtype, fast_math=query.dtype in (torch.float16,
                                                                                        torch.bfloat16))
    mask_lowered = lower_mask_mod(block_mask.mask_mod)
    q, k, v = query.detach(), key.detach(), value.detach()
    if is_fp8:  # the forwards read V key-major (flexcore.fp8.key_major), as a call lays it out
        v = fp8.key_major(v)
    if k.shape[0] != B:
        k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    where = "Triton interpreter" if use_interpreter() else f"{query.device}"
    lines = []
    blocks = attention.kv_blocks(block_mask, B, Hq)
    lines.append(f"backend: {opts.backend!r}; mask blocks {tuple(block_mask.BLOCK_SIZE)}; "
                 f"{query.dtype}, head dims {D}/{Dv}, lengths {L}/{S}")

    # Forward
    if query.dtype != torch.float64 and not is_fp8 and decode.use_decode_kernel(L, opts):
        fwd_kernel = "triton-decode"
        why = (f"decode={opts.decode}" if opts.decode is not None
               else f"query length {L} <= {decode.DECODE_MAX_Q_LEN} (decode=None)")
        plan = decode.plan_decode(B, Hq, k.shape[1], L, S, blocks, q.device)
        lines.append(f"forward: Triton split-KV decoding kernel ({where}), because {why}")
        lines.append(f"  tiles: {plan.heads_per_tile} heads x {plan.q_per_tile} queries per tile "
                     f"(BLOCK_M={plan.block_m}), {plan.num_splits} key splits")
    else:
        dense = forward.is_dense(blocks, L, S, opts)
        gluon = forward.gluon_choice(q, k, v, score_lowered, mask_lowered, blocks, dense, scale, opts)
        # A Gluon kernel that failed earlier in this process, or a mask_mod its module cannot take:
        # the template serves the call (explain has no sinks).
        failed = None
        if gluon is not None:
            failed = (hopper.dense_reason(q.dtype, D) if gluon[0] == "dense"
                      else hopper.kept_reason(hopper.masked_forward_key(mask_lowered, q.dtype, D)))
            if failed is not None:
                gluon = None
        elif not dense and hopper.applies_masked(q, k, v, score_lowered, blocks, dense, scale, opts):
            failed = hopper.kept_reason(hopper.module_key("forward_hopper.py.tmpl", mask_lowered))
        if gluon is not None:
            fwd_kernel = f"gluon-{gluon[0]}"
            rule = "dense" if gluon[0] == "dense" else "masked"
            terms = _MASKED_TERMS if rule == "masked" and policy.gluon.masked == "auto" else ""
            lines.append(f"forward: Gluon {gluon[0]} kernel for Hopper ({where}), because "
                         f"{_switch('gluon', rule, getattr(policy.gluon, rule))} and the call is one it "
                         f"serves (identity score_mod, {'FP8' if is_fp8 else '16-bit'}, head dim {D}, "
                         f"lengths multiple of "
                         f"{hopper.BLOCK_M}{terms}); "
                         f"the Triton template runs if it fails to build")
        else:
            fwd_kernel = "triton"
            lifted = _size_rule_lifted(opts)
            small = (not dense and hopper.applies_masked(q, k, v, score_lowered, blocks, dense, scale, lifted)
                     and hopper.masked_tables(blocks, L, S, D, lifted) is not None)
            lines.append(f"forward: Triton template ({where}); Gluon kernels not taken: "
                         f"{_gluon_refusal(q, k, v, policy, dense, small, failed=failed)}")
            used = forward.refined(blocks, q, k, v, score_lowered, mask_lowered, scale, opts)
            fine = used is not blocks
            lines.append(f"  tables: {tuple(used.sparse_block)} blocks"
                         + (f" (finer tables, {_switch('forward', 'refine', policy.forward.refine)})" if fine
                            else f" (the mask's own; {_switch('forward', 'refine', policy.forward.refine)})"))
            from flexcore.kernels.codegen import load_kernel_module

            module = load_kernel_module("forward.py.tmpl", score_lowered, mask_lowered)
            dense = forward.is_dense(used, L, S, opts)
            choice = forward.template_choice(q, k, v, score_lowered, module, used, dense, opts)
            f = policy.forward
            lines += [
                f"  dense path: {choice.dense} ({_switch('forward', 'dense', f.dense)}; every block full: "
                f"{dense})",
                f"  full-block runs: {choice.full_runs} ({_switch('forward', 'full_runs', f.full_runs)})",
                f"  K/V through TMA descriptors: {choice.tma} ({_switch('forward', 'tma', f.tma)}, "
                f"{forward.dense_flops(q, k, v):.3g} dense-equivalent FLOPs against tma_min_flops="
                f"{f.tma_min_flops:.3g})",
                f"  K/V host descriptors over all rows: {choice.k_desc is not None} "
                f"({_switch('forward', 'kv_rows', f.kv_rows)}, head dims {f.kv_rows_head_dims})",
                f"  warp-specialized candidates: {choice.q_desc_rows > 0} "
                f"({_switch('forward', 'warp_spec', f.warp_spec)})",
                f"  launch order: {'longest rows first' if choice.order is not None else 'natural'} "
                f"({_switch('forward', 'schedule_group', f.schedule_group)}, schedule_min_blocks="
                f"{f.schedule_min_blocks})",
                f"  tiles: {_tiles_text(choice.meta)}",
            ]

    # Backward
    out_like = torch.empty(B, Hq, L, Dv, dtype=q.dtype, device=q.device)
    q_blocks = tables.q_block_tensors(block_mask, B, Hq)
    bwd_kernel = "triton"
    dense = blocks.all_full(math.ceil(L / blocks.sparse_block[0]), math.ceil(S / blocks.sparse_block[1]))
    serves = (hopper.backward_may_apply(q, opts)
              and hopper.applies_backward(q, k, v, out_like, score_lowered, blocks, q_blocks, dense, scale, opts))
    # backward_module is None where the module or a launch failed, or the mask_mod is one it cannot take.
    failed = None
    if serves and hopper.backward_module(mask_lowered) is None:
        failed = hopper.kept_reason(hopper.module_key("backward_hopper.py.tmpl", mask_lowered))
    if serves and failed is None:
        bwd_kernel = "gluon"
        lines.append(f"backward: Gluon dK/dV and dQ kernels for Hopper ({where}), because "
                     f"{_switch('gluon', 'backward', policy.gluon.backward)} and the call is one they serve")
    else:
        small = (not dense and hopper.backward_may_apply(q, opts)
                 and hopper.applies_backward(q, k, v, out_like, score_lowered, blocks, q_blocks, dense, scale,
                                             _size_rule_lifted(opts)))
        fine = tables.finer_tables(blocks, L, mask_lowered, opts, lambda: policy.gluon.backward == "on")
        kv_used, q_used = (blocks, q_blocks) if fine is None else fine
        wants = any(t.requires_grad for t in score_lowered.captured)
        choice = bwd.template_choice(q, k, v, out_like, score_lowered, kv_used, q_used, opts, wants)
        b = policy.backward
        fused = ("one launch" if b.fused == "on" else "timed: one launch against two at the first backward"
                 ) if choice.may_fuse and opts.autotune and not use_interpreter() else (
                     "one launch" if choice.may_fuse else "two launches")
        lines += [
            f"backward: Triton template ({where}); Gluon kernels not taken: "
            f"{_gluon_refusal(q, k, v, policy, dense, small, backward=True, failed=failed)}",
            f"  tables: {tuple(kv_used.sparse_block)} blocks"
            + (" (finer tables)" if fine is not None else " (the mask's own)"),
            f"  dense path: {choice.dense} ({_switch('backward', 'dense', b.dense)}, head dims "
            f"{b.dense_head_dims})",
            f"  warp-specialized loops: {choice.warp_spec_rows[0] > 0} "
            f"({_switch('backward', 'warp_spec', b.warp_spec)})",
            f"  full-block runs: dK/dV {choice.full_q_runs}, dQ {choice.full_kv_runs} "
            f"({_switch('backward', 'full_runs', b.full_runs)}, up to head dim {b.full_runs_max_head_dim} "
            f"without a score_mod)",
            f"  TMA descriptors: {choice.tma} ({_switch('backward', 'tma', b.tma)})",
            f"  probabilities from lse2: {choice.p_from_lse} ({_switch('backward', 'p_from_lse', b.p_from_lse)}, "
            f"16-bit inputs)",
            f"  delta from the backward's probabilities: {choice.exact_delta} "
            f"({_switch('backward', 'exact_delta', b.exact_delta)}, captured tensors wanting gradients)",
            f"  tiles: dK/dV {_tiles_text(choice.dkdv_tiles)}; dQ {_tiles_text(choice.dq_tiles)}",
            f"  launches: {fused} ({_switch('backward', 'fused', b.fused)}, head dims {b.fused_head_dims})",
        ]
    return Explanation(opts.backend, fwd_kernel, bwd_kernel, tuple(lines))


def _tiles_text(meta) -> str:
    if isinstance(meta, tuple):  # (BLOCK_M, BLOCK_N, launch knobs)
        bm, bn, knobs = meta
        meta = dict(BLOCK_M=bm, BLOCK_N=bn, **knobs)
    if not meta:
        return "autotuned at the first call"
    return ", ".join(f"{name}={value}" for name, value in meta.items())


_MASKED_TERMS = ", rows long enough, at least gluon.masked_min_flops"


def _size_rule_lifted(opts: KernelOptions) -> KernelOptions:
    """``opts`` without the Gluon kernels' size rule (gluon.masked_min_flops 0)."""
    import dataclasses

    return dataclasses.replace(opts, policy=opts.dispatch.replace(gluon={"masked_min_flops": 0}))


def _gluon_refusal(q, k, v, policy, dense: bool, small: bool, backward: bool = False,
                   failed: str | None = None) -> str:
    """Why the Gluon kernels (the backward's, or the forward's) do not serve the call, in the first
    rule that refuses. ``small``: the kernels would serve it but for its size
    (gluon.masked_min_flops). ``failed``: the reason kept for their module or launch
    (flexcore.kernels.hopper.kept_reason)."""
    from flexcore._runtime import use_interpreter
    from flexcore.kernels.forward import dense_flops

    if use_interpreter() or not q.is_cuda:
        return "they need an sm_90 GPU (not the interpreter)"
    rule = "backward" if backward else ("dense" if dense else "masked")
    value = getattr(policy.gluon, rule)
    if value == "off":
        return _switch("gluon", rule, value)
    if failed is not None:  # set only where the other rules would take them
        return f"they failed to build or launch earlier in this process, or cannot take this mask_mod ({failed})"
    if small:
        return (f"a masked call of {dense_flops(q, k, v):.3g} dense-equivalent FLOPs, under "
                f"policy.gluon.masked_min_flops={policy.gluon.masked_min_flops:g}")
    dims = "128" if backward else "64 or 128 (FP8: 128)"
    return ("the call is not one they serve (see flexcore.kernels.hopper: identity score_mod, 16-bit or "
            f"FP8, head dim {dims}, lengths multiple of 128, rows long enough)")