"""Checks and fixtures shared by flexcore's test modules: the forward, backward, decode and lse
checks against the float64 reference, learnable score_mods, per-call cases, table spies and the small
model of the compile tests. Test modules import these from here, never from each other."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flexcore import KernelOptions, create_block_mask, flex_attention
from flexcore.attention import kv_blocks
from flexcore.kernels import forward as fwd
from flexcore.kernels.decode import decode
from flexcore.lowering import lower_mask_mod, lower_score_mod
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference
from tests.flexcore.cases import Shape, make_case, make_mods
from tests.flexcore.compare import assert_matches_reference

DEVICE = "cpu"
# The names of a BlockMask's eight block tables.
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def check_forward(shape: Shape, mod_name: str, dtype, seed: int, kernel_options=None, device=DEVICE):
    """The forward's output and lse on one case against the float64 reference."""
    q, k, v, score_mod, bm = make_case(shape, mod_name, dtype, seed, device)
    gqa = shape.Hq != shape.Hkv
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                              return_lse=True, kernel_options=kernel_options)
    assert out.shape == (shape.B, shape.Hq, shape.L, shape.Dv)
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, f"{mod_name}/{shape.name}/{dtype}")


# Learnable score_mods: factory(tensors) -> mod, so that the golden can read float64 copies.
def learnable_mod(name: str, shape: Shape, gen: torch.Generator):
    H, L, S, B = shape.Hq, shape.L, shape.S, shape.B
    if name == "alibi_slope":
        tensors = [torch.rand(H, generator=gen) + 0.1]

        def factory(slope):
            def learned_alibi(score, b, h, q_idx, kv_idx):
                return score - slope[h] * (q_idx - kv_idx).abs()
            return learned_alibi
    elif name == "relative_table":
        tensors = [0.5 * torch.randn(L + S, generator=gen)]

        def factory(table):
            def learned_relative(score, b, h, q_idx, kv_idx):
                return score + table[q_idx - kv_idx + S]
            return learned_relative
    elif name == "table_read_twice":
        # The same tensor read at two indices in one mod (torch's flex_attention rejects this). A
        # product, because the gradient of a term that depends on q_idx alone is exactly zero.
        tensors = [torch.randn(max(L, S), generator=gen)]

        def factory(bias):
            def bias_product(score, b, h, q_idx, kv_idx):
                return score + bias[q_idx] * bias[kv_idx]
            return bias_product
    elif name == "bias_difference":
        tensors = [torch.randn(max(L, S), generator=gen)]

        def factory(bias):
            def bias_difference(score, b, h, q_idx, kv_idx):
                return score + bias[q_idx] - bias[kv_idx]
            return bias_difference
    elif name == "temperature":
        tensors = [torch.rand(B, H, generator=gen) + 0.5]

        def factory(temp):
            def per_head_temperature(score, b, h, q_idx, kv_idx):
                return score / temp[b, h]
            return per_head_temperature
    elif name == "t5_bucket_softcap":
        # A T5-style bucketed bias per head, plus a learnable 0-d softcap.
        tensors = [0.5 * torch.randn(H, 16, generator=gen), torch.tensor(4.0)]

        def factory(bucket_bias, cap):
            def t5_softcap(score, b, h, q_idx, kv_idx):
                rel = q_idx - kv_idx
                bucket = torch.where(rel < 0, 8, 0) + torch.clamp(rel.abs() // 4, max=7)
                score = score + bucket_bias[h, bucket]
                return cap * torch.tanh(score / cap)
            return t5_softcap
    else:
        raise KeyError(name)
    return factory, tensors


LEARNABLE = ["alibi_slope", "relative_table", "table_read_twice", "bias_difference", "temperature",
             "t5_bucket_softcap"]


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def check_backward(shape: Shape, mod_name: str | None, dtype, seed: int, learnable: str | None = None,
                   kernel_options=None, device=DEVICE, return_grads=False):
    """Run forward + backward and compare every gradient with the float64 golden."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (t.to(device) for t in shape.qkv(dtype, "cpu", gen))
    score_mod, mask_mod = make_mods(mod_name or "noop", shape, device, gen)
    caps, caps64, factory = [], [], None
    if learnable is not None:
        factory, tensors = learnable_mod(learnable, shape, gen)
        caps = [t.to(device).requires_grad_() for t in tensors]
        caps64 = [t.detach().double().requires_grad_() for t in caps]
        score_mod = factory(*caps)
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=device,
                               BLOCK_SIZE=shape.block)
    gqa = shape.Hq != shape.Hkv
    grad_out = torch.randn(shape.B, shape.Hq, shape.L, shape.Dv, generator=gen).to(device, dtype)

    inputs = [t.requires_grad_() for t in (q, k, v)] + caps
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                         kernel_options=kernel_options)
    ours = _grads(out, inputs, grad_out)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    gold_mod = factory(*caps64) if factory is not None else score_mod
    gold = flex_attention_reference(q64, k64, v64, score_mod=gold_mod, block_mask=bm, enable_gqa=gqa,
                                    upcast=True)
    golden = _grads(gold, [q64, k64, v64] + caps64, grad_out.double())
    base = flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                    upcast=False)
    baseline = _grads(base, inputs, grad_out)

    names = ["dq", "dk", "dv"] + [f"d{learnable}[{i}]" for i in range(len(caps))]
    for name, a, g, b, x in zip(names, ours, golden, baseline, inputs):
        assert a.shape == x.shape and a.dtype == x.dtype, f"{name}: {a.shape} {a.dtype}"
        assert torch.isfinite(a).all(), f"{name} has NaN/inf"
        # Relative Frobenius error, as the forward tests: a captured tensor's gradient sums
        # millions of terms, so its largest single-entry error says little.
        assert_close_to_reference(a, g, b, metric="rel_fro", atol=1e-6 if dtype == torch.float32 else 1e-3,
                                  name=f"{mod_name}/{learnable}/{shape.name}/{dtype}: {name}")
    if return_grads:
        return ours


def run_decode(q, k, v, score_mod, block_mask, num_splits=None, opts=None):
    """The decode kernel on (q, k, v) with a user score_mod and a BlockMask (None: attend all)."""
    B, Hq, L, D = q.shape
    if block_mask is None:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, L,
                                       k.shape[2], device=q.device)
    return decode(q, k, v, lower_score_mod(score_mod), lower_mask_mod(block_mask.mask_mod),
                  kv_blocks(block_mask, B, Hq), 1.0 / math.sqrt(D), opts or KernelOptions(),
                  num_splits=num_splits)


def check_decode(shape: Shape, mod_name: str, dtype, seed: int, num_splits=None, device=DEVICE,
                 opts=None):
    q, k, v, score_mod, bm = make_case(shape, mod_name, dtype, seed, device)
    out, lse = run_decode(q, k, v, score_mod, bm, num_splits=num_splits,
                          opts=KernelOptions.from_any(opts))
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, f"{mod_name}/{shape.name}/{dtype}")


def kernel_grads(q, k, v, score_mod, bm, grad_out, grad_lse, *, scale=None, opts=None, enable_gqa=False,
                 captured=(), forward_result=None):
    """(out, lse, row_stats, grads) from the forward (or decode) and backward kernels called directly;
    grads holds dq, dk, dv and the gradients of ``captured`` (the score_mod's tensors that require
    grad, in the order the mod reads them); None without ``grad_out`` (no backward).
    ``forward_result``: an earlier call's (out, lse, row_stats, _), whose backward alone runs (two
    backwards compared bit for bit must read the same forward, whose kernel choice may differ)."""
    from flexcore import attention
    from flexcore._runtime import prepare_triton
    from flexcore.kernels.backward import backward
    from flexcore.kernels.decode import decode
    from flexcore.kernels.forward import forward, row_stats_from_lse
    from flexcore.lowering import lower_mask_mod, lower_score_mod
    from flexcore.lowering.vjp import lower_score_mod_backward

    prepare_triton()
    B, Hq, L, D = q.shape
    S = k.shape[2]
    if bm is None:
        bm = attention.full_block_mask(L, S, q.device)
    scale = D ** -0.5 if scale is None else scale
    opts = KernelOptions.from_any(opts)
    score_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    score = lower_score_mod(score_mod, score_dtype, fast_math=q.dtype in (torch.float16, torch.bfloat16))
    mask = lower_mask_mod(bm.mask_mod)
    blocks = attention.kv_blocks(bm, B, Hq)
    if forward_result is not None:
        out, lse, row_stats = forward_result[:3]
    elif attention._decodes(q, opts):
        out, lse = decode(q, k, v, score, mask, blocks, scale, opts)
        row_stats = row_stats_from_lse(lse)
    else:
        out, lse, row_stats = forward(q, k, v, score, mask, blocks, scale, opts)
    if grad_out is None:
        return out, lse, row_stats, None
    dq, dk, dv, caps = backward(q, k, v, out, row_stats, grad_out, score,
                                lower_score_mod_backward(score_mod, score, score_dtype), mask, blocks,
                                attention._q_blocks(bm, B, Hq), scale, opts, grad_lse=grad_lse)
    by_id = {id(t): g for t, g in zip(score.captured, caps)}
    return out, lse, row_stats, [dq, dk, dv, *(by_id[id(t)] for t in captured)]


def reference_grads(q, k, v, score_mod, bm, grad_out, grad_lse, *, upcast, scale=None, enable_gqa=False,
                    captured=()):
    """Gradients of ``(out * grad_out).sum() + (lse * grad_lse).sum()`` through the eager reference
    (float64 with ``upcast``: pass float64 ``captured`` tensors read by ``score_mod``)."""
    if upcast:
        q, k, v = (t.detach().double() for t in (q, k, v))
        grad_out, grad_lse = grad_out.double(), grad_lse.double()
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + list(captured)
    out, lse = flex_attention_reference(*inputs[:3], score_mod=score_mod, block_mask=bm, scale=scale,
                                        enable_gqa=enable_gqa, return_lse=True, upcast=upcast)
    return out, lse, torch.autograd.grad((out, lse), inputs, (grad_out, grad_lse.to(lse.dtype)))


def learnable_bias(n: int, gen, dtype=torch.float32):
    """A score_mod factory over a learnable per-key bias, and the bias."""
    bias = (0.5 * torch.randn(n, generator=gen)).to(dtype).requires_grad_()

    def factory(b_):
        def key_bias(score, b, h, q_idx, kv_idx):
            return score + b_[kv_idx]
        return key_bias
    return factory, bias


def check_lse_grads(shape: Shape, mod_name: str, dtype, seed, *, learnable=False, opts=None, scale=None,
                    device=DEVICE):
    """Kernel gradients with a random grad_lse against the float64 golden, tolerances relative to
    torch's own error; also checks that grad_lse changed them (the lse term is not ignored)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (t.to(device) for t in shape.qkv(dtype, "cpu", gen))
    score_mod, mask_mod = make_mods(mod_name, shape, device, gen)
    captured, captured64, gold_mod = (), (), score_mod
    if learnable:
        factory, bias = learnable_bias(shape.S, gen)
        bias = bias.detach().to(device).requires_grad_()
        bias64 = bias.detach().double().requires_grad_()
        score_mod, gold_mod, captured, captured64 = factory(bias), factory(bias64), (bias,), (bias64,)
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=device, BLOCK_SIZE=shape.block)
    gqa = shape.Hq != shape.Hkv
    grad_out = torch.randn(shape.B, shape.Hq, shape.L, shape.Dv, generator=gen).to(device, dtype)
    grad_lse = torch.randn(shape.B, shape.Hq, shape.L, generator=gen).to(device)
    _, _, _, ours = kernel_grads(q, k, v, score_mod, bm, grad_out, grad_lse, scale=scale, opts=opts,
                                 enable_gqa=gqa, captured=captured)
    _, _, golden = reference_grads(q, k, v, gold_mod, bm, grad_out, grad_lse, upcast=True, scale=scale,
                                   enable_gqa=gqa, captured=captured64)
    _, _, baseline = reference_grads(q, k, v, score_mod, bm, grad_out, grad_lse, upcast=False, scale=scale,
                                     enable_gqa=gqa, captured=captured)
    _, _, without = reference_grads(q, k, v, gold_mod, bm, grad_out, torch.zeros_like(grad_lse), upcast=True,
                                    scale=scale, enable_gqa=gqa, captured=captured64)
    names = ["dq", "dk", "dv"] + ["dbias"] * len(captured)
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    for name, a, g, b, w in zip(names, ours, golden, baseline, without):
        assert torch.isfinite(a).all(), f"{mod_name}/{dtype}: {name} has NaN/inf"
        assert_close_to_reference(a, g, b, metric="rel_fro", atol=atol, name=f"{mod_name}/{dtype}: {name}")
        if name != "dv":  # dv does not depend on the lse: the lse term must move the others
            assert (g - w).norm() > 0.05 * g.norm(), f"{name}: grad_lse barely changes the golden"
    return ours


