"""flex_attention's forward kernel against the float64 reference, under Triton's interpreter."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flexcore import KernelOptions, create_block_mask, flex_attention
from flexcore.errors import InputError
from flexcore.reference import flex_attention_reference
from tests.flexcore.cases import CPU_SHAPES, MOD_NAMES, Shape, make_case, make_mods
from tests.flexcore.compare import assert_matches_reference, rel_err, seed_of
from tests.flexcore.helpers import check_forward
from tests.flexcore.policies import policy_options

DEVICE = "cpu"


@pytest.mark.parametrize("mod_name", MOD_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_variants_square(mod_name, dtype):
    check_forward(CPU_SHAPES[0], mod_name, dtype, seed=seed_of(mod_name, str(dtype)))


@pytest.mark.parametrize("shape", CPU_SHAPES[1:], ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", MOD_NAMES)
def test_variants_shapes(shape, mod_name):
    dtype = torch.bfloat16 if shape.name in ("gqa8to2", "d80_dv48") else torch.float32
    check_forward(shape, mod_name, dtype, seed=seed_of(mod_name, shape.name))


def test_float16():
    check_forward(CPU_SHAPES[0], "alibi", torch.float16, seed=3)


def test_mask_block_larger_than_tile():
    # Mask blocks of 128 visited with 64x32 tiles: every mask block spans several tiles.
    shape = Shape("tile", B=1, Hq=2, Hkv=2, L=200, S=260, D=32, Dv=32, block=128)
    check_forward(shape, "sliding_window", torch.float32, seed=5,
                  kernel_options={"BLOCK_M": 64, "BLOCK_N": 32})
    check_forward(shape, "document", torch.float32, seed=6, kernel_options=KernelOptions(BLOCK_N=64))


def test_noncontiguous_inputs_and_scale():
    gen = torch.Generator().manual_seed(7)
    B, H, L, D = 2, 3, 70, 48
    q = torch.randn(B, L, H, D, generator=gen).transpose(1, 2)
    k = torch.randn(B, L, H, 2 * D, generator=gen).transpose(1, 2)[..., ::2]
    v = torch.randn(B, H, D, L, generator=gen).transpose(2, 3)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = flex_attention(q, k, v, scale=0.3)
    gold = flex_attention_reference(q, k, v, scale=0.3)
    assert rel_err(out, gold) < 1e-5


def test_fully_masked_rows_give_zero_and_neg_inf():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 80, 32, generator=gen) for _ in range(3))

    def late(b, h, q_idx, kv_idx):
        return kv_idx < q_idx - 20  # the first 21 queries see nothing

    bm = create_block_mask(late, None, None, 80, 80, device=DEVICE, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, :, :21], torch.zeros_like(out[:, :, :21]))
    assert torch.isneginf(lse[:, :, :21]).all() and torch.isfinite(lse[:, :, 21:]).all()
    gold = flex_attention_reference(q, k, v, block_mask=bm)
    assert rel_err(out, gold) < 1e-5


def test_changing_captured_tensor_does_not_recompile():
    from flexcore.kernels import codegen

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=gen) for _ in range(3))
    bias = torch.randn(2, generator=gen)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (kv_idx - q_idx)

    first = flex_attention(q, k, v, score_mod=head_bias)
    compiled = codegen.compile_count
    bias.mul_(-3.0)  # new values, same tensor
    second = flex_attention(q, k, v, score_mod=head_bias)
    assert codegen.compile_count == compiled
    assert rel_err(second, flex_attention_reference(q, k, v, score_mod=head_bias)) < 1e-5
    assert rel_err(first, second) > 1e-3  # the new values were used


def test_rebinding_captured_global_uses_new_tensor():
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=gen) for _ in range(3))
    holder = {"t": torch.zeros(64)}

    def make():
        t = holder["t"]
        return lambda score, b, h, q_idx, kv_idx: score + t[kv_idx]

    out0 = flex_attention(q, k, v, score_mod=make())
    holder["t"] = torch.randn(64, generator=gen) * 4
    mod = make()
    out1 = flex_attention(q, k, v, score_mod=mod)
    assert rel_err(out0, flex_attention_reference(q, k, v)) < 1e-5
    assert rel_err(out1, flex_attention_reference(q, k, v, score_mod=mod)) < 1e-5


def test_sliced_and_replaced_block_mask():
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=gen) for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = create_block_mask(causal, None, None, 96, 96, device=DEVICE, BLOCK_SIZE=32)
    with pytest.raises(InputError, match="seq_lengths"):
        flex_attention(q[:, :, :32], k, v, block_mask=bm[:, :, :1])
    # A sliced mask needs its mask_mod restated (slicing renumbers blocks), as in torch.
    sliced = dataclasses.replace(bm[:, :, :1], seq_lengths=(32, 96), mask_mod=causal)
    out = flex_attention(q[:, :, :32], k, v, block_mask=sliced)
    gold = flex_attention_reference(q, k, v, block_mask=bm)[:, :, :32]
    assert rel_err(out, gold) < 1e-5


@pytest.mark.parametrize("case", [
    "rank", "batch", "heads", "gqa_divisible", "dim", "kv_len", "dtype", "device", "mask_len",
    "mask_heads", "option_key", "option_tile", "score_mod_type", "key_type", "scale_nan",
    "scale_inf", "scale_bool", "scale_tensor", "option_switch", "option_decode", "gqa_flag",
    "lse_flag",
])
def test_bad_input_names_the_argument(case):
    q = torch.randn(2, 4, 64, 32)
    k = torch.randn(2, 4, 64, 32)
    v = torch.randn(2, 4, 64, 32)
    kwargs = {}
    match = None

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if case == "rank":
        q, match = q[0], r"query has shape \(4, 64, 32\); expected 4 dims"
    elif case == "batch":
        k, v, match = torch.randn(3, 4, 64, 32), torch.randn(3, 4, 64, 32), "batch sizes differ"
    elif case == "heads":
        k, v, match = k[:, :2], v[:, :2], "enable_gqa=True"
    elif case == "gqa_divisible":
        k, v, match = k[:, :3], v[:, :3], "divisible"
        kwargs["enable_gqa"] = True
    elif case == "dim":
        k, match = torch.randn(2, 4, 64, 16), "head dim 32 differs from key head dim 16"
    elif case == "kv_len":
        v, match = torch.randn(2, 4, 65, 32), "key has length 64 but value has 65"
    elif case == "dtype":
        k, match = k.double(), "dtype"
    elif case == "device":
        k, match = k.to("meta"), "key is a meta tensor"
    elif case == "mask_len":
        kwargs["block_mask"] = create_block_mask(causal, None, None, 128, 128, device=DEVICE)
        match = r"\(Q_LEN, KV_LEN\) = \(128, 128\)"
    elif case == "mask_heads":
        kwargs["block_mask"] = create_block_mask(causal, None, 3, 64, 64, device=DEVICE, BLOCK_SIZE=32)
        match = "heads 3"
    elif case == "option_key":
        kwargs["kernel_options"], match = {"BLOCK_Q": 64}, "unknown kernel_options"
    elif case == "option_tile":
        kwargs["block_mask"] = create_block_mask(causal, None, None, 64, 64, device=DEVICE, BLOCK_SIZE=32)
        kwargs["kernel_options"], match = {"BLOCK_M": 64}, "does not divide"
    elif case == "score_mod_type":
        kwargs["score_mod"], match = 3.0, "score_mod must be callable"
    elif case == "key_type":
        k, match = [1.0], "key must be a torch.Tensor, got list"
    elif case in ("scale_nan", "scale_inf"):  # every output would be NaN
        kwargs["scale"], match = float(case[6:]), f"scale must be a finite real number.*got {case[6:]}"
    elif case == "scale_bool":
        kwargs["scale"], match = True, "scale must be a finite real number.*got bool"
    elif case == "scale_tensor":
        kwargs["scale"], match = torch.tensor(0.5), r"got Tensor \(pass a Python float"
    elif case == "option_switch":  # the string "false" would read as True
        kwargs["kernel_options"], match = {"allow_tf32": "false"}, r"allow_tf32'\] = 'false': expected True or False"
    elif case == "option_decode":
        kwargs["kernel_options"], match = {"decode": 1}, r"decode'\] = 1: expected True or False \(or None"
    elif case == "gqa_flag":
        kwargs["enable_gqa"], match = "no", "enable_gqa must be True or False, got 'no'"
    elif case == "lse_flag":
        kwargs["return_lse"], match = "yes", "return_lse must be True or False, got 'yes'"
    with pytest.raises(InputError, match=match):
        flex_attention(q, k, v, **kwargs)


def test_refusals_do_not_depend_on_earlier_calls():
    """A prepared call is found by its arguments' values and types: 1 == True must not let a
    refused argument reuse a call an accepted one prepared."""
    q = torch.randn(1, 2, 64, 32)
    for good, bad in (({"enable_gqa": False}, {"enable_gqa": 0}), ({"scale": 1}, {"scale": True}),
                      ({"kernel_options": {"deterministic": True}}, {"kernel_options": {"deterministic": 1}})):
        flex_attention(q, q, q, **good)
        with pytest.raises(InputError, match="must be|expected True or False"):
            flex_attention(q, q, q, **bad)


def test_scale_takes_any_real_number():
    import numpy as np

    gen = torch.Generator().manual_seed(seed_of("scale types"))
    q, k, v = (torch.randn(1, 2, 64, 32, generator=gen) for _ in range(3))
    # Values no earlier call used (a prepared call is found by the scale's value and type).
    for scale in (np.float32(0.3), np.float64(0.7), np.int64(2)):
        got = flex_attention(q, k, v, scale=scale)
        torch.testing.assert_close(got, flex_attention(q, k, v, scale=float(scale)), rtol=0, atol=0)
    gold = flex_attention_reference(q, k, v, scale=2)
    assert rel_err(flex_attention(q, k, v, scale=2), gold) < 1e-5


def test_mods_of_a_loop_get_their_own_tensors_gradients():
    """Score_mods defined in a loop over layers share one closure cell, which holds the last
    layer's tensor by the time the backward runs: the gradient is lowered in the forward, so
    each layer's captured tensor gets its own gradient (it got 0, or a ModError, before)."""
    gen = torch.Generator().manual_seed(seed_of("loop closures"))
    tables = [torch.randn(2, generator=gen, requires_grad=True) for _ in range(2)]
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))

    def layers(attend, dtype):
        x = q.to(dtype)
        for t in tables:
            def biased(score, b, h, q_idx, kv_idx):
                return score + t[h] * (q_idx > kv_idx)

            def scaled(score, b, h, q_idx, kv_idx):
                return score * t[h]

            x = attend(attend(x, k.to(dtype), v.to(dtype), score_mod=biased), k.to(dtype), v.to(dtype),
                       score_mod=scaled)
        x.sum().backward()
        grads = [t.grad.clone() for t in tables]
        for t in tables:
            t.grad = None
        return grads

    got = layers(flex_attention, torch.float32)
    gold = layers(flex_attention_reference, torch.float64)
    for g, want in zip(got, gold):
        assert rel_err(g, want) < 1e-5, (g, want)


