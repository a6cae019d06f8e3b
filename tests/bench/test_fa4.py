"""FlashAttention-4 providers: flash4 (flash_attn.cute.flash_attn_func) and torch_flex_flash (torch
flex with BACKEND=FLASH). On the CPU: clear reasons, the runner's skipped rows, and how each variant
maps to FA4's arguments. On a GPU (-m gpu): both against the float64 reference."""
from __future__ import annotations

import json

import pytest
import torch

from bench import providers as prov
from bench.context import make_context
from bench.grid import Case, Settings
from tests.bench.helpers import CAUSAL, small_grid

CPU = torch.device("cpu")
FA4_PROVIDERS = ("flash4", "torch_flex_flash")


def _ctx(variant, q_len=64, kv_len=64, head_dim=64, v_head_dim=None, dtype="bfloat16", pass_="fwd",
         heads=(4, 2)):
    case = Case(variant, 1, heads[0], heads[1], q_len, kv_len, head_dim, v_head_dim or head_dim, dtype,
                pass_)
    return make_context(case, Settings(), CPU, n_sets=1)


def _fa4_arguments(variant, major=9, **kw):
    return prov.get("flash4").arguments(_ctx(variant, **kw), "FA4", major)


# ---- availability on the CPU --------------------------------------------------------------------


def test_both_fa4_providers_say_why_they_cannot_run_on_the_cpu():
    avail = prov.availability(CPU, FA4_PROVIDERS)
    assert avail["flash4"] == (False, "FlashAttention-4 needs a CUDA GPU (Hopper or Blackwell)")
    ok, why = avail["torch_flex_flash"]
    assert not ok and "GPU" in why


def test_the_runner_records_the_reasons_as_skipped_rows(tmp_path):
    from bench import runner

    grid = small_grid(providers=("sdpa_math", *FA4_PROVIDERS), variants=[CAUSAL], passes=("fwd",))
    rows = json.loads(runner.run(grid, tmp_path / "r", device=CPU, progress=False,
                                 log=lambda m: None).read_text())["rows"]
    for name in FA4_PROVIDERS:
        mine = [r for r in rows if r["provider"] == name]
        assert [(r["metric"], r["status"]) for r in mine] == [("status", "skipped")], name
        assert "GPU" in mine[0]["note"], name
    assert any(r["provider"] == "sdpa_math" and r["metric"] == "time_ms" for r in rows)


def test_fa4_providers_are_in_the_anchors_grid():
    from bench.grid import build_grid, load_config

    grid = build_grid(load_config("anchors"), "anchors")
    assert {"flash4", "torch_flex_flash"} <= set(grid.providers)
    # The command line narrows the anchors grid to these providers, variants and one length.
    small = build_grid(load_config("anchors"), "anchors", providers=list(FA4_PROVIDERS),
                       variants=["causal", "sliding_window(window_size=1024)"], passes=["fwd", "fwd_bwd"],
                       overrides={"batch": [1], "seq": [16384]})
    assert small.providers == list(FA4_PROVIDERS)
    assert sorted({(c.variant, c.q_len, c.pass_) for c in small.cases}) == [
        ("causal", 16384, "fwd"), ("causal", 16384, "fwd_bwd"),
        ("sliding_window(window_size=1024)", 16384, "fwd"),
        ("sliding_window(window_size=1024)", 16384, "fwd_bwd")]


# ---- how variants map to flash_attn.cute.flash_attn_func --------------------------------------


def test_masks_map_to_causal_and_window_size():
    assert _fa4_arguments("noop") == ({}, [])
    assert _fa4_arguments("causal") == ({"causal": True}, ["causal"])
    # A window of 16 keys: the query's own key and the 15 before it.
    kwargs, _ = _fa4_arguments("sliding_window(window_size=16)")
    assert kwargs == {"causal": True, "window_size": (15, 0)}
    # Decoding: the one query sits at the end of the keys, FA4's bottom-right alignment.
    kwargs, _ = _fa4_arguments("sliding_window(window_size=16)", q_len=1, kv_len=100, pass_="decode")
    assert kwargs == {"causal": True, "window_size": (15, 0)}


def test_softcap_maps_to_its_argument():
    kwargs, notes = _fa4_arguments("softcap_causal(softcap=30)")
    assert kwargs["causal"] is True and kwargs["softcap"] == pytest.approx(30.0)
    assert notes == ["causal", "softcap=30"]


@pytest.mark.parametrize("variant, match", [
    ("alibi_causal", "softcap only"),
    ("document(num_documents=2)", "no mask, causal and causal sliding window only"),
    ("prefix_lm(prefix_fraction=0.25)", "no mask, causal and causal sliding window only"),
])
def test_variants_fa4_cannot_express_are_refused_with_the_reason(variant, match):
    with pytest.raises(prov.Unsupported, match=match):
        _fa4_arguments(variant)


def test_top_left_causal_with_unequal_lengths_is_refused():
    with pytest.raises(prov.Unsupported, match="bottom-right.*Q_LEN=32 != KV_LEN=64"):
        _fa4_arguments("causal", q_len=32, kv_len=64)


