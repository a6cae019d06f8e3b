"""The bench's fp8 pass: flexlab attends the case's inputs quantized to float8_e4m3fn with per-head
descales; the float64 golden is computed from the dequantized inputs, the same-dtype baseline is
FP8 math; providers without FP8 say why; the rows sit beside bf16's fwd rows."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import providers as prov
from bench import runner
from bench.context import make_context
from bench.grid import ConfigError, Case, Settings, build_grid
from flexcore.fp8 import FP8_DTYPE
from flexcore.reference import flex_attention_reference
from tests.bench.helpers import ALIBI, CAUSAL


def _grid(providers=("flexlab", "sdpa_math")):
    config = {"groups": [{"variants": [CAUSAL, f"{ALIBI}+{CAUSAL}"],
                          # 4 query heads on 2 KV heads; 80 keys are not a block multiple.
                          "shapes": [[1, 48, 80]], "heads": [[4, 2]], "head_dim": [16],
                          "dtype": ["bfloat16"], "passes": ["fwd", "fp8"]}],
              "providers": list(providers), "settings": {"cpu_reps": 1, "ref_slices": 0}}
    return build_grid(config, "fp8")


def _by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


class _ScaledFlexlab(prov.FlexlabProvider):
    """flexlab with its FP8 output off by 5%: the fp8 rows' check must catch it."""

    name = "flexlab_scaled"

    def prepare(self, ctx):
        inner = super().prepare(ctx)
        return dataclasses.replace(inner, call=lambda q, k, v: inner.call(q, k, v) * 1.05)


@pytest.fixture(scope="module")
def fp8_run():
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(prov.PROVIDERS, "flexlab_scaled", _ScaledFlexlab())
        grid = _grid(("flexlab", "sdpa_math", "torch_flex", "flexlab_scaled"))
        return grid, runner.run_grid(grid, device="cpu")["rows"]


def test_flexlab_fp8_rows_are_checked_against_the_dequantized_golden(fp8_run):
    grid, rows = fp8_run
    fp8_cases = [c for c in grid.cases if c.pass_ == "fp8"]
    assert len(fp8_cases) == 2
    for case in fp8_cases:
        mine = {r["metric"]: r for r in _by(rows, case_id=case.case_id, provider="flexlab")}
        assert mine["out_correct"]["value"] == 1, mine["out_correct"]
        assert "float8_e4m3fn" in mine["setup_s"]["note"]
        assert mine["tflops"]["value"] > 0  # counted as a forward
        # The same-dtype baseline is FP8 math (SDPA math has none), whose error is e4m3's.
        base = _by(rows, case_id=case.case_id, provider="baseline", metric="out_max_abs")
        assert base and base[0]["note"].startswith("flexcore.reference(upcast=False)")
        # Beside bf16's forward on the same variant: e4m3 probabilities err far more than bf16 ones.
        fwd = dataclasses.replace(case, pass_="fwd")
        bf16 = _by(rows, case_id=fwd.case_id, provider="flexlab", metric="out_max_abs")
        assert bf16 and mine["out_max_abs"]["value"] > bf16[0]["value"]
        # A wrong output fails the check.
        scaled = _by(rows, case_id=case.case_id, provider="flexlab_scaled", metric="out_correct")
        assert scaled and scaled[0]["value"] == 0


@pytest.mark.parametrize("name", ["sdpa_math", "torch_flex"])
def test_providers_without_fp8_say_why(fp8_run, name):
    grid, rows = fp8_run
    for case in (c for c in grid.cases if c.pass_ == "fp8"):
        row = _by(rows, case_id=case.case_id, provider=name, metric="status")
        assert row and row[0]["status"] in ("unsupported", "skipped"), row
        if name == "sdpa_math":  # available on the CPU: refused with its reason
            assert row[0]["status"] == "unsupported" and "float8" in row[0]["note"]


def _fp8_ctx(B=1, Hq=4, Hkv=2, L=48, S=80):
    case = Case(CAUSAL, B, Hq, Hkv, L, S, 16, 16, "bfloat16", "fp8")
    return make_context(case, Settings(block_size=32, ref_slices=0), torch.device("cpu"), n_sets=1)


def test_the_golden_is_float64_on_the_dequantized_inputs():
    ctx = _fp8_ctx()
    x = ctx.inputs[0].fp8
    assert x.q.dtype == FP8_DTYPE and x.descale_q.shape == (1, 2)  # per KV head (FA3's layout)
    golden = ctx.golden()["out"][0]
    expected = flex_attention_reference(x.q, x.k, x.v, score_mod=ctx.mods.score_mod,
                                        block_mask=ctx.slice_block_mask(ctx.slices()[0], ctx.mods),
                                        enable_gqa=True, **x.descales())
    assert golden.dtype == torch.float64 and torch.equal(golden, expected)
    # The set's bfloat16 tensors hold the dequantized values exactly (power-of-two descales).
    assert torch.equal(ctx.inputs[0].q.double(), x.q.double() * x.descale_q.double().repeat_interleave(2, 1)
                       .view(1, 4, 1, 1))


def test_flash_attn_fp8_only_through_flashattention3(monkeypatch):
    ctx = _fp8_ctx(L=64, S=64)  # flash_attn aligns causal masks bottom-right: equal lengths
    calls = []

    def fake_fa3(q, k, v, **kwargs):
        calls.append((q.dtype, q.shape, kwargs))
        return torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.bfloat16)

    provider = prov.FlashAttnProvider()
    monkeypatch.setattr(provider, "_load", lambda: (fake_fa3, "FA3"))
    first = ctx.inputs[0]
    prepared = provider.prepare(ctx)
    prepared.call(first.q, first.k, first.v)
    dtype, shape, kwargs = calls[0]
    assert dtype == FP8_DTYPE and shape == (1, 64, 4, 16) and kwargs["causal"] is True
    assert kwargs["q_descale"].shape == kwargs["k_descale"].shape == (1, 2)
    monkeypatch.setattr(provider, "_load", lambda: (fake_fa3, "FA2"))
    with pytest.raises(prov.Unsupported, match="FA2.*float16/bfloat16 only"):
        provider.prepare(ctx)
    with pytest.raises(prov.Unsupported, match="FlashAttention-4.*float16/bfloat16 only"):
        prov.FlashAttn4Provider().arguments(ctx, "FA4", 9)
    with pytest.raises(prov.Unsupported, match="torch.compile"):
        prov.get("flexlab_compiled").prepare(ctx)


def test_fp8_pass_in_the_grid():
    with pytest.raises(ConfigError, match="fp8 pass quantizes bfloat16 inputs"):
        Case(CAUSAL, 1, 2, 2, 64, 64, 16, 16, "float32", "fp8").validate()
    grid = build_grid({"groups": [{"variants": [CAUSAL], "shapes": [[1, 64]], "heads": [2],
                                   "head_dim": [16], "dtype": ["bfloat16"], "passes": ["fp8-forward"]}],
                       "providers": ["flexlab"], "settings": {"cuda_graphs": "decode,fp8"}}, "g")
    assert [c.pass_ for c in grid.cases] == ["fp8"]
    assert grid.settings.graph_passes() == {"decode", "fp8"}