def test_a_second_derivative_is_refused():
    """The kernels' gradients are not differentiable again: a double backward (a gradient
    penalty) raises instead of leaving the penalty's gradient out."""
    gen = torch.Generator().manual_seed(seed_of("double backward"))
    q, k, v = (torch.randn(1, 2, 64, 32, generator=gen, requires_grad=True) for _ in range(3))
    # Whether or not the gradient reaching flex_attention itself requires grad.
    for first in (lambda out: out.pow(2).sum(), lambda out: out.sum()):
        out = flex_attention(q, k, v)
        grad_q, = torch.autograd.grad(first(out), q, create_graph=True)
        with pytest.raises(RuntimeError, match="gradients are not differentiable: a double backward"):
            (out.pow(2).sum() + grad_q.pow(2).sum()).backward()
    # First-order gradients under create_graph still work.
    out = flex_attention(q, k, v)
    grad_q, = torch.autograd.grad(out.sum(), q, create_graph=True)
    gold = flex_attention_reference(q, k, v)
    want, = torch.autograd.grad(gold.sum(), q)
    assert rel_err(grad_q.detach(), want) < 1e-5


def test_negative_scale():
    # The trivial-score path folds the scale into the row max; a negative scale must not use it.
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 50, 32, generator=gen) for _ in range(3))
    out = flex_attention(q, k, v, scale=-0.25)
    assert rel_err(out, flex_attention_reference(q, k, v, scale=-0.25)) < 1e-5


