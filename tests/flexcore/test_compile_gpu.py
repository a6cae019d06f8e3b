"""flex_attention under torch.compile on a CUDA GPU: Inductor, dynamic shapes and CUDA graphs
(``mode="reduce-overhead"``), with training steps in between (run with `-m gpu` on the device).

Each compiled step must give eager's output and gradients (the same kernels run), and both must
lie within twice torch's own error of the float64 reference.
"""
from __future__ import annotations

import pytest
import torch

from flexcore import AuxRequest, create_block_mask, flex_attention
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference
from tests.flexcore.compare import seed_of
from tests.flexcore.helpers import BLOCK_HEAD_DIM as D
from tests.flexcore.helpers import BLOCK_HEADS as H
from tests.flexcore.helpers import AttentionBlock, causal, run_block

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"


def assert_matches(got, expected, what, rtol=2e-5, atol=2e-5):
    out, grads = got
    out0, grads0 = expected
    torch.testing.assert_close(out, out0, rtol=rtol, atol=atol, msg=f"{what}: output")
    for name in grads0:
        torch.testing.assert_close(grads[name], grads0[name], rtol=rtol * 10, atol=atol * 10,
                                   msg=f"{what}: gradient of {name}")


@pytest.mark.parametrize("mode,dynamic", [("default", False), ("default", True),
                                          ("reduce-overhead", False), ("reduce-overhead", True)])