def check_call(shape: Shape, dtype, gen, score_mod, gold_mod, caps, caps64, bm, what: str,
                layout: str = "bhsd", device="cpu", **kwargs) -> list:
    """One forward+backward with fresh inputs, every output against the float64 reference.
    Returns [out, dq, dk, dv, captured gradients...]."""
    q = torch.randn(shape.B, shape.Hq, shape.L, shape.D, generator=gen)
    k = torch.randn(shape.B, shape.Hkv, shape.S, shape.D, generator=gen)
    v = torch.randn(shape.B, shape.Hkv, shape.S, shape.Dv, generator=gen)
    if layout == "heads_inner":  # (B, S, H, D) memory viewed as (B, H, S, D)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(shape.B, shape.Hq, shape.L, shape.Dv, generator=gen).to(device, dtype)
    gqa = shape.Hq != shape.Hkv
    inputs = [q, k, v] + caps
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, **kwargs)
    ours = [out, *torch.autograd.grad(out, inputs, grad_out)]

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    gold = flex_attention_reference(q64, k64, v64, score_mod=gold_mod, block_mask=bm, enable_gqa=gqa,
                                    scale=kwargs.get("scale"), upcast=True)
    golden = [gold, *torch.autograd.grad(gold, [q64, k64, v64] + caps64, grad_out.double())]
    base = flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                    scale=kwargs.get("scale"), upcast=False)
    baseline = [base, *torch.autograd.grad(base, inputs, grad_out)]
    names = ["out", "dq", "dk", "dv"] + [f"dcap{i}" for i in range(len(caps))]
    for name, a, g, b in zip(names, ours, golden, baseline):
        assert torch.isfinite(a).all(), f"{what}: {name} has NaN/inf"
        # A captured tensor's float32 gradient sums dS times the mod's derivative over every score,
        # and the rounding of dS's row sums (zero in exact arithmetic) adds up in it, for torch and
        # flexcore alike; torch's error in one draw is a noisy yardstick of it
        # (docs/decisions.md#exact-delta). Hence 2e-6 (about 17 float32 ulps) beside 2x torch's.
        atol = (2e-6 if name.startswith("dcap") else 1e-6) if dtype == torch.float32 else 1e-3
        assert_close_to_reference(a, g, b, metric="rel_fro", atol=atol, name=f"{what}: {name}")
    return ours