@pytest.mark.parametrize("D,Dv", [(16, 16), (96, 40), (192, 128)])
def test_head_dims(D, Dv):
    # Non-powers of two pad to the next one inside the kernel; Dv may differ from D.
    shape = Shape("dims", B=1, Hq=2, Hkv=1, L=45, S=70, D=D, Dv=Dv, block=32)
    check_forward(shape, "alibi", torch.float32, seed=D * 1000 + Dv)


def test_shared_batch_one_cache():
    # Key/value with batch 1 serve every query batch (a shared or paged cache), without a copy.
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(3, 2, 40, 32, generator=gen)
    k, v = (torch.randn(1, 2, 60, 32, generator=gen) for _ in range(2))
    out = flex_attention(q, k, v)
    gold = flex_attention_reference(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1))
    assert rel_err(out, gold) < 1e-5


@pytest.mark.parametrize("mod_name", ["causal", "alibi", "document"])
@pytest.mark.parametrize("shape", [CPU_SHAPES[0], CPU_SHAPES[2], CPU_SHAPES[3]], ids=lambda s: s.name)
def test_tensor_descriptor_path(monkeypatch, shape, mod_name):
    """The K/V tiles read through tensor descriptors (TMA, chosen on Hopper GPUs) give the same
    results, ragged key ends included (the descriptor zero-fills rows past KV_LEN)."""
    import flexcore.kernels.forward as fwd

    used = []
    real = fwd.use_tma
    monkeypatch.setattr(fwd, "use_tma", lambda *a: used.append(real(*a)) or used[-1])
    check_forward(shape, mod_name, torch.bfloat16, seed=seed_of("tma", mod_name, shape.name),
                  kernel_options=policy_options(forward={"tma": "on"}))
    assert used == [True]


