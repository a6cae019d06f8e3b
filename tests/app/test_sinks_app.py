"""Attention sinks in the Playground: the code's ``sinks`` becomes ``Mods.sinks``, reaches flexcore
and the float64 reference in Check and Gradients, and a wrong ``sinks`` is an error naming it."""
from __future__ import annotations

import collections

import pytest

import variants
from app.tasks import mods as task_mods
from app.tasks import numerics
from app.usercode import UserCodeError, execute, mods_of

SHAPE = {"B": 1, "Hq": 2, "Hkv": 1, "Q_LEN": 32, "KV_LEN": 32, "D": 16, "dtype": "float32",
         "BLOCK_SIZE": 16}
WINDOW = ("def mask_mod(b, h, q_idx, kv_idx):\n"
          "    return (q_idx >= kv_idx) & (q_idx - kv_idx < 12)\n")
WITH_SINKS = "import torch\n\nsinks = torch.tensor([1.5, -0.5], requires_grad=True)\n\n\n" + WINDOW


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(task_mods, "_CACHE", collections.OrderedDict())


def test_mods_of_reads_sinks_apart_from_the_captured_tensors():
    mods = mods_of(execute(WITH_SINKS, SHAPE), SHAPE)
    assert mods.sinks is not None and mods.sinks.tolist() == [1.5, -0.5] and mods.sinks.requires_grad
    assert "sinks" not in mods.captured
    assert mods_of(execute(WINDOW, SHAPE), SHAPE).sinks is None


def test_the_gallery_snippet_sets_sinks():
    code = variants.get("gpt_oss_sinks").source(B=1, H=2, Q_LEN=32, window_size=12, sink_logit=2.5)
    mods = mods_of(execute(code, SHAPE), SHAPE)
    assert mods.sinks.tolist() == [2.5, 2.5]


@pytest.mark.parametrize("value, words", [
    ("[1.0, 2.0]", "sinks is a list"),
    ("torch.zeros(3)", "sinks has shape (3,)"),
    ("torch.zeros(2, dtype=torch.int64)", "dtype torch.int64"),
])
def test_a_wrong_sinks_is_an_error_naming_it(value, words):
    code = f"import torch\n\nsinks = {value}\n\n\n" + WINDOW
    with pytest.raises(UserCodeError) as info:
        mods_of(execute(code, SHAPE), SHAPE)
    text = info.value.problem.message
    assert words in text and "(2,)" in text, text


def test_check_applies_sinks_in_flexcore_and_the_reference():
    result = numerics.check(WITH_SINKS, SHAPE, 0, ["float32"], 0, 1)
    row = result["rows"][0]
    assert row["passed"], row
    # flexcore's output with the code's sinks differs from the same mask without them: the
    # agreement above is with the reference computed with sinks.
    diff = numerics.output_difference(WITH_SINKS, WINDOW, SHAPE, 0, 0, 1)
    assert diff["max_abs"] > 0.05, diff


def test_gradients_compare_the_sinks_gradient():
    result = numerics.gradients(WITH_SINKS, SHAPE, 0, "float32")
    rows = {(r["source"], r["tensor"]): r for r in result["rows"]}
    assert ("flexcore", "dsinks") in rows, (sorted(rows), result["notes"])
    assert rows[("flexcore", "dsinks")]["passed"], rows[("flexcore", "dsinks")]
    assert rows[("flexcore", "dQ")]["passed"]
    # SDPA math cannot express sinks: it says so instead of giving sink-less gradients.
    assert any(n.startswith("sdpa_math") and "sinks" in n for n in result["notes"]), result["notes"]
