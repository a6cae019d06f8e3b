"""The float64 golden on slices of a problem equals the golden of the whole problem there."""
from __future__ import annotations

import dataclasses
import json

import torch

from bench import runner
from bench.context import CaseContext, make_context
from bench.grid import Case, Settings
from tests.bench.helpers import ALIBI, MODS, small_grid

PADDING = str(MODS / "padding.py")


def _golden(variant, settings, pass_="fwd_bwd"):
    # Batch 3 and 6 query heads on 3 KV heads: slices must offset both b and h.
    case = Case(variant, 3, 6, 3, 20, 36, 8, 8, "float32", pass_)
    torch.manual_seed(0)
    ctx = make_context(case, settings, torch.device("cpu"), n_sets=1)
    return ctx, ctx.golden()


def test_sliced_golden_matches_the_whole():
    variant = f"{ALIBI}+{PADDING}"  # depends on h (slopes) and on b (lengths)
    whole_ctx, whole = _golden(variant, Settings(ref_slices=0))
    part_ctx, part = _golden(variant, Settings(ref_slices=3, ref_full_elements=0))
    assert whole_ctx.coverage() == "all"
    slices = part_ctx.slices()
    assert len(slices) == 3 and part_ctx.coverage() != "all"
    assert {(s.b, s.kv_head) for s in slices} == {(0, 0), (1, 1), (2, 2)}
    (full,) = whole_ctx.slices()
    for i, s in enumerate(slices):
        assert torch.allclose(part["out"][i], s.q_part(whole["out"][0]), atol=1e-12)
    # Gradients of the slices alone: dout is zero elsewhere, so dq/dk/dv of the slice are those
    # of a run with the masked dout. Compare with the whole problem under the same masked dout.
    masked_ctx = dataclasses.replace(whole_ctx, _cache={})
    masked_ctx.inputs = whole_ctx.inputs
    masked_ctx.inputs[0].dout = part_ctx.correctness_dout()
    masked = masked_ctx.golden()
    for i, s in enumerate(slices):
        assert torch.allclose(part["dq"][i], s.q_part(masked["dq"][0]), atol=1e-10)
        assert torch.allclose(part["dk"][i], s.kv_part(masked["dk"][0]), atol=1e-10)
        assert torch.allclose(part["dv"][i], s.kv_part(masked["dv"][0]), atol=1e-10)
    # The learnable slopes' gradient sums over the slices: equal to the masked whole's.
    assert torch.allclose(part["captured"][0], masked["captured"][0], atol=1e-10)
    assert full.nb == 3 and full.nq == 6


def test_sliced_run_checks_and_passes(tmp_path):
    grid = small_grid(variants=[f"{ALIBI}+{PADDING}"], ref_slices=2, ref_full_elements=0)
    rows = json.loads(runner.run(grid, tmp_path / "r", progress=False, log=lambda m: None).read_text())["rows"]
    assert all(r["ref_coverage"] == "b0/h0:2;b1/h2:4" for r in rows)
    verdicts = [r for r in rows if r["provider"] == "sdpa_math" and r["metric"].endswith("_correct")]
    assert {r["metric"] for r in verdicts} >= {"out_correct", "dq_correct", "dk_correct", "dv_correct",
                                               "dcap0_correct"}
    assert all(r["value"] == 1 for r in verdicts)


def test_long_decode_is_checked_on_slices():
    from variants.core import Mods

    def ctx(kv_len):
        case = Case("noop", 2, 32, 8, 1, kv_len, 128, 128, "bfloat16", "decode")
        return CaseContext(case, Settings(), torch.device("cpu"), Mods())

    # 2·32·1024·256 float64 elements of repeated K/V fit the budget; 2·32·8192·256 do not.
    assert ctx(1024).coverage() == "all"
    assert ctx(8192).coverage() == "b0/h0:4;b1/h28:32"