@pytest.mark.parametrize("layout", ["contiguous", "batch_broadcast", "head_broadcast", "heads_inner", "ragged"])
def test_tensor_descriptor_layouts(monkeypatch, layout):
    """K and V are read through descriptors made on the host over all their rows where the batch
    and head strides are multiples of the row stride (a batch or head that expand() broadcast, of
    stride 0, included) and no key tile passes the end of a head; otherwise (a (B, S, H, D) memory
    layout viewed as (B, H, S, D), ragged key lengths) through descriptors per head, which
    zero-fill past the end."""
    import flexcore.kernels.forward as fwd

    opts = policy_options(forward={"tma": "on", "kv_rows": "on"})  # kv_rows: by default at head dim 128 only
    gen = torch.Generator().manual_seed(seed_of("tma_layout", layout))
    S = 70 if layout == "ragged" else 64

    def kv():
        if layout == "batch_broadcast":
            return torch.randn(1, 4, S, 32, generator=gen, dtype=torch.bfloat16).expand(2, -1, -1, -1)
        if layout == "head_broadcast":
            return torch.randn(2, 1, S, 32, generator=gen, dtype=torch.bfloat16).expand(-1, 4, -1, -1)
        if layout == "heads_inner":
            return torch.randn(2, S, 4, 32, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(2, 4, S, 32, generator=gen, dtype=torch.bfloat16)

    q = torch.randn(2, 4, 40, 32, generator=gen, dtype=torch.bfloat16)
    k, v = kv(), kv()
    descs = []
    real = fwd.kv_rows_descriptor
    monkeypatch.setattr(fwd, "kv_rows_descriptor", lambda *a: descs.append(real(*a)) or descs[-1])
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + 30 >= kv_idx, None, None, 40, S, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=opts)
    assert_matches_reference(q, k, v, None, bm, out, lse, f"tma/{layout}")
    rows = {"contiguous": 2 * 4 * 64, "batch_broadcast": 4 * 64, "head_broadcast": 2 * 64}.get(layout)
    assert [d and d.shape for d in descs] == [rows and [rows, 32]] * 2


