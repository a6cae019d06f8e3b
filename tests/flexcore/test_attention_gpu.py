"""The forward matrix on a CUDA GPU, at S up to 8192 (run with `-m gpu` on the device)."""
from __future__ import annotations

import pytest
import torch

from tests.flexcore.cases import GPU_SHAPES, MOD_NAMES, Shape
from tests.flexcore.compare import seed_of
from tests.flexcore.policies import policy_options
from tests.flexcore.helpers import (backward_tables_spy, case_mods, check_backward, check_call, check_forward,
                                   forward_tables_spy)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


# fp32 at the smaller shapes only: at the larger ones the fp64 reference dominates the run time.
_FORWARD_CASES = [pytest.param(shape, dtype, id=f"{name}-{shape.name}")
                  for shape in GPU_SHAPES
                  for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32"))
                  if dtype != torch.float32 or shape.L * shape.S <= 2048 * 2048]


@pytest.mark.parametrize("shape, dtype", _FORWARD_CASES)
@pytest.mark.parametrize("mod_name", MOD_NAMES)
def test_forward_gpu(shape, mod_name, dtype):
    # Autotuning compiles every candidate config; one shape keeps it on, the rest use the first
    # candidate so the matrix compiles in minutes.
    options = None if shape.name == "gpu_1k" else {"autotune": False}
    check_forward(shape, mod_name, dtype, seed=seed_of(mod_name, shape.name, str(dtype)),
                  kernel_options=options, device="cuda")


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", MOD_NAMES)
def test_forward_longest_first_gpu(monkeypatch, shape, mod_name):
    # Every mask through the longest-first launch (by default only rows of 8+ blocks take it).
    options = policy_options(None if shape.name == "gpu_1k" else {"autotune": False},
                             forward={"schedule_min_blocks": 0.0})
    check_forward(shape, mod_name, torch.bfloat16, seed=seed_of("order", mod_name, shape.name),
                  kernel_options=options, device="cuda")