def case_mods(shape, mod_name, learnable, gen, device="cpu"):
    """(score_mod, gold_mod, caps, caps64, block_mask, refill) for a case; refill() draws new
    values into the captured tensors in place (a training step's update)."""
    score_mod, mask_mod = make_mods(mod_name, shape, device, gen)
    caps, caps64, gold_mod = [], [], score_mod
    if learnable is not None:
        factory, tensors = learnable_mod(learnable, shape, gen)
        caps = [t.to(device).requires_grad_() for t in tensors]
        caps64 = [t.detach().double().requires_grad_() for t in caps]
        score_mod, gold_mod = factory(*caps), factory(*caps64)
    bm = None if mask_mod is None else create_block_mask(mask_mod, shape.B, None, shape.L, shape.S,
                                                         device=device, BLOCK_SIZE=shape.block)

    def refill():  # each value scaled by a factor in [0.8, 1.2): new values, the same signs
        with torch.no_grad():
            for c, c64 in zip(caps, caps64):
                c.mul_((0.8 + 0.4 * torch.rand(c.shape, generator=gen)).to(device))
                c64.copy_(c)

    return score_mod, gold_mod, caps, caps64, bm, refill


def backward_tables_spy(monkeypatch) -> list:
    """(SPARSE_Q_BLOCK, SPARSE_KV_BLOCK) of each backward's tiles."""
    from flexcore.kernels import backward as bwd

    seen = []
    real = bwd._tiles

    def spy(opts, head_dim_pad, itemsize, sparse_q, sparse_kv, *args):
        seen.append((sparse_q, sparse_kv))
        return real(opts, head_dim_pad, itemsize, sparse_q, sparse_kv, *args)

    monkeypatch.setattr(bwd, "_tiles", spy)
    return seen