@pytest.mark.parametrize("D", [32, 64, 128])
def test_kv_rows_by_head_dim(monkeypatch, D):
    """By default K/V descriptors over all rows are made at head dim 128 only (the policy's
    forward.kv_rows_head_dims); other head dims build a descriptor per program."""
    import flexcore.kernels.forward as fwd

    made = []
    real = fwd.kv_rows_descriptor
    monkeypatch.setattr(fwd, "kv_rows_descriptor", lambda *a: made.append(real(*a)) or made[-1])
    gen = torch.Generator().manual_seed(seed_of("kv_rows_dim", D))
    q, k, v = (torch.randn(1, 2, 64, D, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 64, 64, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True,
                              kernel_options=policy_options(forward={"tma": "on"}))
    assert_matches_reference(q, k, v, None, bm, out, lse, f"kv_rows/{D}")
    assert len(made) == (2 if D == 128 else 0) and None not in made


def test_autotuned_configurations_fit_the_descriptors(monkeypatch):
    """On the GPU the forward autotunes: each configuration's pre_hook gives the K/V descriptors its
    BLOCK_N before triton's autotuner launches it, and the Tuned launcher fits them before its own
    launches. (Under the interpreter the forward does not autotune, so this wiring is checked here
    with the GPU branch of _launcher.)"""
    import flexcore.kernels.forward as fwd
    from flexcore.kernels.codegen import load_kernel_module
    from flexcore.lowering import lower_mask_mod, lower_score_mod

    module = load_kernel_module("forward.py.tmpl", lower_score_mod(None), lower_mask_mod(None))
    monkeypatch.setattr(fwd, "use_interpreter", lambda: False)
    monkeypatch.setattr(fwd, "_autotuners", {})
    tuner, meta = fwd._launcher(module, 128, torch.bfloat16, (128, 128), KernelOptions(), 4096, kv_rows=True)
    assert meta == {} and tuner.fit is fwd.fit_kv_blocks
    k = torch.zeros(2, 3, 128, 128, dtype=torch.bfloat16)
    descs = [fwd.kv_rows_descriptor(k, True, True) for _ in range(2)]
    for config in tuner.tuner.configs:
        config.pre_hook({"K": descs[0], "V": descs[1], **config.kwargs})
        assert [d.block_shape for d in descs] == [[config.kwargs["BLOCK_N"], 128]] * 2
    tuner.fit((None, *descs), {"BLOCK_N": 32})
    assert [d.block_shape for d in descs] == [[32, 128]] * 2
    plain, _ = fwd._launcher(module, 64, torch.bfloat16, (128, 128), KernelOptions(), 4096)
    assert plain.fit is None and all(c.pre_hook is None for c in plain.tuner.configs)


def test_descriptors_over_all_rows_need_int32_head_offsets():
    """Kernels reading all rows through one descriptor compute b·stride_b + h·stride_h in int32: a
    tensor whose last head starts past 2**31 - 1 elements keeps the per-head descriptors (and no warp
    specialization, which reads Q and the backward's tensors the same way)."""
    import flexcore.kernels.forward as fwd

    big = torch.empty(2, 32, 270336, 128, dtype=torch.bfloat16, device="meta")  # last head at 2.18e9
    assert fwd._all_rows(big) == 0
    assert fwd.kv_rows_descriptor(big, True, True) is None
    assert fwd.q_rows_descriptor(big, True) == 0
    fits = torch.empty(2, 32, 262144, 128, dtype=torch.bfloat16, device="meta")  # last head at 2.11e9
    assert fwd._all_rows(fits) == 2 * 32 * 262144


def test_tensor_descriptors_need_aligned_rows():
    import flexcore.kernels.forward as fwd

    k = torch.randn(1, 2, 64, 32, dtype=torch.bfloat16)
    if fwd.use_interpreter():  # chosen automatically only on Hopper GPUs
        assert not fwd.use_tma((k, k), True)
    assert not fwd.use_tma((k, k), True, rule="off")
    assert fwd.use_tma((k, k), True, rule="on")
    assert not fwd.use_tma((k, k), False, rule="on")  # padded head dims
    assert not fwd.use_tma((k, k.transpose(2, 3)), True, rule="on")  # head dim not contiguous
    odd = torch.randn(1, 2, 64, 36, dtype=torch.bfloat16)[..., :32]  # 72-byte rows
    assert not fwd.use_tma((k, odd), True, rule="on")
    rows = torch.randn(1, 2, 1, 32, dtype=torch.bfloat16).expand(1, 2, 64, 32)  # one row repeated
    assert not fwd.use_tma((k, rows), True, rule="on")


def _run_without_gpu(script: str, *args: str, **env) -> str:
    """Run ``script`` in a fresh Python with no GPU visible and ``env`` set; its stdout (the test
    fails with its stderr where it exits non-zero)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env, CUDA_VISIBLE_DEVICES="",
                    PYTHONPATH=str(root) + os.pathsep + full_env.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", script, *args], env=full_env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_triton_imported_before_flexcore_on_a_machine_without_gpu():
    """A script that imports triton first (triton.language's helpers then exist as compiled-kernel
    functions) still gets interpreted kernels on a machine without a GPU, forward and backward."""
    script = (
        "import triton, triton.language, triton.testing\n"
        "import torch\n"
        "from flexcore import create_block_mask, flex_attention\n"
        "from flexcore.reference import flex_attention_reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 2, 100, 32, generator=g, requires_grad=True) for _ in range(3))\n"
        "bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 100, 100, BLOCK_SIZE=32)\n"
        "out = flex_attention(q, k, v, block_mask=bm)\n"
        "out.sum().backward()\n"
        "ref = flex_attention_reference(q.double(), k.double(), v.double(), block_mask=bm)\n"
        "assert (out.double() - ref).abs().max() < 1e-5, (out.double() - ref).abs().max()\n"
        "assert torch.isfinite(q.grad).all()\n"
        "print('ok')\n"
    )
    assert _run_without_gpu(script).strip().endswith("ok")


def test_longest_first_orders_within_groups():
    from flexcore.kernels.forward import longest_first

    cost = torch.tensor([1, 5, 3, 5, 2, 9, 0, 4, 4])
    order = longest_first(cost, 4).tolist()
    # Groups [0..3], [4..7], [8]: each longest first, ties in their order, the groups in order.
    assert order == [1, 3, 2, 0, 5, 7, 4, 6, 8]
    assert longest_first(cost, 0).tolist() == sorted(range(9), key=lambda i: (-int(cost[i]), i))
    assert longest_first(torch.zeros(0, dtype=torch.int64), 4).numel() == 0


def test_schedule_only_where_rows_differ_and_are_long():
    from flexcore.attention import kv_blocks

    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu",
                               BLOCK_SIZE=32)
    blocks = kv_blocks(causal, 2, 3)
    order = blocks.schedule(8, 4)
    # A permutation of the 2 * 3 * 8 (batch·head, row) tiles; each group of 4 longest first.
    assert sorted(order.tolist()) == list(range(48))
    rows = (order % 8).view(-1, 4)
    assert torch.equal(rows, rows.sort(dim=1, descending=True).values)
    assert blocks.schedule(8, 4) is order  # cached
    assert kv_blocks(causal, 2, 3).schedule(8, 4) is order  # kept with the mask, not the views
    # Rows of 4.5 blocks on average: below a minimum of 5 the natural order stays.
    assert blocks.schedule(8, 4, min_mean_blocks=5.0) is None
    # Row i visits i full blocks and one partial (5/4 of a full one): 4.75 blocks on average.
    assert blocks.visits_on_average(8, 4.75) and not blocks.visits_on_average(8, 4.8)
    noop = create_block_mask(lambda b, h, q, kv: q >= 0, None, None, 256, 256, device="cpu",
                             BLOCK_SIZE=32)
    assert kv_blocks(noop, 2, 3).schedule(8, 4) is None  # every row alike: nothing to reorder


@pytest.mark.parametrize("mod_name", ["noop", "causal", "prefix_lm", "document", "and_or"])
@pytest.mark.parametrize("shape,options,group", [
    (CPU_SHAPES[0], None, 3),
    (CPU_SHAPES[3], None, 0),  # GQA
    # 64-row tiles in 128-row mask blocks; the last row's second tile lies past Q_LEN = 150.
    (Shape("ragged_tail", B=2, Hq=2, Hkv=2, L=150, S=170, D=32, Dv=32, block=128), {"BLOCK_M": 64}, 1),
], ids=["square97", "gqa8to2", "ragged_tail"])
def test_longest_first_launch_matches_reference(monkeypatch, shape, options, group, mod_name):
    from flexcore.kernels import forward as fwd

    options = policy_options(options, forward={"schedule_group": group, "schedule_min_blocks": 0.0})
    used = []
    schedule = fwd.BlockTensors.schedule

    def spy(self, *args):
        order = schedule(self, *args)
        used.append(order is not None)
        return order

    monkeypatch.setattr(fwd.BlockTensors, "schedule", spy)
    check_forward(shape, mod_name, torch.float32, seed=seed_of("order", mod_name, shape.name),
                  kernel_options=options)
    # noop takes the dense path, which has no order; rows alike get the natural order (and_or's
    # two partial blocks per row at ragged_tail).
    assert used == ([] if mod_name == "noop" else [(mod_name, shape.name) != ("and_or", "ragged_tail")])


def _launch_spy(monkeypatch, record) -> list:
    """``record(meta, constexprs)`` of each forward launch, in order."""
    from flexcore.kernels import forward as fwd

    seen = []
    real = fwd.launch

    def spy(kernel, grid, args, bm, bn, meta, constexprs, **kw):
        seen.append(record(meta, constexprs))
        return real(kernel, grid, args, bm, bn, meta, constexprs, **kw)

    monkeypatch.setattr(fwd, "launch", spy)
    return seen


def _path_spy(monkeypatch):
    """Record (DENSE, FULL_RUNS) of each forward launch."""
    return _launch_spy(monkeypatch, lambda meta, constexprs: (constexprs["DENSE"], constexprs["FULL_RUNS"]))


def _ws_spy(monkeypatch) -> list:
    """WARP_SPEC of each forward launch's configuration (False where the configuration has none)."""
    return _launch_spy(monkeypatch, lambda meta, constexprs: meta.get("WARP_SPEC", False))


@pytest.mark.parametrize("mod_name,layout", [("noop", "contiguous"), ("softcap", "contiguous"),
                                             ("relative_table", "contiguous"), ("noop", "strided"),
                                             ("noop", "heads_inner")])
# relative_table reads a captured tensor inside the loop: never warp-specialized (docs/decisions.md#dense-warp-specialization).
def test_warp_specialized_dense_path_reads_q_rows(monkeypatch, mod_name, layout):
    """The warp-specialized dense loop reads Q through one descriptor over all its rows (under the
    interpreter the loop itself runs unspecialized). At L=150, tiles of the last query rows of a
    head overlap the next head's rows; their outputs must not be stored. "strided": batch and head
    strides padded but multiples of the row stride, still eligible; "heads_inner": (B, L, H, D)
    memory viewed as (B, H, L, D), whose head stride is not a multiple of the row stride, takes the
    pointer path."""
    from flexcore.kernels import forward as fwd

    opts = policy_options(forward={"tma": "on", "warp_spec": "on"})
    seen = _ws_spy(monkeypatch)
    shape = Shape("ragged_gqa", B=2, Hq=4, Hkv=2, L=150, S=200, D=32, Dv=32, block=32)
    q, k, v, score_mod, bm = make_case(shape, mod_name, torch.bfloat16, seed_of("ws", mod_name, layout), DEVICE)
    if layout == "strided":
        q = torch.zeros(2, 5, 160, 32, dtype=q.dtype)[:, :4, :150].copy_(q)
    elif layout == "heads_inner":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True,
                              kernel_options=opts)
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, f"ws/{mod_name}/{layout}")
    assert seen == [layout != "heads_inner" and mod_name != "relative_table"]
    rows = fwd.q_rows_descriptor(q, True)
    assert rows == {"contiguous": 2 * 4 * 150, "strided": 5 * 160 + 3 * 160 + 150, "heads_inner": 0}[layout]


