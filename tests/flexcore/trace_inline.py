"""Trace flexcore's inline compiled ops the way Inductor's AOT stage does, on a machine without a
GPU, and print what Inductor would see as JSON: per Triton launch, the kernel, its PHASE and the
buffers that Inductor's analysis of the kernel finds it writes.

The ops run over fake CUDA tensors under FunctionalTensorMode (which decomposes a triton_op into
its body), so every decision in their bodies must read shapes alone. Run in its own process by
test_inline_trace.py: it makes flexcore take its GPU code paths (no interpreter) and gives
triton an sm_90 target for the write analysis, which compiles each kernel to TTIR.

Usage: python -m tests.flexcore.trace_inline {forward|backward} {causal|document|none} [grad] [gqa] [two]
(two: the backward in two launches, backward.fused "off")
("document": the score_mod and the mask_mod read one captured tensor of document ids)
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys


def main(argv: list[str]) -> None:
    op, mask_kind = argv[0], argv[1]
    grad, gqa, two = "grad" in argv, "gqa" in argv, "two" in argv

    import torch

    import flexcore._runtime as runtime

    os.environ["TRITON_INTERPRET"] = "0"
    runtime.use_interpreter = lambda: False  # the GPU code paths, as on a CUDA machine
    runtime.prepare_triton = lambda: None
    import flexcore.kernels.codegen as codegen

    codegen.prepare_triton = lambda: None
    import triton
    from triton.backends.compiler import GPUTarget

    class Hopper:  # the target that the write analysis compiles the kernels for
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver._active = Hopper()

    fallbacks = []

    class Fallbacks(logging.Handler):
        def emit(self, record):
            if "assuming every input is mutated" in record.getMessage():
                fallbacks.append(record.getMessage())

    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(Fallbacks())

    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    from flexcore import attention, create_block_mask, ops
    from flexcore.kernels.policy import DispatchPolicy

    attention.ready()

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    B, Hq, Hkv, L, D = 2, 4, 2 if gqa else 4, 256, 64
    cuda = torch.device("cuda")
    cpu_mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=128)
    with FakeTensorMode():
        # The mods are recorded over CPU tensors: autograd (a captured tensor that requires grad)
        # has no CUDA device here.
        slopes_cpu = torch.rand(Hq, requires_grad=grad)
        doc_cpu = torch.zeros(L, dtype=torch.int64)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes_cpu[h] * (q_idx - kv_idx)

        def alibi_by_document(score, b, h, q_idx, kv_idx):
            return score - slopes_cpu[h] * (q_idx - kv_idx) + (doc_cpu[q_idx] == doc_cpu[kv_idx])

        def document(b, h, q_idx, kv_idx):
            return (doc_cpu[q_idx] == doc_cpu[kv_idx]) & (q_idx >= kv_idx)

        cpu = torch.device("cpu")
        score = ops.record(alibi_by_document if mask_kind == "document" else alibi, "score", torch.float32, cpu)
        mask = None if mask_kind == "none" else ops.record(document if mask_kind == "document" else causal,
                                                           "mask", torch.float32, cpu)
        policy = DispatchPolicy().replace(launch={"inline": "on", "inline_backward": "on"},
                                          backward={"fused": "off" if two else "auto"})
        call = ops.register_call(score.constants, None if mask is None else mask.constants, torch.bfloat16,
                                 "cuda", {"policy": policy}, False)
        q = torch.randn(B, Hq, L, D, device=cuda, dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, L, D, device=cuda, dtype=torch.bfloat16) for _ in range(2))
        slopes = torch.rand(Hq, device=cuda)
        doc = torch.zeros(L, dtype=torch.int64, device=cuda)
        # The call's captured tensors, on the device, in the recorded order (one doc for both mods).
        score_caps = [slopes, doc] if mask_kind == "document" else [slopes]
        mask_caps = [doc] if mask_kind == "document" else []
        tables = [] if mask is None else [
            torch.empty(tuple(t.shape), dtype=t.dtype, device=cuda).as_strided(tuple(t.shape), t.stride())
            for t in (cpu_mask.kv_num_blocks, cpu_mask.kv_indices, cpu_mask.full_kv_num_blocks,
                      cpu_mask.full_kv_indices, cpu_mask.q_num_blocks, cpu_mask.q_indices,
                      cpu_mask.full_q_num_blocks, cpu_mask.full_q_indices)]
        block = [] if mask is None else [*cpu_mask.BLOCK_SIZE, *cpu_mask.seq_lengths]
        rest = (mask_caps, score.ints, score.floats,
                [] if mask is None else mask.ints, [] if mask is None else mask.floats, block, call,
                1 / math.sqrt(D))
        if op == "forward":
            def run(q, k, v, slopes, *tabs):
                tabs = list(tabs) or [None] * 8
                return torch.ops.flexcore.flex_attention_forward_inline(q, k, v, *tabs, score_caps, *rest)
            inputs = (q, k, v, slopes, *tables)
        else:
            out = torch.empty(B, Hq, L, D, device=cuda, dtype=torch.bfloat16)
            row_stats = torch.empty(2, B, Hq, L, device=cuda)
            grad_out, grad_lse = torch.randn_like(out), torch.randn(B, Hq, L, device=cuda)

            def run(q, k, v, out, row_stats, grad_out, grad_lse, slopes, *tabs):
                tabs = list(tabs) or [None] * 8
                return torch.ops.flexcore.flex_attention_backward_inline(
                    q, k, v, out, row_stats, grad_out, grad_lse, *tabs, score_caps, *rest)
            inputs = (q, k, v, out, row_stats, grad_out, grad_lse, slopes, *tables)
        graph = make_fx(dispatch_functionalize(run), tracing_mode="fake")(*inputs)

    launches = []
    for node in graph.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            constants = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
            values = {**constants, **node.kwargs["kwargs"]}
            launches.append({"kernel": kernel.fn.__name__, "phase": values.get("PHASE"),
                             "upcast_dot": values.get("UPCAST_DOT"),
                             "writes": sorted(node.kwargs["tensors_to_clone"]),
                             "tensors": sorted(k for k, v in node.kwargs["kwargs"].items()
                                               if isinstance(v, torch.fx.Node))})
    other = sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"
                    and "flexcore" in str(n.target)})
    aten = sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"
                   and str(n.target).startswith("aten.")})
    print(json.dumps({"launches": launches, "fallbacks": len(fallbacks), "flexcore_ops": other, "aten": aten}))


if __name__ == "__main__":
    main(sys.argv[1:])
