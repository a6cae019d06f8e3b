"""Deterministic kernel choice (flexcore.kernels.choice and Tuned.tune in flexcore.kernels.launch):
the tie rule among near-equal timings, timing over rounds, and choices persisted per GPU and
versions.

Timings are given through the ``timer`` argument; the autotuner is triton's own, running a tiny
kernel under the interpreter that writes its BLOCK constexpr, so that the timer knows which
configuration it is timing.
"""
from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from flexcore._runtime import prepare_triton
from flexcore.errors import InputError
from flexcore.kernels import choice as C
from flexcore.kernels import launch as L
from flexcore.kernels.policy import LaunchPolicy

prepare_triton()

import triton  # noqa: E402 - after the interpreter is chosen
import triton.language as tl  # noqa: E402


@triton.jit
def _write_block(out, n, BLOCK: tl.constexpr):
    tl.store(out + tl.arange(0, 1), tl.full((1,), BLOCK, tl.int32))


_BLOCKS = (16, 32, 64)
_ENV = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "cuda": "12.8", "torch": "2.13.0",
        "triton": "3.6.0", "flexlab": "0.1.0"}


def _tuned():
    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in _BLOCKS]
    return L.Tuned(triton.autotune(configs=configs, key=[])(_write_block))


class _Timer:
    """Samples per BLOCK (the kernel's output says which configuration ``call`` launched)."""

    def __init__(self, out, samples: dict):
        self.out, self.samples, self.timed = out, samples, []

    def __call__(self, call):
        call()
        block = int(self.out[0])
        self.timed.append(block)
        return self.samples[block]


def test_choose_keeps_the_earliest_candidate_within_the_tolerance():
    assert C.choose([1.01, 1.00, 1.30], tolerance=0.02) == 0       # a tie: preference order wins
    assert C.choose([1.00, 1.01, 1.30], tolerance=0.02) == 0
    assert C.choose([1.05, 1.00, 1.01], tolerance=0.02) == 1       # 1.05 is outside, 1.00 first within
    assert C.choose([1.05, 1.00, 1.01], tolerance=0.0) == 1
    assert C.choose([1.03, 1.01, 1.00], tolerance=0.0) == 2        # no tolerance: the fastest
    assert C.choose([math.inf, 1.02, 1.00], tolerance=0.02) == 1   # a failed candidate never wins
    assert C.choose([math.inf, math.inf], tolerance=0.02) == 0
    with pytest.raises(ValueError, match="at least one"):
        C.choose([], tolerance=0.02)


def test_benchmark_pools_the_rounds_samples():
    rounds = iter([[1.0, 4.0], [2.0, 9.0], [3.0, 5.0]])
    calls = []
    bench = C.benchmark(C.TuneRule(rounds=3), timer=lambda call: (call(), next(rounds))[1])
    median, p20, p80 = bench(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8))
    pooled = torch.tensor([1.0, 4.0, 2.0, 9.0, 3.0, 5.0], dtype=torch.float64)
    assert len(calls) == 3
    assert median == pytest.approx(statistics.median(pooled.tolist()))
    assert (p20, p80) == pytest.approx((pooled.quantile(0.2).item(), pooled.quantile(0.8).item()))


def test_time_candidates_interleaves_rounds():
    order = []
    samples = {"a": [2.0, 2.2], "b": [1.0, 1.4]}

    def timer(call):
        name = call()
        order.append(name)
        return samples[name]

    times = C.time_candidates([lambda: "a", lambda: "b"], C.TuneRule(rounds=3), timer)
    assert order == ["a", "b"] * 3
    assert times == [statistics.median(samples["a"] * 3), statistics.median(samples["b"] * 3)]


@pytest.mark.parametrize("tolerance, expected", [(0.02, 16), (0.005, 32)])
def test_tuned_keeps_the_preferred_of_near_equal_configurations(tolerance, expected):
    """triton's autotuner times the three configurations (BLOCK 32 is fastest by 1%) with the
    rule's benchmark; the kept configuration is the tie rule's, not the autotuner's minimum."""
    out = torch.zeros(1, dtype=torch.int32)
    samples = {16: [1.01, 1.02, 1.00], 32: [1.00, 0.99, 1.01], 64: [1.30, 1.31, 1.29]}
    timer = _Timer(out, samples)
    tuned = _tuned()
    rule = C.TuneRule(tolerance=tolerance, rounds=2)
    config = tuned.tune(lambda meta: (1,), (out, 1), {}, (), rule, timer=timer)
    assert config.kwargs["BLOCK"] == expected
    assert sorted(set(timer.timed)) == list(_BLOCKS) and len(timer.timed) == 2 * len(_BLOCKS)
    medians = {b: statistics.median(s * 2) for b, s in samples.items()}
    assert C.choose([medians[b] for b in _BLOCKS], tolerance) == _BLOCKS.index(expected)
    assert tuned.tuner.best_config.kwargs["BLOCK"] == 32  # the autotuner alone would keep this one


def test_the_default_launch_policy_uses_the_default_rule():
    assert LaunchPolicy().tune == C.DEFAULT_RULE