def test_compiled_training_steps_gpu(mode, dynamic):
    """Several optimizer steps on the compiled model and on an eager copy: outputs and every
    gradient agree at each step (CUDA graphs replay after their warm-up and recording steps, and
    see the updated parameters, ALiBi slopes included)."""
    torch._dynamo.reset()
    g = torch.Generator(device=DEVICE).manual_seed(seed_of("steps", mode, dynamic))
    L = 256
    model = AttentionBlock().to(DEVICE)
    twin = AttentionBlock().to(DEVICE)
    twin.load_state_dict(model.state_dict())
    bm = create_block_mask(causal, None, None, L, L, device=DEVICE)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, mode=mode)
    explained = torch._dynamo.explain(model)(torch.randn(2, L, H * D, device=DEVICE), bm)
    assert explained.graph_break_count == 0
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, twin))
    for step in range(5):
        x = torch.randn(2, L, H * D, device=DEVICE, generator=g)
        weights = torch.randn(2, L, H * D, device=DEVICE, generator=g)
        got = run_block(compiled, x, bm, weights)
        expected = run_block(twin, x, bm, weights)
        assert_matches(got, expected, f"{mode} dynamic={dynamic} step {step}")
        assert got[1]["slopes"].abs().min() > 0
        opt.step()
        twin_opt.step()
    torch.testing.assert_close(model.slopes, twin.slopes, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_compiled_attention_against_float64_gpu(dtype):
    """A compiled call (reduce-overhead) with an lse-using loss against the float64 reference,
    within twice torch's own error in the same dtype."""
    torch._dynamo.reset()
    g = torch.Generator(device=DEVICE).manual_seed(seed_of("f64", str(dtype)))
    B, L = 2, 1024
    q, k, v = (torch.randn(B, 4, L, 64, device=DEVICE, generator=g).to(dtype).requires_grad_()
               for _ in range(3))
    slopes = torch.rand(4, device=DEVICE, generator=g).requires_grad_()
    w_out = torch.randn(B, 4, L, 64, device=DEVICE, generator=g, dtype=torch.float64)
    w_lse = torch.randn(B, 4, L, device=DEVICE, generator=g, dtype=torch.float64)
    bm = create_block_mask(causal, None, None, L, L, device=DEVICE)

    def loss(out, lse):
        return (out.double() * w_out).sum() + (lse.double() * w_lse).sum()

    def ours(q, k, v, s):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - s[h] * (q_idx - kv_idx)

        out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=bm,
                                  return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def reference(upcast):
        def attend(q, k, v, s):
            def alibi(score, b, h, q_idx, kv_idx):
                return score - s[h] * (q_idx - kv_idx)

            return flex_attention_reference(q, k, v, score_mod=alibi, block_mask=bm, return_lse=True,
                                            upcast=upcast)
        return attend

    def grads(attend, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        loss(*attend(*leaves)).backward()
        return [t.grad.clone() for t in leaves]

    compiled = torch.compile(ours, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, recording, replay
        got = grads(compiled, (q, k, v, slopes))
    eager = grads(ours, (q, k, v, slopes))
    golden = grads(reference(True), [t.double() for t in (q, k, v, slopes)])
    base = grads(reference(False), (q, k, v, slopes))
    # The captured tensor's gradient is summed with atomics, in no fixed order.
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    for name, a, e, gold, b in zip(("dq", "dk", "dv", "dslopes"), got, eager, golden, base):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol, msg=f"{name}: compiled vs eager")
        assert_close_to_reference(a, gold, b, name=name, metric="rel_fro")


def _document(doc):
    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return document


@pytest.mark.parametrize("mask", ["none", "causal", "document"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_inline_forward_gpu(mask, D, dtype):
    """Small compiled calls take the inline forward (the kernel launched from Inductor's code, no
    flexcore op call left in the forward graph's code): with GQA, a learnable ALiBi slope and an
    lse-using loss, the output, lse and every gradient lie within twice torch's own error of the
    float64 reference; the same call in float32 runs flexcore's op."""
    _inline_case(mask, D, dtype, None)


@pytest.mark.parametrize("mask", ["none", "causal", "document"])
@pytest.mark.parametrize("D", [64, 128])
def test_inline_backward_gpu(mask, D):
    """The inline backward in two launches (backward.fused "off"; the default is one launch for both
    kinds of program), launched from Inductor's code (no flexcore backward op call left), within
    twice torch's own error. The causal case passes the options as a dict, the others as a
    KernelOptions: both forms reach Dynamo as constants (a frozen dataclass did not on torch 2.11)."""
    from flexcore import KernelOptions
    from flexcore.kernels.policy import DispatchPolicy

    policy = DispatchPolicy().replace(launch={"inline_backward": "on"}, backward={"fused": "off"})
    _inline_case(mask, D, torch.bfloat16, {"policy": policy} if mask == "causal" else KernelOptions(policy=policy))


def _inline_case(mask, D, dtype, kernel_options):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    g = torch.Generator(device=DEVICE).manual_seed(seed_of("inline", mask, D, str(dtype)))
    B, Hq, Hkv, L = 2, 8, 2, 640  # 640: a ragged last 128-block
    q = torch.randn(B, Hq, L, D, device=DEVICE, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(B, Hkv, L, D, device=DEVICE, generator=g).to(dtype).requires_grad_()
            for _ in range(2))
    slopes = torch.rand(Hq, device=DEVICE, generator=g).requires_grad_()
    w_out = torch.randn(B, Hq, L, D, device=DEVICE, generator=g, dtype=torch.float64)
    w_lse = torch.randn(B, Hq, L, device=DEVICE, generator=g, dtype=torch.float64)
    doc = torch.div(torch.arange(L, device=DEVICE), 200, rounding_mode="floor")
    mask_mod = {"none": None, "causal": causal, "document": _document(doc)}[mask]
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, L, L, device=DEVICE)

    def attend(reference=None):
        def run(q, k, v, s):
            def alibi(score, b, h, q_idx, kv_idx):
                return score - s[h] * (q_idx - kv_idx).abs()

            if reference is not None:
                return flex_attention_reference(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True,
                                                return_lse=True, upcast=reference)
            out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True,
                                      return_aux=AuxRequest(lse=True), kernel_options=kernel_options)
            return out, aux.lse
        return run

    def results(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out, lse = fn(*leaves)
        ((out.double() * w_out).sum() + (lse.double() * w_lse).sum()).backward()
        return [out.detach(), lse.detach(), *[t.grad for t in leaves]]

    inputs = (q, k, v, slopes)
    compiled = torch.compile(attend(), fullgraph=True)
    got, codes = run_and_get_code(lambda: results(compiled, inputs))
    assert "flex_forward_kernel" in codes[0] and "flexcore.flex_attention_forward" not in codes[0]
    # The backward graph's code launches the backward kernels (inline_backward "auto" follows the forward).
    assert len(codes) == 2 and "flex_bwd_kernel" in codes[1], len(codes)
    assert "flexcore.flex_attention_backward" not in codes[1]
    golden = results(attend(reference=True), [t.double() for t in inputs])
    base = results(attend(reference=False), inputs)
    for name, a, gold, b in zip(("out", "lse", "dq", "dk", "dv", "dslopes"), got, golden, base):
        assert_close_to_reference(a, gold, b, name=f"{mask}/D{D}: {name}", metric="rel_fro")

    # float32 is not inline's (the policy's default): the same call runs flexcore's forward op. Its
    # backward is inline where inline_backward is "on" (that switch takes float32 too).
    torch._dynamo.reset()
    inputs32 = [t.float() for t in inputs[:3]] + [slopes]
    got32, codes = run_and_get_code(lambda: results(torch.compile(attend(), fullgraph=True), inputs32))
    assert "flexcore.flex_attention_forward.default" in codes[0]
    base32 = results(attend(reference=False), inputs32)
    names = ("out", "lse", "dq", "dk", "dv", "dslopes")
    for name, a, gold, b in zip(names, got32, golden, base32):
        assert_close_to_reference(a, gold, b, name=f"{mask}/D{D} float32: {name}", metric="rel_fro")

