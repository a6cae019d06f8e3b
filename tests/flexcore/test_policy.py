"""The dispatch policy (flexcore.kernels.policy), KernelOptions' backend, and flexcore.explain."""
from __future__ import annotations

import logging
import pickle
import warnings

import pytest
import torch

import flexcore
from flexcore import KernelOptions, create_block_mask, flex_attention
from flexcore.errors import InputError
from flexcore.kernels.policy import DEFAULT_POLICY, DispatchPolicy, ForwardPolicy, GluonPolicy
from flexcore.options import KernelOptionsConflict
from tests.flexcore.compare import assert_matches_reference, seed_of
from tests.flexcore.policies import policy_options


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_defaults_and_values():
    assert KernelOptions().dispatch is DEFAULT_POLICY
    changed = DEFAULT_POLICY.replace(forward={"refine": "off"}, backward={"fused": "on"})
    assert changed.forward.refine == "off" and changed.backward.fused == "on"
    assert changed.gluon == DEFAULT_POLICY.gluon and changed != DEFAULT_POLICY
    assert changed == DispatchPolicy(forward=ForwardPolicy(refine="off"),
                                     backward=DEFAULT_POLICY.backward.__class__(fused="on"))
    assert hash(changed) == hash(pickle.loads(pickle.dumps(changed)))
    # Options with different policies are different cache keys; equal ones are one.
    assert KernelOptions(policy=changed) != KernelOptions()
    assert hash(KernelOptions(policy=changed)) == hash(KernelOptions(policy=DEFAULT_POLICY.replace(
        forward={"refine": "off"}, backward={"fused": "on"})))


def test_forward_tma_rule_by_size():
    """The template's TMA "auto" is "off" for 16-bit calls under tma_min_flops dense-equivalent
    FLOPs (their descriptors' host time outweighs the gain); FP8, explicit rules and larger calls
    keep the policy's rule."""
    from flexcore.fp8 import FP8_DTYPE
    from flexcore.kernels.forward import dense_flops, tma_rule

    def qkv(B, H, L, D, dtype=torch.bfloat16, S=None):
        q = torch.empty(B, H, L, D, dtype=dtype, device="meta")
        k = torch.empty(B, 1, S or L, D, dtype=dtype, device="meta")  # K/V heads do not count: GQA
        return q, k, k

    small, large = qkv(2, 16, 1024, 128), qkv(4, 16, 2048, 128)
    assert dense_flops(*small) == 2 * 2 * 16 * 1024 * 1024 * 256
    assert dense_flops(*qkv(1, 4, 1, 64, S=4096)) == 2 * 4 * 4096 * 128  # a decode-like row
    rule = DEFAULT_POLICY.forward
    assert dense_flops(*small) < rule.tma_min_flops <= dense_flops(*large)
    assert tma_rule(*small, rule) == "off" and tma_rule(*large, rule) == "auto"
    assert tma_rule(*qkv(2, 16, 1024, 128, FP8_DTYPE), rule) == "auto"
    assert tma_rule(*small, ForwardPolicy(tma="on")) == "on"
    assert tma_rule(*large, ForwardPolicy(tma="off")) == "off"
    assert tma_rule(*small, ForwardPolicy(tma_min_flops=0)) == "auto"


