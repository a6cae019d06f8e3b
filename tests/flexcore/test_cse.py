"""Shared work between a score_mod's recomputed forward and its gradient in the backward kernel.

The backward kernel calls ``score_mod_fn`` (the forward, for P) and then ``score_mod_bwd_fn`` (the
vector-Jacobian product) on the same score tile. Triton inlines both and computes their common
subexpressions once, but only where the two are lowered alike: a softcap's tanh lowered as
``tanh.approx`` in one and as libdevice's tanh in the other is computed twice. Within one generated
function the code generator emits each expression once.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flexcore import create_block_mask, flex_attention
from flexcore.kernels import codegen as kcodegen
from flexcore.lowering import lower_score_mod
from flexcore.lowering.vjp import lower_score_mod_backward
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference

pytestmark = [pytest.mark.usefixtures("kernel_cache_dir"),
              pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")]

_ROOT = Path(__file__).resolve().parents[2]


def _softcap_mod(cap: float):
    softcap = torch.tensor(cap)  # captured, as the gallery's softcap variants hold it

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)
    return softcap_mod


def _head_tanh_mod():
    scale = torch.tensor([0.5, 2.0])

    def head_tanh(score, b, h, q_idx, kv_idx):
        return score + torch.tanh(score * scale[h] + (q_idx - kv_idx) * 0.1)
    return head_tanh


MODS = {"softcap30": lambda: _softcap_mod(30.0), "head_tanh": _head_tanh_mod}


def _function(source: str, name: str) -> list[str]:
    body = source.split(f"def {name}(", 1)[1]
    return body.split("\n@triton.jit", 1)[0].splitlines()[1:]


def _tanh_expressions(source: str, name: str) -> list[str]:
    """Every tanh call of ``name`` in ``source``, its operands substituted down to parameters."""
    defs, calls = {}, []
    for line in _function(source, name):
        found = re.fullmatch(r"    (v\d+) = (.*)", line)
        if found is None:
            continue
        expr = re.sub(r"\bv\d+\b", lambda m: f"({defs[m.group(0)]})", found.group(2))
        defs[found.group(1)] = expr
        if found.group(2).startswith("fl_tanh"):
            calls.append(expr)
    return calls


@pytest.mark.parametrize("fast_math", [False, True], ids=["exact", "fast_math"])
@pytest.mark.parametrize("mod_name", list(MODS))
def test_backward_repeats_the_forward_tanh_exactly(mod_name, fast_math):
    mod = MODS[mod_name]()
    forward = lower_score_mod(mod, torch.float32, fast_math=fast_math)
    backward = lower_score_mod_backward(mod, forward)
    fwd = _tanh_expressions(forward.source, "score_mod_fn")
    bwd = _tanh_expressions(backward.source, "score_mod_bwd_fn")
    # One tanh per function, the same helper on the same operands: one instruction once inlined.
    assert len(fwd) == 1 and bwd == fwd, (fwd, bwd)
    assert bwd[0].startswith("fl_tanh_approx(" if fast_math else "fl_tanh(")


def test_each_expression_is_emitted_once():
    mod = MODS["softcap30"]()
    for source, name in ((lower_score_mod(mod).source, "score_mod_fn"),
                         (lower_score_mod_backward(mod).source, "score_mod_bwd_fn")):
        exprs = [line.split(" = ", 1)[1] for line in _function(source, name) if " = " in line]
        assert len(exprs) == len(set(exprs)), source
        assert sum("tl.load(sm_c0_ptr)" in e for e in exprs) == 1, source  # the cap, read once


# The two generated functions as the backward kernel calls them, compiled for sm_90 by Triton's
# own pipeline (no GPU needed), in a fresh process: this one runs Triton's interpreter.
_HARNESS = '''
@triton.jit
def _harness(S, G, OUT{caps}, N: tl.constexpr):
    offs = tl.arange(0, N)
    q_idx = offs[:, None]
    kv_idx = offs[None, :]
    q_ok = q_idx < N
    kv_ok = kv_idx < N
    raw = tl.load(S + q_idx * N + kv_idx)
    s = score_mod_fn(raw, 0, 0, q_idx, kv_idx, q_ok, kv_ok{caps})
    p = tl.exp2(s - tl.max(s, 1)[:, None])
    ds = p * tl.load(G + q_idx * N + kv_idx)
    ds = score_mod_bwd_fn(raw, 0, 0, q_idx, kv_idx, q_ok, kv_ok, ds, q_ok & kv_ok, False, False{caps})
    tl.store(OUT + q_idx * N + kv_idx, ds)
'''

_COMPILE = textwrap.dedent('''
    import importlib.util, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    spec = importlib.util.spec_from_file_location("harness", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module._harness
    sig = {n: ("constexpr" if n == "N" else "i32" if "_s" in n and not n.endswith("_ptr")
               else "*fp32") for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs={"N": 32}),
                              target=GPUTarget("cuda", 90, 32))
    ttgir = compiled.asm["ttgir"]
    print(json.dumps({"approx": ttgir.count("tanh.approx"), "libdevice": ttgir.count("__nv_tanhf")}))
''')


@pytest.mark.parametrize("fast_math", [False, True], ids=["exact", "fast_math"])
def test_compiled_backward_computes_softcap_tanh_once(fast_math, tmp_path):
    mod = MODS["softcap30"]()
    forward = lower_score_mod(mod, torch.float32, fast_math=fast_math)
    backward = lower_score_mod_backward(mod, forward)
    caps = kcodegen.cap_list(forward.cap_params)
    # The forward's parameters are the backward's (same names, same order).
    assert tuple(backward.cap_params) == tuple(forward.cap_params)
    path = tmp_path / "harness.py"
    path.write_text(kcodegen.HEADER + forward.source + "\n" + backward.source + "\n"
                    + _HARNESS.format(caps=caps))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "PYTHONPATH": str(_ROOT)}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], capture_output=True,
                          text=True, env=env, cwd=_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts == ({"approx": 1, "libdevice": 0} if fast_math
                      else {"approx": 0, "libdevice": 1}), counts


# float32: scores of tens (q scaled up) reach tanh's curved part at softcap 30. bf16 (lowered with
# fast_math) keeps unit scores: at scores of tens the kernel's bf16 gradients exceed twice the bf16
# reference's error for the identity score_mod too. 80 is ragged for 32-tiles.
@pytest.mark.parametrize("dtype,q_scale", [(torch.float32, 20.0), (torch.bfloat16, 1.0)],
                         ids=["fp32", "bf16"])
def test_softcap_gradients_match_the_float64_reference(dtype, q_scale):
    gen = torch.Generator().manual_seed(36)
    B, H, L, D = 1, 2, 80, 32
    q = (torch.randn(B, H, L, D, generator=gen) * q_scale).to(dtype).requires_grad_()
    k, v = (torch.randn(B, H, L, D, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    grad_out = torch.randn(B, H, L, D, generator=gen).to(dtype)
    mod = MODS["softcap30"]()
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B, None, L, L,
                             device="cpu", BLOCK_SIZE=32)

    def grads(out, inputs, upstream):
        return torch.autograd.grad(out, inputs, upstream)

    ours = grads(flex_attention(q, k, v, score_mod=mod, block_mask=mask), (q, k, v), grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    golden = grads(flex_attention_reference(q64, k64, v64, score_mod=mod, block_mask=mask,
                                            upcast=True), (q64, k64, v64), grad_out.double())
    baseline = grads(flex_attention_reference(q, k, v, score_mod=mod, block_mask=mask,
                                              upcast=False), (q, k, v), grad_out)
    for name, a, g, b in zip(("dq", "dk", "dv"), ours, golden, baseline):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert_close_to_reference(a, g, b, metric="rel_fro",
                                  atol=1e-6 if dtype == torch.float32 else 1e-3,
                                  name=f"softcap30/{dtype}: {name}")