def forward_tables_spy(monkeypatch) -> list:
    """(SPARSE_Q_BLOCK, SPARSE_KV_BLOCK) of each forward launch."""
    seen = []
    real = fwd.launch

    def spy(kernel, grid, args, bm, bn, meta, constexprs, **kw):
        seen.append((constexprs["SPARSE_Q_BLOCK"], constexprs["SPARSE_KV_BLOCK"]))
        return real(kernel, grid, args, bm, bn, meta, constexprs, **kw)

    monkeypatch.setattr(fwd, "launch", spy)
    return seen


# AttentionBlock's heads and head dim.
BLOCK_HEADS, BLOCK_HEAD_DIM = 2, 16


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class AttentionBlock(nn.Module):
    """Linear layers around flex_attention: causal, with ALiBi-like biases whose slopes are a
    learnable Parameter. ``attend`` is flex_attention's signature (the reference stands in)."""

    def __init__(self, attend=flex_attention):
        super().__init__()
        self.attend = attend
        self.qkv = nn.Linear(BLOCK_HEADS * BLOCK_HEAD_DIM, 3 * BLOCK_HEADS * BLOCK_HEAD_DIM)
        self.proj = nn.Linear(BLOCK_HEADS * BLOCK_HEAD_DIM, BLOCK_HEADS * BLOCK_HEAD_DIM)
        self.slopes = nn.Parameter(torch.exp2(-torch.arange(1.0, BLOCK_HEADS + 1)))

    def forward(self, x, block_mask):
        B, L, _ = x.shape
        # (B, H, L, D) views of one projection: not contiguous, as in real models.
        q, k, v = self.qkv(x).view(B, L, 3, BLOCK_HEADS, BLOCK_HEAD_DIM).permute(2, 0, 3, 1, 4)
        slopes = self.slopes

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        out = self.attend(q, k, v, score_mod=alibi, block_mask=block_mask)
        return self.proj(out.transpose(1, 2).reshape(B, L, BLOCK_HEADS * BLOCK_HEAD_DIM))


def run_block(model, x, block_mask, weights):
    """(output, gradients of every parameter and of x) of the loss (model(x) * weights).sum()."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = model(x, block_mask)
    (out * weights).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), {**grads, "x": x.grad}


def line_of(path: str, marker: str) -> int:
    """The number of the first line of ``path`` that holds ``marker`` (a ``# MARK-...`` comment), not
    counting the lines that call this function with it."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "line_of(" not in line:
                return i
    raise AssertionError(f"{marker} is not in {path}")


def shape_spy(monkeypatch, module, name: str) -> list:
    """Patches ``module.name`` to record the shape of its first argument on every call, then run it."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


#: Skips a test where no sm_90 (Hopper) GPU runs the Gluon kernels.
needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 (Hopper) GPU")


def served_spy(monkeypatch, module, name: str) -> list:
    """Patches ``module.name`` to record, on every call, whether it served the call (its result not
    None: the Gluon kernels return None where they fail to build and the template serves)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(module, name, spy)
    return calls