@pytest.mark.parametrize("kw, major, match", [
    ({"dtype": "float32"}, 9, "float16/bfloat16, not float32"),
    ({"head_dim": 512}, 9, r"Hopper takes head dims 8..256, not \(D, Dv\)=\(512, 512\)"),
    ({"head_dim": 60}, 9, r"multiples of 8, not \(D, Dv\)=\(60, 60\)"),
    ({"head_dim": 160}, 10, r"Blackwell takes head dims .*not \(D, Dv\)=\(160, 160\)"),
    ({}, 8, r"Hopper \(sm_90\) and Blackwell \(sm_100/sm_110\) GPUs, not compute capability 8.x"),
    ({}, None, "needs a CUDA GPU"),
])
def test_dtypes_head_dims_and_gpus_fa4_does_not_take_are_refused(kw, major, match):
    with pytest.raises(prov.Unsupported, match=match):
        _fa4_arguments("causal", major=major, **kw)


def test_fa4_input_rule():
    assert prov.fa4_input_reason("bfloat16", 256, 256, 9) is None
    assert prov.fa4_input_reason("float16", 64, 64, 9) is None
    assert prov.fa4_input_reason("bfloat16", 128, 128, 10) is None
    assert prov.fa4_input_reason("bfloat16", 192, 128, 10) is None
    assert prov.fa4_input_reason("bfloat16", 256, 256, 10) is None
    assert prov.fa4_input_reason("bfloat16", 192, 192, 10) is not None
    assert prov.fa4_input_reason("bfloat16", 264, 264, 9) is not None


def test_flash_attn_keeps_alibi_for_fa2_only():
    """The FA2/FA3 provider shares the mapping: ALiBi becomes alibi_slopes under FA2 alone."""
    ctx = _ctx("alibi_causal")
    kwargs, notes = prov.get("flash_attn").arguments(ctx, "FA2", None)
    assert kwargs["causal"] is True and kwargs["alibi_slopes"].shape == (4,) and "alibi_slopes" in notes
    with pytest.raises(prov.Unsupported, match="FA2, with causal"):
        prov.get("flash_attn").arguments(ctx, "FA3", None)


def test_torch_flex_flash_refuses_before_compiling_off_the_gpu():
    with pytest.raises(prov.Unsupported, match="needs a CUDA GPU"):
        prov.get("torch_flex_flash").prepare(_ctx("causal"))


# ---- torch's FLASH refusals become "unsupported" rows -----------------------------------------


class _CompileError(Exception):
    """Stands in for the wrapper torch.compile raises around a lowering's error."""


def _wrapped(inner: BaseException) -> _CompileError:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise _CompileError(f"backend='inductor' raised:\n{type(exc).__name__}: {exc}") from exc
    except _CompileError as outer:
        return outer


def test_flash_backend_refusals_are_recognised_with_torchs_reason():
    reason = "BACKEND='FLASH' but flash attention cannot be used: Input buffers require gradients"
    assert prov.flash_backend_refusal(_wrapped(RuntimeError(reason + "\nmore"))) == reason
    nyi = _wrapped(NotImplementedError("Flash attention with block mask but without full blocks"))
    assert prov.flash_backend_refusal(nyi) == ("NotImplementedError: Flash attention with block mask "
                                               "but without full blocks")
    # The same text in a message whose chain was lost.
    lost = RuntimeError("InductorError: NotImplementedError: dLSE is not supported\nTraceback")
    assert prov.flash_backend_refusal(lost) == "NotImplementedError: dLSE is not supported"
    assert prov.flash_backend_refusal(_wrapped(RuntimeError("CUDA error: an illegal memory access"))) is None


# ---- on a GPU: both providers against the float64 reference -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name, variant, head_dim", [
    ("flash4", "causal", 128),
    ("torch_flex_flash", "causal", 128),
    ("flash4", "sliding_window(window_size=256)", 64),
    ("flash4", "softcap_causal(softcap=30)", 128),
])
def test_fa4_providers_match_the_float64_reference(name, variant, head_dim):
    """Forward and gradients of a GQA case (8 query heads on 2 KV heads, 1000 tokens: not a tile
    multiple) against the float64 reference, within 2x torch's own bf16 error."""
    from flexcore.reference import flex_attention_reference
    from flexcore.testing import assert_close_to_reference

    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device (run them with -m gpu on the GPU machine)")
    device = torch.device("cuda")
    ok, why = prov.get(name).available(device)
    if not ok:
        pytest.skip(f"{name} does not run here: {why}")
    case = Case(variant, 2, 8, 2, 1000, 1000, head_dim, head_dim, "bfloat16", "fwd_bwd")
    ctx = make_context(case, Settings(), device, n_sets=1)
    prepared = prov.get(name).prepare(ctx)
    q, k, v = (torch.randn(2, h, 1000, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 2, 2))
    dout = torch.randn(2, 8, 1000, head_dim, device=device, dtype=torch.bfloat16)
    out = prepared.call(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def reference(upcast):
        inputs = [t.detach().double().requires_grad_() if upcast else t.detach().requires_grad_()
                  for t in (q, k, v)]
        ref = flex_attention_reference(*inputs, score_mod=ctx.mods.score_mod,
                                       block_mask=ctx.flex_block_mask(), enable_gqa=True, upcast=upcast)
        return ref, torch.autograd.grad(ref, inputs, dout.to(ref.dtype))

    golden, golden_grads = reference(True)
    baseline, baseline_grads = reference(False)
    assert_close_to_reference(out, golden, baseline, name=f"{name} {variant} out")
    for label, got, gold, base in zip(("dq", "dk", "dv"), grads, golden_grads, baseline_grads):
        assert_close_to_reference(got, gold, base, name=f"{name} {variant} {label}")
