"""Error metrics and tolerance checks on hand-made tensors."""
from __future__ import annotations

import math

import pytest
import torch

from flexcore.errors import InputError
from flexcore.testing import (DEFAULT_EPS, assert_close_to_reference, error_metrics,
                              tolerance_check, within_tolerance)


def test_metrics_on_known_differences():
    golden = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    out = torch.tensor([[3.0, 0.5], [0.0, 4.0]], dtype=torch.float32)
    m = error_metrics(out, golden)
    assert m == {"max_abs": 0.5, "mean_abs": 0.125, "rel_fro": 0.1}


def test_metrics_are_exact_for_equal_inputs_and_matching_infinities():
    golden = torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float64)
    assert error_metrics(golden.clone(), golden) == {"max_abs": 0.0, "mean_abs": 0.0, "rel_fro": 0.0}
    off = torch.tensor([1.0, -math.inf, 2.5])
    m = error_metrics(off, golden)
    assert m["max_abs"] == 0.5 and m["mean_abs"] == pytest.approx(0.5 / 3)
    assert m["rel_fro"] == pytest.approx(0.5 / math.sqrt(5))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_unmatched_infinity_is_infinite_error(bad):
    golden = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    out = torch.tensor([1.0, bad, 3.0])
    assert all(v == math.inf for v in error_metrics(out, golden).values())
    assert not tolerance_check(out, golden, golden.float()).passed


@pytest.mark.parametrize("metric", ["max_abs", "mean_abs", "rel_fro"])
def test_a_non_finite_error_fails_even_against_a_non_finite_baseline(metric):
    # The baseline (the reference in the tested dtype) overflowed too: its threshold is inf, and
    # inf <= inf would pass any result.
    golden = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    for out in (torch.tensor([1.0, math.nan, 3.0]), torch.tensor([math.inf, 2.0, 3.0])):
        res = tolerance_check(out, golden, torch.tensor([1.0, math.nan, 3.0]), metric=metric)
        assert res.threshold == math.inf and not res.passed


def test_within_tolerance_is_the_rule_of_every_check():
    # tolerance_check, the workbench's gradient rows and the bench's correctness rows share it.
    assert within_tolerance(1.0, 2.0) and within_tolerance(2.0, 2.0)
    assert not within_tolerance(2.5, 2.0)
    assert not within_tolerance(math.inf, math.inf) and not within_tolerance(math.nan, math.inf)


def test_mismatched_infinity_in_golden_is_infinite_error():
    golden = torch.tensor([1.0, -math.inf], dtype=torch.float64)
    assert error_metrics(torch.tensor([1.0, 0.0]), golden)["max_abs"] == math.inf
    assert error_metrics(torch.tensor([1.0, math.inf]), golden)["max_abs"] == math.inf


def test_rel_fro_is_absolute_for_zero_golden():
    golden = torch.zeros(4, dtype=torch.float64)
    assert error_metrics(torch.tensor([0.0, 0.0, 3.0, 4.0]), golden)["rel_fro"] == 5.0
    assert error_metrics(torch.zeros(4), golden)["rel_fro"] == 0.0


def test_shape_mismatch_is_an_error():
    with pytest.raises(InputError, match="shape \\(3,\\) but golden has \\(4,\\)"):
        error_metrics(torch.zeros(3), torch.zeros(4))


def test_tolerance_is_relative_to_the_baseline():
    golden = torch.zeros(10, dtype=torch.float64)
    baseline = torch.zeros(10, dtype=torch.bfloat16)
    baseline[3] = 0.25                       # torch's own error: 0.25
    within = torch.zeros(10, dtype=torch.bfloat16)
    within[5] = 0.5                          # 0.5 <= 2 * 0.25 + eps
    beyond = torch.zeros(10, dtype=torch.bfloat16)
    beyond[5] = 0.5625                       # > 2 * 0.25 + 0.016
    ok = tolerance_check(within, golden, baseline)
    assert ok.passed and bool(ok)
    assert ok.threshold == pytest.approx(0.5 + DEFAULT_EPS[torch.bfloat16])
    assert ok.errors["max_abs"] == 0.5 and ok.baseline_errors["max_abs"] == 0.25
    assert not tolerance_check(beyond, golden, baseline).passed
    assert tolerance_check(beyond, golden, baseline, factor=2.5).passed
    assert tolerance_check(beyond, golden, baseline, atol=0.1).passed


def test_eps_covers_an_exact_baseline_per_dtype():
    golden = torch.ones(8, dtype=torch.float64)
    for dtype, eps in DEFAULT_EPS.items():
        out = golden.to(dtype).clone()
        out[0] += eps / 2 if dtype == torch.float64 else 0
        assert tolerance_check(out, golden, golden.to(dtype)).passed, dtype
    fp32_off = golden.float().clone()
    fp32_off[0] += 1e-4
    assert not tolerance_check(fp32_off, golden, golden.float()).passed


def test_metric_choice_matters():
    golden = torch.ones(4, dtype=torch.float64)
    baseline = torch.tensor([1.1, 1.0, 1.0, 1.0], dtype=torch.float64)  # one large error
    spread = torch.full((4,), 1.06, dtype=torch.float64)                 # many small errors
    by_max = tolerance_check(spread, golden, baseline, atol=0.0)
    assert by_max.passed and by_max.threshold == pytest.approx(0.2)
    by_mean = tolerance_check(spread, golden, baseline, metric="mean_abs", atol=0.0)
    assert by_mean.metric == "mean_abs" and not by_mean.passed
    assert by_mean.errors["mean_abs"] == pytest.approx(0.06)
    assert by_mean.threshold == pytest.approx(0.05)
    by_fro = tolerance_check(spread, golden, baseline, metric="rel_fro", atol=0.0)
    assert by_fro.errors["rel_fro"] == pytest.approx(0.06) and by_fro.passed  # 0.06 <= 2 * 0.05
    with pytest.raises(InputError, match="metric must be one of"):
        tolerance_check(spread, golden, baseline, metric="max")


def test_assert_close_to_reference_reports_both_errors():
    golden = torch.zeros(5, dtype=torch.float64)
    baseline = torch.tensor([0.0, 0.001, 0.0, 0.0, 0.0])
    ours = torch.tensor([0.0, 0.0, 0.01, 0.0, 0.0])
    with pytest.raises(AssertionError) as info:
        assert_close_to_reference(ours, golden, baseline, name="dq")
    message = str(info.value)
    assert "dq: max_abs = 1.000e-02" in message and "baseline max_abs = 1.000e-03" in message
    assert "threshold 2.010e-03" in message
    assert assert_close_to_reference(baseline, golden, baseline).passed