@pytest.mark.parametrize("make, match", [
    (lambda: ForwardPolicy(refine=True), r"ForwardPolicy.refine = True: expected one of \['auto', 'on', 'off'\]"),
    (lambda: ForwardPolicy(dense="yes"), "ForwardPolicy.dense = 'yes': expected True or False"),
    (lambda: ForwardPolicy(schedule_group=2.5), "expected an int or None"),
    (lambda: GluonPolicy(masked_min_mean_blocks=-1), "expected a number >= 0"),
    (lambda: GluonPolicy(masked_min_flops=None), "GluonPolicy.masked_min_flops = None: expected a number >= 0"),
    (lambda: ForwardPolicy(tma_min_flops="5e10"), "ForwardPolicy.tma_min_flops = '5e10': expected a number >= 0"),
    (lambda: ForwardPolicy(kv_rows_head_dims={128}), "expected a tuple"),
    (lambda: DispatchPolicy(forward=GluonPolicy()), "DispatchPolicy.forward = .*: expected a ForwardPolicy"),
    (lambda: DEFAULT_POLICY.replace(fwd={}), "no family 'fwd'"),
    (lambda: KernelOptions(policy={"forward": {}}), "kernel_options\\['policy'\\] must be a"),
    (lambda: DEFAULT_POLICY.replace(backward={"warp_spec_kinds": ("dkdv", "dq")}),
     r"BackwardPolicy.warp_spec_kinds = \('dkdv', 'dq'\): expected \('dkdv',\) or \('dq',\); .*races"),
    (lambda: DEFAULT_POLICY.replace(backward={"warp_spec_kinds": ("dk",)}), "warp_spec_kinds = \\('dk',\\)"),
])
def test_bad_policies_are_refused_with_the_field_named(make, match):
    with pytest.raises(InputError, match=match):
        make()


def test_backend_values():
    with pytest.raises(InputError, match=r"kernel_options\['backend'\] = 'cuda': expected one of "
                                         r"\['auto', 'triton', 'gluon'\]"):
        KernelOptions(backend="cuda")
    assert KernelOptions.from_any({"backend": "triton"}).backend == "triton"
    # "triton" forbids every Gluon kernel; "auto" leaves the policy as given.
    gluon = KernelOptions(backend="triton").dispatch.gluon
    assert (gluon.dense, gluon.masked, gluon.backward) == ("off", "off", "off")
    assert KernelOptions(backend="auto").dispatch is DEFAULT_POLICY
    with pytest.raises(InputError, match="backend='triton' contradicts policy.gluon.masked='on'"):
        KernelOptions(backend="triton", policy=DEFAULT_POLICY.replace(gluon={"masked": "on"})).dispatch
    # torch's BACKEND="TRITON" keeps its meaning (no decoding kernel) and allows the Gluon kernels.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = KernelOptions.from_any({"BACKEND": "TRITON"})
    assert opts.decode is False and opts.backend == "auto"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                    reason="this machine has a Hopper GPU")
def test_gluon_backend_without_hopper_is_a_clear_error():
    opts = KernelOptions(backend="gluon")
    assert opts.decode is False  # the decoding kernel is a Triton kernel
    with pytest.raises(InputError, match="backend='gluon' needs an sm_90 \\(Hopper\\) GPU.*Valid backends here: "
                                         "'auto' or 'triton'"):
        opts.dispatch
    q = torch.randn(1, 1, 64, 16)
    with pytest.raises(InputError, match="backend='gluon'"):
        flex_attention(q, q, q, kernel_options=opts)
    with pytest.raises(KernelOptionsConflict, match="decode=True contradicts backend='gluon'"):
        KernelOptions(backend="gluon", decode=True)


def test_triton_backend_runs_the_template_and_matches_the_reference():
    gen = torch.Generator().manual_seed(seed_of("policy", "triton-backend"))
    q, k, v = (torch.randn(1, 2, 96, 32, generator=gen) for _ in range(3))
    bm = create_block_mask(_causal, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options={"backend": "triton"})
    assert_matches_reference(q, k, v, None, bm, out, lse, "backend=triton")


def test_a_policy_reaches_the_kernels(monkeypatch):
    """The forward reads the options' policy, not module state: the same call with the full-block
    runs switched off launches the table path, and both match the reference."""
    from flexcore.kernels import forward as fwd

    seen = []
    real = fwd.launch

    def spy(kernel, grid, args, bm, bn, meta, constexprs, **kw):
        seen.append(constexprs["FULL_RUNS"])
        return real(kernel, grid, args, bm, bn, meta, constexprs, **kw)

    monkeypatch.setattr(fwd, "launch", spy)
    gen = torch.Generator().manual_seed(seed_of("policy", "reaches"))
    q, k, v = (torch.randn(1, 2, 128, 32, generator=gen) for _ in range(3))
    bm = create_block_mask(_causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    for opts in (None, policy_options(forward={"full_runs": False})):
        out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=opts)
        assert_matches_reference(q, k, v, None, bm, out, lse, f"policy {opts}")
    assert seen == [True, False]