def test_block_paths_are_chosen_from_the_tables():
    from flexcore.attention import kv_blocks

    def causal(b, h, q, kv):
        return q >= kv

    cases = {  # mask: (all full, full blocks in one run per row)
        "noop": (lambda b, h, q, kv: q >= 0, True, True),
        "causal": (causal, False, True),
        "stripes": (make_mods("stripes", CPU_SHAPES[3], "cpu")[1], False, False),  # 32-wide stripes
        "empty": (lambda b, h, q, kv: q < 0, False, True),  # nothing listed: trivially runs
    }
    for name, (mask_mod, dense, runs) in cases.items():
        bm = create_block_mask(mask_mod, None, None, 100, 200, device="cpu", BLOCK_SIZE=32)
        blocks = kv_blocks(bm, 2, 3)
        assert blocks.all_full(4, 7) is dense, name
        assert blocks.full_runs(4) is runs, name
    # A mask whose rows list every block, but one row lists one as partial: not dense.
    bm = create_block_mask(lambda b, h, q, kv: (q >= 0) & ((q > 0) | (kv > 0)), None, None, 100, 200,
                           device="cpu", BLOCK_SIZE=32)
    assert not kv_blocks(bm, 1, 1).all_full(4, 7)
    assert kv_blocks(bm, 1, 1).full_runs(4)  # row 0 lists blocks 1..6 as full: one run


