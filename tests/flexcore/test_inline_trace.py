"""The inline compiled ops as Inductor's AOT stage traces them on CUDA, checked on a machine without
a GPU (tests/flexcore/trace_inline.py, in its own process): their bodies trace over fake CUDA
tensors into Triton launches (and, in the backward, the torch ops of the rows' delta), and Inductor's analysis of each kernel finds the buffers it
writes, never an input it only reads (an input it took for written would be cloned at every call,
and two arguments sharing a buffer, as a tensor that both mods capture, would then fail to
functionalize)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"KV_NUM_BLKS", "KV_IDX", "FULL_KV_NUM_BLKS", "FULL_KV_IDX", "Q_NUM_BLKS", "Q_IDX",
          "FULL_Q_NUM_BLKS", "FULL_Q_IDX"}
# The mods' captured tensors: the score_mod's slopes and document ids, the mask_mod's document ids.
CAPTURED = {"sm_c0_ptr", "sm_c1_ptr", "mm_c0_ptr"}
# The pointers each op's kernels only read.
FORWARD_READS = {"Q", "K", "V", "DESCALE_Q", "DESCALE_K", "DESCALE_V", "ORDER"} | TABLES | CAPTURED
BACKWARD_READS = {"Q", "K", "V", "DO", "DOut", "Out", "ROW_STATS", "GRAD_LSE"} | TABLES | CAPTURED


def trace(*case: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.flexcore.trace_inline", *case], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_launches(got: dict, expected: list[tuple[str, int | None, set]], reads: set) -> None:
    assert got["fallbacks"] == 0, "Inductor could not analyse a kernel's writes"
    assert got["flexcore_ops"] == [], "the op's body left a flexcore op in the graph"
    launches = got["launches"]
    assert [(x["kernel"], x["phase"]) for x in launches] == [(k, p) for k, p, _ in expected]
    for launch, (_, _, writes) in zip(launches, expected):
        assert launch["upcast_dot"] is not True, "traced the interpreter's code path, not the GPU's"
        assert writes <= set(launch["writes"]), launch
        assert not reads & set(launch["writes"]), launch


@pytest.mark.parametrize("mask", ["causal", "none", "document"])
def test_inline_forward_traces_to_one_launch(mask):
    _check_launches(trace("forward", mask, "gqa"), [("flex_forward_kernel", None, {"Out", "LSE", "ROW_STATS"})],
                    FORWARD_READS)


# document: the score_mod and the mask_mod read one tensor, which the launches take twice.
# two: backward.fused "off" (two launches; by default one launch runs both kinds of program).
@pytest.mark.parametrize("case", [("causal", "grad"), ("none", "gqa"), ("document", "grad", "two"),
                                  ("none", "gqa", "two")],
                         ids=["causal-grad", "dense-gqa", "document-shared-capture-two", "dense-gqa-two"])
def test_inline_backward_traces_to_its_launches(case):
    mask, *extra = case
    got = trace("backward", mask, *extra)
    grads = {"sm_g0_ptr"} if "grad" in extra else set()
    expected = []
    if "grad" in extra:  # captured gradients: delta from the backward's own probabilities first
        expected.append(("flex_bwd_kernel", 3, {"DELTA"}))
    else:  # the rows' delta, rowsum(dO * O) - dlse, from torch ops that Inductor fuses and launches
        assert {"aten.mul.Tensor", "aten.sum.dim_IntList", "aten.sub.Tensor"} <= set(got["aten"]), got["aten"]
    # lse2 = m + log2(l) for the 16-bit inputs' probabilities
    assert "aten.log2.default" in got["aten"], got["aten"]
    if "two" in extra:
        expected += [("flex_bwd_kernel", 1, {"DK", "DV"} | grads), ("flex_bwd_kernel", 2, {"DQ"})]
    else:
        expected.append(("flex_bwd_kernel", 0, {"DK", "DV", "DQ"} | grads))
    _check_launches(got, expected, BACKWARD_READS)