def test_explain_says_which_kernels_and_why():
    gen = torch.Generator().manual_seed(seed_of("policy", "explain"))
    q, k, v = (torch.randn(1, 2, 256, 32, generator=gen) for _ in range(3))
    bm = create_block_mask(_causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    found = flexcore.explain(q, k, v, block_mask=bm)
    text = str(found)
    assert found.forward_kernel == "triton" and found.backward_kernel == "triton"
    assert "forward: Triton template (Triton interpreter)" in text
    assert "full-block runs: True (policy.forward.full_runs=True)" in text
    assert "backward: Triton template" in text and "tiles: dK/dV BLOCK_M=64, BLOCK_N=64" in text
    off = flexcore.explain(q, k, v, block_mask=bm, kernel_options=policy_options(forward={"full_runs": False}))
    assert "full-block runs: False (policy.forward.full_runs=False)" in str(off)
    # A short query takes the decoding kernel by the length rule, or not where decode=False.
    short = flexcore.explain(q[:, :, :4], k, v)
    assert short.forward_kernel == "triton-decode" and "query length 4 <= 16 (decode=None)" in str(short)
    assert flexcore.explain(q[:, :, :4], k, v, kernel_options={"decode": False}).forward_kernel == "triton"
    # Bad input is refused as flex_attention refuses it.
    with pytest.raises(InputError, match="query"):
        flexcore.explain(q[0], k, v)
    # No query rows: flex_attention returns an empty result without a kernel, and explain says so.
    empty = flexcore.explain(q[:, :, :0], k, v)
    assert (empty.forward_kernel, empty.backward_kernel) == ("none", "none") and "no rows" in str(empty)
    assert flex_attention(q[:, :, :0], k, v).shape == (1, 2, 0, 32)
    with pytest.raises(InputError, match="key"):  # no keys: refused by both
        flexcore.explain(q, k[:, :, :0], v[:, :, :0])


def test_explain_launches_nothing(monkeypatch):
    from flexcore.kernels import backward as bwd
    from flexcore.kernels import decode
    from flexcore.kernels import forward as fwd

    def refuse(*args, **kwargs):
        raise AssertionError("explain launched a kernel")

    for module, name in ((fwd, "launch"), (bwd, "launch"), (bwd, "run"), (decode, "run")):
        monkeypatch.setattr(module, name, refuse)
    q = torch.randn(1, 2, 128, 32)
    bm = create_block_mask(_causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=64)
    assert flexcore.explain(q, q, q, block_mask=bm).forward_kernel == "triton"
    assert flexcore.explain(q[:, :, :2], q, q, block_mask=None).forward_kernel == "triton-decode"


def test_explain_matches_the_choice_of_the_call(monkeypatch, caplog):
    """The dispatch log line of a call agrees with explain's account of it."""
    gen = torch.Generator().manual_seed(seed_of("policy", "log"))
    q, k, v = (torch.randn(1, 2, 128, 32, generator=gen) for _ in range(3))
    bm = create_block_mask(_causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=64)
    opts = policy_options(forward={"refine": "off"})
    found = flexcore.explain(q, k, v, block_mask=bm, kernel_options=opts)
    with caplog.at_level(logging.DEBUG, logger="flexcore.dispatch"):
        flex_attention(q, k, v, block_mask=bm, kernel_options=opts)
    lines = [r.getMessage() for r in caplog.records if r.name == "flexcore.dispatch"]
    assert len(lines) == 1 and lines[0].startswith("forward: Triton template, tables (64, 64)")
    assert "full_runs=True" in lines[0] and "full-block runs: True" in str(found)