@pytest.mark.parametrize("mod_name", ["noop", "softcap", "causal", "prefix_lm", "document", "stripes"])
@pytest.mark.parametrize("paths", ["chosen", "tables"])
def test_dense_run_and_table_paths_match_reference(monkeypatch, mod_name, paths):
    """All-full masks take the dense loop, masks whose full blocks are consecutive step over them
    without reading indices, the rest read one index per tile; each against the float64 reference,
    at ragged lengths with GQA (the last key block is short)."""
    opts = policy_options(forward={"dense": False, "full_runs": False}) if paths == "tables" else None
    seen = _path_spy(monkeypatch)
    shape = Shape("ragged_gqa", B=2, Hq=4, Hkv=2, L=150, S=200, D=32, Dv=32, block=32)
    check_forward(shape, mod_name, torch.float32, seed=seed_of("paths", mod_name, paths), kernel_options=opts)
    chosen = {"noop": (True, False), "softcap": (True, False), "stripes": (False, False)}
    expected = (False, False) if paths == "tables" else chosen.get(mod_name, (False, True))
    assert seen == [expected]


def test_the_lightened_interpreter_gives_the_same_bits_as_triton_s_own(tmp_path):
    """flexcore drops the interpreter's int32 overflow checks and its re-patching per helper call
    (flexcore._runtime._lighten_interpreter): forward and gradients are bit for bit those of the
    interpreter as Triton ships it (FLEXLAB_INTERPRETER_AS_IS=1, in a fresh process)."""
    from triton.runtime import interpreter

    script = (
        "import os, sys, torch\n"
        "from flexcore import create_block_mask, flex_attention\n"
        "from triton.runtime import interpreter\n"
        "g = torch.Generator().manual_seed(int(sys.argv[1]))\n"
        "q, k, v = (torch.randn(1, 2, 100, 16, generator=g, requires_grad=True) for _ in range(3))\n"
        "bm = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < 70), None, None, 100, 100,\n"
        "                       BLOCK_SIZE=32)\n"
        "out = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j), block_mask=bm)\n"
        "out.sum().backward()\n"
        "print(interpreter.interpreter_builder.options.sanitize_overflow)\n"
        "torch.save([out.detach(), q.grad, k.grad, v.grad], sys.argv[2])\n"
    )
    seed = str(torch.randint(0, 2**31 - 1, ()).item())
    runs = {}
    for as_is in ("0", "1"):
        path = tmp_path / f"as_is{as_is}.pt"
        stdout = _run_without_gpu(script, seed, str(path), FLEXLAB_INTERPRETER_AS_IS=as_is)
        runs[as_is] = (stdout.split()[-1], torch.load(path))
    assert runs["0"][0] == "False" and runs["1"][0] == "True"  # the overflow check: off, and as shipped
    for name, a, b in zip(("out", "dq", "dk", "dv"), runs["0"][1], runs["1"][1]):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max()}"
    # This process runs the lightened interpreter too.
    from flexcore._runtime import prepare_triton

    prepare_triton()
    assert interpreter.interpreter_builder.options.sanitize_overflow is False


HEAD_BIAS = torch.tensor([0.3, -0.2])
PART_OF_TILE_MODS = {
    "constant": lambda score, b, h, q_idx, kv_idx: torch.full_like(score, 0.5),
    "zeros_like": lambda score, b, h, q_idx, kv_idx: torch.zeros_like(score),
    "row": lambda score, b, h, q_idx, kv_idx: q_idx.float() * 0.01,
    "column": lambda score, b, h, q_idx, kv_idx: kv_idx.float() * 0.05,
    "head": lambda score, b, h, q_idx, kv_idx: HEAD_BIAS[h],
    "head_times_score": lambda score, b, h, q_idx, kv_idx: score * HEAD_BIAS[h],
}


