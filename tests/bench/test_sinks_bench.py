"""Attention sinks (Mods.sinks) in the bench: flexcore providers apply them, torch flex_attention
renormalises its (out, lse), SDPA and FlashAttention providers refuse them, and the float64 golden
includes them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import variants
from bench import providers as prov
from bench import runner
from bench.context import make_context
from bench.grid import Case, Settings
from flexcore.reference import flex_attention_reference
from flexcore.sinks import apply_sinks
from tests.bench.helpers import CAUSAL, small_grid

#: One logit per query head, all different, so that a sink applied to the wrong head shows.
SINK_LOGITS = (1.5, -0.5, 0.75, 2.0)


def _sink_mods(B, H, Q_LEN, KV_LEN):
    mods = variants.get("gpt_oss_sinks").make(B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN,
                                              window_size=24, sink_logit=0.0)
    return dataclasses.replace(mods, sinks=torch.tensor(SINK_LOGITS[:H], requires_grad=True))


def _case_mods(case):
    return _sink_mods(case.batch, case.q_heads, case.q_len, case.kv_len)


def _by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


@pytest.fixture(scope="module")
def sink_run():
    grid = small_grid(providers=("flexlab", "sdpa_math"), variants=[CAUSAL])
    grid.cases[:] = [dataclasses.replace(c, variant="gpt_oss_sinks") for c in grid.cases]
    return grid, runner.run_grid(grid, mods=_case_mods, device="cpu")["rows"]


def test_gpt_oss_sinks_flexlab_rows_match_the_golden_with_sinks(sink_run):
    grid, rows = sink_run
    for case in grid.cases:
        mine = {r["metric"]: r for r in _by(rows, case_id=case.case_id, provider="flexlab")}
        assert mine["out_correct"]["value"] == 1, mine["out_correct"]
        assert "sinks" in mine["setup_s"]["note"]
        if case.pass_ == "fwd_bwd":
            # The sinks' gradient is compared too, and flexcore's reaches them.
            assert mine["dsinks_correct"]["value"] == 1, mine["dsinks_correct"]
            assert "no gradient reached" not in mine["dsinks_correct"]["note"]
        # SDPA math has no sinks: the same-dtype baseline is flexcore's eager reference.
        base = _by(rows, case_id=case.case_id, provider="baseline", metric="out_max_abs")
        assert base and base[0]["note"].startswith("flexcore.reference(upcast=False)")


def test_sdpa_refuses_sinks_with_a_reason(sink_run):
    grid, rows = sink_run
    for case in grid.cases:
        row = _by(rows, case_id=case.case_id, provider="sdpa_math", metric="status")
        assert row and row[0]["status"] == "unsupported" and "attention sinks" in row[0]["note"]


def _ctx(pass_="fwd", dtype="float32"):
    case = Case("gpt_oss_sinks", 2, 4, 2, 40, 72, 16, 16, dtype, pass_)
    return make_context(case, Settings(block_size=32), torch.device("cpu"), n_sets=1,
                        mods=_case_mods(case))


@pytest.mark.parametrize("name", ["sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn",
                                  "flash_attn", "flash4"])
def test_sdpa_and_flash_providers_refuse_sinks(name):
    ctx = _ctx(dtype="bfloat16")
    provider = prov.get(name)
    with pytest.raises(prov.Unsupported, match="sinks"):
        if isinstance(provider, prov.FlashAttnProvider):
            provider.arguments(ctx, "FA2", 9)  # refused before any GPU work
        else:
            provider.prepare(ctx)


def test_golden_includes_sinks_and_they_matter():
    ctx = _ctx()
    x = ctx.inputs[0]
    gold = ctx.golden()["out"][0]
    bm = ctx.slice_block_mask(ctx.slices()[0], ctx.mods)
    with_sinks = flex_attention_reference(x.q, x.k, x.v, block_mask=bm, enable_gqa=True,
                                          sinks=ctx.mods.sinks.detach())
    without = flex_attention_reference(x.q, x.k, x.v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(gold, with_sinks, rtol=1e-12, atol=1e-12)
    # Without the sinks the output differs far beyond any dtype's tolerance: a run that dropped
    # them would fail its rows.
    assert (gold - without).abs().max() > 0.05


def test_sliced_golden_uses_each_slices_heads_sinks():
    # Slices of one KV head: each must read its own query heads' sinks.
    case = Case("gpt_oss_sinks", 2, 4, 2, 40, 72, 16, 16, "float32", "fwd_bwd")
    ctx = make_context(case, Settings(block_size=32, ref_slices=2, ref_full_elements=1), torch.device("cpu"),
                       n_sets=1, mods=_case_mods(case))
    slices = ctx.slices()
    assert len(slices) == 2 and any(s.h0 != 0 for s in slices)
    x = ctx.inputs[0]
    full = flex_attention_reference(x.q.detach(), x.k.detach(), x.v.detach(),
                                    block_mask=ctx.flex_block_mask(), enable_gqa=True,
                                    sinks=ctx.mods.sinks.detach())
    gold = ctx.golden()
    for s, out in zip(slices, gold["out"]):
        torch.testing.assert_close(out, s.q_part(full), rtol=1e-12, atol=1e-12)
    assert [n for n, _ in ctx.learnable_named] == ["sinks"]
    assert gold["captured"][0].shape == (4,) and gold["captured"][0].abs().sum() > 0


def test_torch_flex_renormalised_output_matches_the_golden_with_sinks():
    # torch's flex_attention (eager on the CPU) with the renormalisation the torch_flex providers
    # apply, against float64 with sinks, within twice the same-dtype reference's error.
    from torch.nn.attention.flex_attention import create_block_mask

    from flexcore.testing import tolerance_check

    ctx = _ctx()
    x = ctx.inputs[0]
    c = ctx.case
    bm = create_block_mask(ctx.mods.mask_mod, None, None, c.q_len, c.kv_len, device="cpu", BLOCK_SIZE=32)
    with torch.no_grad():
        out = prov.flex_attention_with_sinks(x.q, x.k, x.v, ctx.mods.sinks, block_mask=bm,
                                             enable_gqa=True)
        plain = prov.flex_attention_with_sinks(x.q, x.k, x.v, torch.full((4,), -1e4),
                                               block_mask=bm, enable_gqa=True)
    res = tolerance_check(out, ctx.golden()["out"][0], ctx.reference_baseline()["out"][0])
    assert res.passed, res
    assert (out - plain).abs().max() > 0.05  # the sinks changed the output


def test_renormalisation_gives_the_sinks_gradient():
    # torch's flex_attention has no CPU backward: the same renormalisation on the same-dtype
    # reference's (out, lse) without sinks gives the golden's gradients with sinks.
    ctx = _ctx(pass_="fwd_bwd")
    x = ctx.inputs[0]
    gold = ctx.golden()
    q, k, v = (t.detach().requires_grad_(True) for t in (x.q, x.k, x.v))
    out, lse = flex_attention_reference(q, k, v, block_mask=ctx.flex_block_mask(), enable_gqa=True,
                                        upcast=False, return_lse=True)
    out = apply_sinks(out, lse, ctx.mods.sinks)[0]
    dq, d_sinks = torch.autograd.grad(out, [q, ctx.mods.sinks], ctx.correctness_dout())
    torch.testing.assert_close(out.double(), gold["out"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dq.double(), gold["dq"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d_sinks.double(), gold["captured"][0], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_torch_flex_providers_apply_sinks_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU")
    grid = small_grid(providers=("flexlab", "flexlab_compiled", "torch_flex"), variants=[CAUSAL])
    grid.cases[:] = [dataclasses.replace(c, variant="gpt_oss_sinks") for c in grid.cases]

    def mods(case):
        m = _case_mods(case)
        return dataclasses.replace(m, sinks=m.sinks.detach().cuda().requires_grad_(True),
                                   shape=dataclasses.replace(m.shape, device=torch.device("cuda")))

    rows = runner.run_grid(grid, mods=mods, device="cuda")["rows"]
    for case in grid.cases:
        for name in ("flexlab", "flexlab_compiled", "torch_flex"):
            mine = {r["metric"]: r for r in _by(rows, case_id=case.case_id, provider=name)}
            assert mine["out_correct"]["value"] == 1, (name, mine.get("out_correct"), mine.get("status"))
            if case.pass_ == "fwd_bwd":
                assert mine["dsinks_correct"]["value"] == 1, (name, mine["dsinks_correct"])
        note = _by(rows, case_id=case.case_id, provider="torch_flex", metric="time_ms")[0]["note"]
        setup = _by(rows, case_id=case.case_id, provider="torch_flex", metric="setup_s")[0]["note"]
        assert prov.TORCH_SINKS_NOTE in setup, (setup, note)


def test_train_step_applies_sinks_and_checks_their_gradient():
    from bench.grid import build_grid

    grid = build_grid({"providers": ["flexlab"],
                       "settings": {"compile_backend": "aot_eager", "cpu_reps": 1, "block_size": 64},
                       "groups": [{"variants": ["gpt_oss_sinks"], "shapes": [[1, 64]], "heads": [[2, 1]],
                                   "head_dim": [16], "dtype": ["float32"], "passes": ["train_step"]}]},
                      "train")
    rows = runner.run_grid(grid, mods=_case_mods, device="cpu")["rows"]
    mine = {r["metric"]: r for r in _by(rows, provider="flexlab")}
    for key in ("out", "dx", "dparams", "dsinks"):
        assert mine[f"{key}_correct"]["value"] == 1, (key, mine.get(f"{key}_correct"), mine.get("status"))
    assert _by(rows, provider="baseline", metric="dsinks_max_abs")  # the tolerance's source


def test_a_spec_string_keeps_the_variants_sinks():
    from bench.mods import VariantError, resolve

    shape = dict(B=1, H=4, KV_HEADS=4, Q_LEN=64, KV_LEN=64, D=16, device="cpu")
    mods = resolve("gpt_oss_sinks", **shape)
    assert mods.sinks is not None and tuple(mods.sinks.shape) == (4,)
    assert resolve("causal", **shape).sinks is None
    with pytest.raises(VariantError, match="only one term of a spec may set sinks"):
        resolve("gpt_oss_sinks+gpt_oss_sinks", **shape)