@pytest.mark.parametrize("shape", [GPU_SHAPES[0], GPU_SHAPES[1], GPU_SHAPES[2]], ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", MOD_NAMES)
def test_forward_table_path_gpu(monkeypatch, shape, mod_name):
    # Full blocks read one index per tile (the path of masks whose full blocks are not one run;
    # the matrix above takes the dense and run paths wherever they apply).
    options = policy_options(None if shape.name == "gpu_1k" else {"autotune": False},
                             forward={"dense": False, "full_runs": False})
    check_forward(shape, mod_name, torch.bfloat16, seed=seed_of("tables", mod_name, shape.name),
                  kernel_options=options, device="cuda")


_RAGGED_128 = Shape("gpu_ragged128", B=2, Hq=4, Hkv=2, L=1000, S=1531, D=128, Dv=128, block=128)


@pytest.mark.parametrize("shape", [GPU_SHAPES[0], GPU_SHAPES[2], GPU_SHAPES[5], _RAGGED_128],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", ["noop", "softcap", "relative_table"])
def test_forward_warp_specialized_dense_gpu(monkeypatch, shape, mod_name):
    # Only the warp-specialized candidates on the dense path (the autotuner may or may not pick
    # them otherwise): masks whose blocks are all full, with and without a score_mod, ragged
    # lengths with GQA (tiles overlapping the next head's query rows). A score_mod that reads a
    # captured tensor (relative_table) keeps the unspecialized loop: under warp specialization
    # its results were wrong. The Gluon kernel (flexcore.kernels.hopper), which would serve noop
    # at head dim 128 on Hopper, is switched off: this tests the template. The loops read Q through
    # a descriptor: TMA at every size.
    from flexcore.kernels import forward as fwd

    opts = policy_options(forward={"warp_spec": "on", "tma_min_flops": 0}, gluon={"dense": "off"})
    seen = []
    real = fwd._launcher

    def spy(*args, **kwargs):
        kernel, meta = real(*args, **kwargs)
        seen.append(meta.get("WARP_SPEC", False))
        return kernel, meta

    monkeypatch.setattr(fwd, "_launcher", spy)
    check_forward(shape, mod_name, torch.bfloat16, seed=seed_of("ws", mod_name, shape.name), device="cuda",
                  kernel_options=opts)
    assert seen == [mod_name != "relative_table"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_forward_stripes_gpu(dtype):
    # Full blocks 0, 2, 4, ...: not one run, so the table path, with autotuning, ragged lengths.
    shape = Shape("stripes", B=2, Hq=8, Hkv=2, L=1500, S=2000, D=128, Dv=128, block=128)
    check_forward(shape, "stripes", dtype, seed=seed_of("stripes", str(dtype)), device="cuda")


def test_longest_first_order_in_cuda_graphs():
    # A capture cannot read the costs back: it launches in the natural order. Once an eager call
    # computed the order, a capture reads it, and the order lives as long as the mask does.
    import flexcore.attention as attention
    from flexcore import create_block_mask, flex_attention

    def causal(b, h, i, j):
        return i >= j

    gen = torch.Generator(device="cuda").manual_seed(11)
    B, H, S, D = 2, 4, 2048, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    for eager_first in (False, True):
        bm = create_block_mask(causal, None, None, S, S, device="cuda")
        if eager_first:
            flex_attention(q, k, v, block_mask=bm)
            _, orders = attention._schedules[bm]  # (mask version, order per launch key)
            assert any(order is not None for order in orders.values())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the kernel's compile and autotuning, off the graph
            flex_attention(q, k, v, block_mask=create_block_mask(causal, None, None, S, S, device="cuda"))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flex_attention(q, k, v, block_mask=bm)
        attention._views_cache.clear()  # the views go; the mask keeps its orders
        torch.cuda.empty_cache()
        graph.replay()
        # Program order does not change any program's arithmetic: bit-identical to eager.
        assert torch.equal(out, flex_attention(q, k, v, block_mask=bm)), eager_first


@pytest.mark.parametrize("D", [64, 128])
def test_direct_launches_gpu(monkeypatch, D):
    # After warm-up, a training step and a decoding step launch every kernel directly (no call of
    # triton's JITFunction.run), with results bit-identical to launches through triton; a
    # misaligned input specialises anew, through triton, and still matches the float64 reference.
    import triton.runtime.jit as jit

    from flexcore import create_block_mask, flex_attention
    from flexcore.kernels import launch
    from tests.flexcore.compare import assert_matches_reference

    gen = torch.Generator(device="cuda").manual_seed(seed_of("direct", D))
    B, H, S = 2, 4, 1024
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    q_dec = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    slopes = torch.rand(H, device="cuda", generator=gen)

    def alibi(score, b, h, i, j):
        return score - slopes[h] * (i - j).abs()

    def causal(b, h, i, j):
        return i >= j

    def step(q, opts=None):
        bm = create_block_mask(causal, None, None, S, S, device="cuda")
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = flex_attention(qq, kk, vv, score_mod=alibi, block_mask=bm, kernel_options=opts)
        grads = torch.autograd.grad(out, (qq, kk, vv), do)
        dec = flex_attention(q_dec, k, v, score_mod=alibi, kernel_options=opts)
        return (out.detach(), *grads, dec)

    through_triton = step(q, policy_options(launch={"direct": False}))
    monkeypatch.setattr(launch, "_direct", {})
    step(q), step(q)  # tuning, then one launch through triton per specialisation
    calls = []
    real_run = jit.JITFunction.run

    def counting_run(self, *args, **kwargs):
        calls.append(self.__name__)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "run", counting_run)
    direct = step(q)
    assert calls == [], calls
    for a, b in zip(direct, through_triton):
        assert torch.equal(a, b)

    misaligned = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    assert misaligned.data_ptr() % 16
    bm = create_block_mask(causal, None, None, S, S, device="cuda")
    out, lse = flex_attention(misaligned, k, v, score_mod=alibi, block_mask=bm, return_lse=True)
    assert "flex_forward_kernel" in calls
    assert_matches_reference(q, k, v, alibi, bm, out, lse, "misaligned query")


_PLAN_SHAPE = Shape("plans_1k", B=2, Hq=4, Hkv=4, L=1024, S=1024, D=128, Dv=128, block=128)
PLAN_CASES = [
    (_PLAN_SHAPE, "causal", "temperature"),   # partial blocks, a captured gradient (atomics)
    (_PLAN_SHAPE, "causal", "alibi_slope"),   # a captured gradient with the delta pass
    (_PLAN_SHAPE, "document", None),          # host descriptors (K/V rows), short rows
    (_PLAN_SHAPE, "noop", None),              # dense path
    (_PLAN_SHAPE, "softcap", None),           # dense, warp-specialized where the GPU allows
    (Shape("plans_d64", B=1, Hq=4, Hkv=4, L=2048, S=2048, D=64, Dv=64, block=128), "sliding_window", None),
    (GPU_SHAPES[1], "alibi", None),           # ragged lengths, D=64
    (GPU_SHAPES[2], "causal", None),          # GQA
]


@pytest.mark.parametrize("shape,mod_name,learnable", PLAN_CASES,
                         ids=[f"{c[0].name}-{c[1]}-{c[2]}" for c in PLAN_CASES])
def test_plans_gpu(monkeypatch, decided, shape, mod_name, learnable):
    # Per-call plans on compiled kernels: once the autotuner and the layout tuner have chosen (two
    # calls at most), repeated training steps with fresh inputs and captured tensors updated in
    # place run the plans and match the float64 reference; a plan's out, dq, dk and dv are
    # bit-identical to the full path's for the same inputs (the same compiled kernels).
    from flexcore.kernels import launch

    gen = torch.Generator().manual_seed(seed_of("plans_gpu", shape.name, mod_name, learnable))
    score_mod, gold_mod, caps, caps64, bm, refill = case_mods(shape, mod_name, learnable, gen, "cuda")

    # Descriptors at every size, so that the host-descriptor and warp-specialized cases keep them.
    descriptors = {"tma_min_flops": 0}

    def call(what, generator=gen, opts=policy_options(forward=descriptors)):
        return check_call(shape, torch.bfloat16, generator, score_mod, gold_mod, caps, caps64, bm,
                           what, device="cuda", kernel_options=opts)

    for i in range(2):
        call(f"call {i}")
        refill()
    after_tuning = dict(decided)
    assert 1 <= after_tuning["forward"] <= 2 and 1 <= after_tuning["backward"] <= 2, after_tuning
    assert any("forward" in key for key in launch._plans) and any("backward" in key for key in launch._plans)
    for i in range(2, 4):
        call(f"call {i}")
        refill()
    assert decided == after_tuning, decided  # the later calls ran the plans
    seed = seed_of("plans_gpu_same", shape.name, mod_name)
    planned = call("plan", torch.Generator().manual_seed(seed))
    full = call("full path", torch.Generator().manual_seed(seed),
                policy_options(forward=descriptors, launch={"plans": False}))
    for name, a, b in zip(["out", "dq", "dk", "dv"], planned, full):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("shape", [GPU_SHAPES[0], GPU_SHAPES[1], GPU_SHAPES[2], _RAGGED_128],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", ["document", "causal", "and_or", "alibi"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_forward_finer_tables_gpu(monkeypatch, shape, mod_name, dtype):
    # Every mask over 64x64 tables (the policy's forward.refine; by default only masks whose
    # partial blocks hide enough empty and full sub-blocks take them), ragged lengths, GQA, D=64.
    from flexcore.kernels import forward as fwd

    seen = forward_tables_spy(monkeypatch)
    monkeypatch.setattr(fwd, "_launcher", _pinned_launcher(fwd))
    check_forward(shape, mod_name, dtype, seed=seed_of("finer", mod_name, shape.name, str(dtype)), device="cuda",
                  kernel_options=policy_options(forward={"refine": "on"}))
    assert seen == [(64, 64)]


def _pinned_launcher(fwd):
    """fwd._launcher with autotuning off, so that every launch goes through fwd.launch (the spy)."""
    real = fwd._launcher

    def launcher(module, head_dim_pad, dtype, sparse, opts, *args, **kwargs):
        import dataclasses
        return real(module, head_dim_pad, dtype, sparse, dataclasses.replace(opts, autotune=False), *args, **kwargs)

    return launcher


def test_anchors_masks_take_finer_tables_by_the_rule_gpu():
    # The anchors' document mask (8 documents, causal) takes the 64x64 tables at 4096 (where the
    # template serves it) and at 16384 (where the Gluon kernel would, but its rows are skewed); the
    # sliding window keeps its own at 16384 (the Gluon kernel, rows alike). Results against float64.
    from bench.mods import resolve
    from flexcore import create_block_mask, flex_attention
    from flexcore.attention import kv_blocks
    from flexcore.kernels import forward as fwd
    from flexcore.lowering import lower_mask_mod, lower_score_mod
    from flexcore.options import KernelOptions
    from tests.flexcore.compare import assert_matches_reference

    gen = torch.Generator(device="cuda").manual_seed(seed_of("finer", "anchors"))
    for spec, S, expected in (("document(num_documents=8)", 4096, True),
                              ("document(num_documents=8)", 16384, True),
                              ("sliding_window(window_size=1024)", 16384, False)):
        mods = resolve(spec, B=1, H=2, KV_HEADS=2, Q_LEN=S, KV_LEN=S, D=128, device="cuda")
        bm = create_block_mask(mods.mask_mod, 1, None, S, S, device="cuda")
        q, k, v = (torch.randn(1, 2, S, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        blocks = kv_blocks(bm, 1, 2)
        chosen = fwd.refined(blocks, q, k, v, lower_score_mod(None), lower_mask_mod(bm.mask_mod),
                             128 ** -0.5, KernelOptions())
        assert (chosen is not blocks) is expected, (spec, S)
        if S == 4096:
            out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
            assert_matches_reference(q, k, v, None, bm, out, lse, f"{spec} {S}")


@pytest.mark.parametrize("shape", [_RAGGED_128, GPU_SHAPES[1], GPU_SHAPES[2]], ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name,learnable", [("document", None), ("sliding_window", None),
                                                ("alibi", None), ("causal", "alibi_slope")])
def test_backward_finer_tables_gpu(monkeypatch, shape, mod_name, learnable):
    # The backward over the 64x64 tables (both kinds of program, 4-warp tiles), bf16, every
    # gradient against float64, ragged lengths, GQA, D=64 and 128. Refining is pinned on: the
    # default leaves grids that already fill the GPU (gpu_gqa) on the mask's own tables.
    seen = backward_tables_spy(monkeypatch)
    check_backward(shape, mod_name, torch.bfloat16, seed_of("finer", "bwd", mod_name, shape.name, learnable),
                   learnable=learnable, device="cuda",
                   kernel_options=policy_options(forward={"refine": "on"}))
    assert seen == [(64, 64)]


@pytest.mark.parametrize("L", [1024, 8], ids=["forward", "decode"])
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("name", ["constant", "row", "column", "head_times_score"])
def test_score_mods_of_part_of_the_tile_gpu(name, mask, L):
    """tests/flexcore/test_attention.py's part-of-the-tile score_mods on the GPU kernels (bf16,
    every block path the mask sends them to), forward and gradients against float64 with
    torch's own bf16 error as the tolerance."""
    from flexcore import create_block_mask, flex_attention
    from flexcore.reference import flex_attention_reference
    from flexcore.testing import assert_close_to_reference
    from tests.flexcore.test_attention import HEAD_BIAS, PART_OF_TILE_MODS

    head_bias = HEAD_BIAS.cuda()  # the CPU test's mod reads it on the CPU
    score_mod = PART_OF_TILE_MODS[name] if name != "head_times_score" else (
        lambda score, b, h, q_idx, kv_idx: score * head_bias[h])
    gen = torch.Generator(device="cuda").manual_seed(seed_of("part_of_tile_gpu", name, mask, L))
    S = 1024
    q = torch.randn(2, 2, L, 64, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, S, 64, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    bm = None
    if mask == "causal":
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + (S - L) >= kv_idx, None, None, L, S,
                               device="cuda")
    weights = torch.randn(2, 2, L, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    results = []
    for fn, upcast in ((flex_attention, None), (flex_attention_reference, True),
                       (flex_attention_reference, False)):
        kwargs = {} if upcast is None else {"upcast": upcast}
        out = fn(q, k, v, score_mod=score_mod, block_mask=bm, **kwargs)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v), allow_unused=True,
                                    materialize_grads=True)
        results.append((out, grads))
    (out, grads), (gold, gold_grads), (base, base_grads) = results
    assert_close_to_reference(out, gold, base, name="out", metric="rel_fro")
    for label, got, expected, baseline in zip("qkv", grads, gold_grads, base_grads):
        assert_close_to_reference(got, expected, baseline, name=f"d{label}", metric="rel_fro")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_captured_tensor_on_another_device_is_refused_gpu(compiled):
    """A score_mod reading a CPU tensor in a CUDA call: ModError naming it and both devices (the
    kernels would be given a host pointer)."""
    from flexcore import flex_attention
    from flexcore.errors import ModError

    torch._dynamo.reset()
    bias = torch.randn(2)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn = lambda q, k, v: flex_attention(q, k, v, score_mod=head_bias)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    # Compiled: raised while Dynamo runs the op on fake tensors, which wraps it in its own error.
    with pytest.raises(Exception) as info:
        fn(q, k, v)
    assert isinstance(info.value, ModError) != compiled, repr(info.value)
    assert "ModError" in repr(info.value) or not compiled
    assert "is on cpu, and the query on cuda:0: the kernels read it there" in str(info.value)
    assert compiled or str(info.value).startswith("in head_bias: bias is on cpu")