@pytest.mark.parametrize("L", [64, 8], ids=["forward", "decode"])
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("name", list(PART_OF_TILE_MODS))
def test_score_mods_of_part_of_the_tile(name, mask, L):
    """A score_mod whose value is one per row, column or head, or a constant, is the score of
    every position of the tile (the kernels reduce tiles along both axes; full blocks apply no
    mask that would broadcast it): forward and gradients against float64."""
    score_mod = PART_OF_TILE_MODS[name]
    gen = torch.Generator().manual_seed(seed_of("part_of_tile", name, mask, L))
    S = 64
    q = torch.randn(1, 2, L, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 16, generator=gen, requires_grad=True) for _ in range(2))
    bm = None
    if mask == "causal":
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + (S - L) >= kv_idx, None, None, L, S,
                               device=DEVICE, BLOCK_SIZE=32)
    weights = torch.randn(1, 2, L, 16, generator=gen)
    results = []
    for fn in (flex_attention, flex_attention_reference):
        out = fn(q, k, v, score_mod=score_mod, block_mask=bm)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v), allow_unused=True,
                                    materialize_grads=True)
        results.append((out, grads))
    (out, grads), (gold, gold_grads) = results
    assert rel_err(out, gold) < 1e-5
    for got, expected in zip(grads, gold_grads):
        assert rel_err(got, expected) < 1e-4


@pytest.mark.parametrize("q_shape, kv_shape", [((0, 4, 3, 16), (0, 2, 40, 16)),
                                                ((2, 4, 0, 16), (2, 2, 40, 16)),
                                                ((2, 4, 0, 16), (1, 2, 40, 16))])
def test_calls_without_rows_return_empty_results(q_shape, kv_shape):
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from flexcore import AuxRequest

    q = torch.randn(q_shape, requires_grad=True)
    k, v = (torch.randn(kv_shape, requires_grad=True) for _ in range(2))
    sinks = torch.zeros(q_shape[1], requires_grad=True)
    slopes = torch.rand(q_shape[1], requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, q_shape[2],
                             kv_shape[2], device="cpu") if q_shape[2] else None
    out, aux = flex_attention(q, k, v, score_mod=alibi, block_mask=mask, enable_gqa=True, sinks=sinks,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    assert out.shape == (*q_shape[:3], kv_shape[3]) and out.dtype == q.dtype
    assert aux.lse.shape == aux.max_scores.shape == q_shape[:3] and aux.lse.dtype == torch.float32
    want, want_lse = flex_attention_reference(q, k, v, score_mod=alibi, block_mask=mask, enable_gqa=True,
                                              sinks=sinks, return_lse=True)
    assert want.shape == out.shape and want_lse.shape == aux.lse.shape
    if q_shape[0] == kv_shape[0]:  # torch's own call (which has no key/value batch of 1 without a mask)
        got = torch_flex(q.detach(), k.detach(), v.detach(), enable_gqa=True)
        assert got.shape == out.shape
    # Values reach no row: zero gradients for q, k, v and the sinks, as a backward of the rows gives.
    (out.sum() + aux.lse.sum()).backward()
    for t in (q, k, v, sinks):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()
    # The same under torch.compile, with no graph break.
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True), fullgraph=True,
                             backend="aot_eager")
    assert compiled(q, k, v).shape == out.shape


def test_calls_without_keys_heads_or_head_dims_are_refused():
    for q_shape, kv_shape in [((1, 2, 3, 8), (1, 2, 0, 8)), ((1, 0, 3, 8), (1, 0, 10, 8)),
                              ((1, 2, 3, 0), (1, 2, 10, 0))]:
        with pytest.raises(InputError, match=r"empty input: query \(.*every call needs keys"):
            flex_attention(torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape))
    # A call without rows still gets the checks of a call with them.
    q, kv = torch.randn(0, 2, 3, 8), torch.randn(0, 2, 10, 8)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 4, 10, device="cpu")
    with pytest.raises(InputError, match=r"built for lengths \(Q_LEN, KV_LEN\) = \(4, "):
        flex_attention(q, kv, kv, block_mask=mask)
    with pytest.raises(InputError, match="unknown kernel_options"):
        flex_attention(q, kv, kv, kernel_options={"bogus": 1})
    with pytest.raises(InputError, match="share a dtype"):
        flex_attention(q, kv.double(), kv)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_by_name(transform):
    """torch.func's wrapped tensors (grad, vmap) get an error naming the argument and the way out,
    not a failure inside the lowering (a captured tensor's index check)."""
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    bias = torch.randn(2, 32)

    def loss(q):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h, ki]).sum()

    flex_attention(q, k, v)  # an eager call of the same shapes first: its kept call is not reused
    call = torch.func.grad(loss) if transform == "grad" else torch.func.vmap(loss)
    with pytest.raises(InputError, match="query is a tensor of a torch.func transform"):
        call(q if transform == "grad" else q.unsqueeze(0))
