"""The train-step preset's block on the CPU: one tiny compiled step per provider, checked against float64."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bench import providers as prov
from bench import runner
from bench.grid import build_grid, load_config
from bench.runner import COLUMNS
from bench.train_step import TRAIN_PROVIDERS, Block, TrainStepRunner, block_flops, init_state

CPU = torch.device("cpu")


def _grid(variant="causal", providers=TRAIN_PROVIDERS):
    # aot_eager traces the same graphs as inductor (Dynamo and AOTAutograd) without generating
    # C++: seconds instead of a minute per block on a CPU. S=64 in one 64-block with GQA 2/1
    # keeps the interpreter's kernels to a few tiles.
    return build_grid({"providers": list(providers),
                       "settings": {"compile_backend": "aot_eager", "cpu_reps": 1, "block_size": 64},
                       "groups": [{"variants": [variant], "shapes": [[1, 64]], "heads": [[2, 1]],
                                   "head_dim": [16], "dtype": ["float32"], "passes": ["train_step"]}]},
                      "train")


def _get(rows, provider, metric):
    return [r for r in rows if r["provider"] == provider and r["metric"] == metric]


def test_one_tiny_step_per_provider(tmp_path):
    grid = _grid("alibi_causal")
    rows = json.loads(runner.run(grid, tmp_path / "r", device=CPU, progress=False,
                                 log=lambda m: None).read_text())["rows"]
    assert rows and all(list(r) == COLUMNS for r in rows)
    keys = [(r["provider"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert {r["pass"] for r in rows} == {"train_step"}
    available = prov.availability(CPU, TRAIN_PROVIDERS)
    ran = []
    for name in TRAIN_PROVIDERS:
        status = _get(rows, name, "status")
        if not available[name][0]:
            assert status[0]["status"] == "skipped" and status[0]["note"] == available[name][1]
            continue
        if name == "flexlab_compiled" and status:
            # flexcore inside fullgraph torch.compile: until it compiles, the row says why.
            assert status[0]["status"] == "error"
            assert "torch.compile(fullgraph=True, backend=aot_eager) of the block failed" in status[0]["note"]
            continue
        assert not status, status
        ran.append(name)
        loss = _get(rows, name, "loss")[0]
        assert loss["status"] == "ok" and math.isfinite(loss["value"])
        for key in ("out", "dx", "dparams"):
            assert _get(rows, name, f"{key}_correct")[0]["value"] == 1, (name, key)
        time_ms = _get(rows, name, "time_ms")[0]["value"]
        tokens = _get(rows, name, "tokens_per_s")[0]["value"]
        assert tokens == pytest.approx(64 / (time_ms * 1e-3))
        assert _get(rows, name, "tflops")[0]["value"] > 0
    assert "flexlab" in ran  # flexcore's eager kernels run on every machine
    # The baseline (the same block, eager, same dtype) is what the tolerances come from.
    assert _get(rows, "baseline", "dparams_max_abs")[0]["value"] < 1e-3


def test_a_wrong_attention_fails_the_check(tmp_path, monkeypatch):
    real = TrainStepRunner._attention

    def scaled(self, name):
        attention, fullgraph, note = real(self, name)
        return (lambda q, k, v: attention(q, k, v) * 1.01), fullgraph, note

    monkeypatch.setattr(TrainStepRunner, "_attention", scaled)
    rows = json.loads(runner.run(_grid(providers=("flexlab",)), tmp_path / "r", device=CPU,
                                 progress=False, log=lambda m: None).read_text())["rows"]
    out = _get(rows, "flexlab", "out_correct")[0]
    assert out["value"] == 0 and out["status"] == "fail"
    assert runner.verdict(rows).exit_code() == 1


def test_block_flops_count_every_matmul():
    """The linear layers' forward+backward FLOPs as torch's FLOP counter sees them, plus attention's."""
    from torch.utils.flop_counter import FlopCounterMode

    B, S, hq, hkv, d = 2, 8, 4, 2, 8
    block = Block(hq * d, hq, hkv, d, lambda q, k, v: q)  # attention without matmuls
    block.load_state_dict(init_state(hq * d, hq, hkv, d, seed=0))
    x = torch.randn(B, S, hq * d, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x).sum().backward()
    from bench.flops import attention_flops

    assert counter.get_total_flops() == block_flops(B, hq, hkv, S, d, 0.5) - attention_flops(
        B, hq, S, S, d, d, 0.5, "fwd_bwd")


def test_train_step_preset():
    grid = build_grid(load_config("train-step"), "train-step")
    assert {c.pass_ for c in grid.cases} == {"train_step"}
    assert {(c.batch, c.q_len, c.q_heads, c.head_dim) for c in grid.cases} == {(4, 2048, 16, 128)}
    assert {"flexlab", "torch_flex", "flexlab_compiled"} <= set(grid.providers)
    assert grid.settings.pin_host is False