def test_persisted_choice_round_trips_and_is_reused(tmp_path):
    out = torch.zeros(1, dtype=torch.int32)
    args = (out, 1)
    samples = {16: [1.2], 32: [1.0], 64: [1.5]}
    cache = C.ChoiceCache(tmp_path, _ENV)
    first = _tuned()
    timer = _Timer(out, samples)
    config = first.tune(lambda meta: (1,), args, {}, (), C.TuneRule(rounds=1), timer=timer, cache=cache)
    assert config.kwargs["BLOCK"] == 32 and timer.timed == [16, 32, 64]
    key = L.choice_key(first.tuner.fn, first.tuner.configs, (), args, {})
    stored = cache.get(key)
    assert stored["index"] == 1 and stored["config"] == str(first.tuner.configs[1])
    assert stored["times_ms"] == [1.2, 1.0, 1.5] and stored["tolerance"] == C.DEFAULT_RULE.tolerance

    # A later process: the same cache folder and environment, other timings; nothing is timed and
    # the stored configuration runs the call.
    out.zero_()
    later = _tuned()
    timer = _Timer(out, {16: [0.5], 32: [1.0], 64: [1.5]})
    config = later.tune(lambda meta: (1,), args, {}, (), C.TuneRule(rounds=1), timer=timer,
                        cache=C.ChoiceCache(tmp_path, dict(_ENV)))
    assert config.kwargs["BLOCK"] == 32 and timer.timed == [] and int(out[0]) == 32


def test_persisted_choices_are_keyed_by_gpu_and_versions(tmp_path):
    cache = C.ChoiceCache(tmp_path, _ENV)
    assert cache.put("kernel-a", {"index": 2, "config": "c2"}) == {"index": 2, "config": "c2"}
    assert C.ChoiceCache(tmp_path, dict(_ENV)).get("kernel-a") == {"index": 2, "config": "c2"}
    assert cache.get("kernel-b") is None
    for field, other in (("torch", "2.14.0"), ("triton", "3.7.0"), ("flexlab", "0.2.0"),
                         ("gpu", "NVIDIA H200")):
        assert C.ChoiceCache(tmp_path, {**_ENV, field: other}).get("kernel-a") is None
    # The first stored choice stays: a later (or concurrent) process reads it back.
    assert cache.put("kernel-a", {"index": 0, "config": "c0"}) == {"index": 2, "config": "c2"}
    path, = cache.folder.glob("*.json")
    data = json.loads(path.read_text())
    assert data["environment"] == _ENV and data["key"] == "kernel-a"
    path.write_text("{not json")
    assert cache.get("kernel-a") is None  # a damaged file reads as absent


def test_a_stale_persisted_entry_is_not_launched(tmp_path):
    """An entry whose configuration is no longer the one at its index (the candidate list
    changed) is ignored and the configurations are timed again."""
    out = torch.zeros(1, dtype=torch.int32)
    tuned = _tuned()
    cache = C.ChoiceCache(tmp_path, _ENV)
    key = L.choice_key(tuned.tuner.fn, tuned.tuner.configs, (), (out, 1), {})
    cache.put(key, {"index": 0, "config": "BLOCK: 128, num_warps: 8"})
    timer = _Timer(out, {16: [1.5], 32: [1.0], 64: [1.5]})
    config = tuned.tune(lambda meta: (1,), (out, 1), {}, (), C.TuneRule(rounds=1), timer=timer, cache=cache)
    assert config.kwargs["BLOCK"] == 32 and timer.timed == [16, 32, 64]


def test_choice_key_names_the_kernel_configurations_and_problem():
    tuned = _tuned()
    fn, configs = tuned.tuner.fn, tuned.tuner.configs
    x = torch.zeros(4, 8)
    base = L.choice_key(fn, configs, (), (x, 1), {"FLAG": True})
    assert base == L.choice_key(fn, configs, (), (torch.ones(4, 8), 1), {"FLAG": True})  # values aside
    assert "_write_block" in base
    assert base != L.choice_key(fn, configs, (), (torch.zeros(4, 16), 1), {"FLAG": True})
    assert base != L.choice_key(fn, configs, (), (x.t(), 1), {"FLAG": True})           # strides
    assert base != L.choice_key(fn, configs, (), (x.half(), 1), {"FLAG": True})
    assert base != L.choice_key(fn, configs, (), (x, 2), {"FLAG": True})
    assert base != L.choice_key(fn, configs, (), (x, 1), {"FLAG": False})
    assert base != L.choice_key(fn, configs[:2], (), (x, 1), {"FLAG": True})
    assert base != L.choice_key(fn, configs, ((3,), ("torch.float32",)), (x, 1), {"FLAG": True})


def test_cache_location_follows_the_rule_and_the_environment(tmp_path):
    home = {"XDG_CACHE_HOME": str(tmp_path)}
    default = tmp_path / "flexlab" / "plans"
    assert C.cache_location(C.TuneRule(), home) == default
    assert C.cache_location(C.TuneRule(), {**home, "FLEXLAB_PLAN_CACHE": "1"}) == default
    for off in ("0", "off", "false"):
        assert C.cache_location(C.TuneRule(), {**home, "FLEXLAB_PLAN_CACHE": off}) is None
    assert C.cache_location(C.TuneRule(), {"FLEXLAB_PLAN_CACHE": str(tmp_path / "x")}) == tmp_path / "x"
    assert C.cache_location(C.TuneRule(plan_cache="off"), home) is None
    on = C.TuneRule(plan_cache="on", cache_dir=str(tmp_path / "y"))
    assert C.cache_location(on, {"FLEXLAB_PLAN_CACHE": "0"}) == tmp_path / "y"   # the rule wins
    assert C.cache_location(C.TuneRule(plan_cache="on"), {**home, "FLEXLAB_PLAN_CACHE": "0"}) == default
    assert str(C.cache_location(C.TuneRule(), {})).endswith(".cache/flexlab/plans")


def test_tune_rule_rejects_bad_values():
    with pytest.raises(InputError, match="TuneRule.tolerance = -0.1"):
        C.TuneRule(tolerance=-0.1)
    with pytest.raises(InputError, match="TuneRule.rounds = 0"):
        C.TuneRule(rounds=0)
    with pytest.raises(InputError, match="TuneRule.plan_cache = 'sometimes'"):
        C.TuneRule(plan_cache="sometimes")
