"""Every variant of the registry through flexcore: kernel vs float64 reference, BlockMask vs the
dense mask, and gradients of every score mod. A new variant is covered without new test code."""
from __future__ import annotations

import pytest
import torch

import variants
from flexcore import flex_attention
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference
from tests.variants.helpers import CASES, HEADS, SCORE_CASES, dense_mask, make_case

#: Block size of the BlockMask checks: small, so that 97 / 131 tokens give many block kinds.
BLOCK = 32
#: Block size and tiles of the kernel runs: larger, since the interpreter costs per tile step.
KERNEL_BLOCK = 64
HEAD_DIM = 16
KERNEL_OPTIONS = {"BLOCK_M": KERNEL_BLOCK, "BLOCK_N": KERNEL_BLOCK}


def _inputs(mods, seed: int, dtype=torch.float32):
    shape = mods.shape
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.B, shape.H, shape.Q_LEN, HEAD_DIM, generator=generator, dtype=dtype)
    k = torch.randn(shape.B, shape.H, shape.KV_LEN, HEAD_DIM, generator=generator, dtype=dtype)
    v = torch.randn(shape.B, shape.H, shape.KV_LEN, HEAD_DIM, generator=generator, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("name,setting", CASES)
def test_block_mask_matches_dense_mask(name, setting):
    mods = make_case(name, setting)
    shape = mods.shape
    dense = dense_mask(mods.mask_mod, shape.B, shape.H, shape.Q_LEN, shape.KV_LEN)
    if not mods.batch_dependent:
        assert (dense == dense[:1]).all(), f"{mods.name} varies with b but is not batch_dependent"
    if not mods.head_dependent:
        assert (dense == dense[:, :1]).all(), f"{mods.name} varies with h but is not head_dependent"
    block_mask = mods.create_block_mask(BLOCK_SIZE=BLOCK)
    block_map = block_mask.block_map().expand(shape.B, shape.H, -1, -1)
    q_blocks, kv_blocks = block_map.shape[-2:]
    for i in range(q_blocks):
        for j in range(kv_blocks):
            tile = dense[:, :, i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            expected = torch.where(tile.all(-1).all(-1), 2,
                                   torch.where(tile.any(-1).any(-1), 1, 0))
            assert torch.equal(block_map[:, :, i, j].long(), expected.long()), (
                f"{mods.name}: block ({i}, {j}) classified {block_map[:, :, i, j].tolist()}, "
                f"dense mask says {expected.tolist()}")
    # The token-level mask that the BlockMask implies (full blocks kept whole, partial blocks
    # through mask_mod) is the dense mask.
    expanded = block_map.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    expanded = expanded[..., :shape.Q_LEN, :shape.KV_LEN]
    implied = (expanded == 2) | ((expanded == 1) & dense)
    assert torch.equal(implied, dense)


@pytest.mark.parametrize("name,setting", CASES)
def test_kernel_matches_float64_reference(name, setting):
    mods = make_case(name, setting)
    q, k, v = _inputs(mods, seed=len(name) + len(setting))
    block_mask = mods.create_block_mask(BLOCK_SIZE=KERNEL_BLOCK)
    out, lse = flex_attention(q, k, v, score_mod=mods.score_mod, block_mask=block_mask,
                              return_lse=True, kernel_options=KERNEL_OPTIONS)
    golden, golden_lse = flex_attention_reference(q, k, v, score_mod=mods.score_mod,
                                                  block_mask=block_mask, return_lse=True)
    baseline, baseline_lse = flex_attention_reference(q, k, v, score_mod=mods.score_mod,
                                                      block_mask=block_mask, return_lse=True,
                                                      upcast=False)
    assert out.dtype == torch.float32 and out.shape == golden.shape
    assert_close_to_reference(out, golden, baseline, name=f"{mods.name} out")
    assert_close_to_reference(lse, golden_lse, baseline_lse, name=f"{mods.name} lse")


def _grads(mods, q, k, v, run):
    """Gradients of ``sum(out * weight)`` w.r.t. q, k, v and every learnable captured tensor."""
    learnable = {n: t for n, t in mods.captured.items() if t.requires_grad}
    leaves = [q, k, v, *learnable.values()]
    for t in learnable.values():
        t.grad = None
    out = run(q, k, v)
    # Drawn in float32 for every run, so that the float64 golden weighs the same values.
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), leaves)
    return dict(zip(["dq", "dk", "dv", *(f"d{n}" for n in learnable)], grads))


@pytest.mark.parametrize("name,setting", SCORE_CASES)
def test_gradients_match_float64_reference(name, setting):
    mods = make_case(name, setting)
    block_mask = mods.create_block_mask(BLOCK_SIZE=KERNEL_BLOCK)
    q, k, v = (t.requires_grad_() for t in _inputs(mods, seed=7))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))

    def kernel(q_, k_, v_):
        return flex_attention(q_, k_, v_, score_mod=mods.score_mod, block_mask=block_mask,
                              kernel_options=KERNEL_OPTIONS)

    def reference(upcast):
        return lambda q_, k_, v_: flex_attention_reference(
            q_, k_, v_, score_mod=mods.score_mod, block_mask=block_mask, upcast=upcast)

    try:
        ours = _grads(mods, q, k, v, kernel)
    except NotImplementedError as error:
        if "flexcore" not in str(error):
            raise
        pytest.skip(f"flexcore's backward kernel has not landed: {error}")
    golden = _grads(mods, q64, k64, v64, reference(True))
    baseline = _grads(mods, q, k, v, reference(False))
    assert ours.keys() == golden.keys()
    # Relative Frobenius error, as the backward's own tests. A captured tensor's gradient sums
    # score' * dS over every position, and the fused backward's dS = P * (dP - delta) takes
    # delta = rowsum(dO * O) from the forward's rounded output (as FlashAttention does), so its
    # float32 error reaches ~3x eager autograd's; those get a factor of 4 (docs/decisions.md).
    # A 0.05% error in any gradient still fails.
    for grad_name in ours:
        factor = 4.0 if grad_name not in ("dq", "dk", "dv") else 2.0
        assert_close_to_reference(ours[grad_name], golden[grad_name], baseline[grad_name],
                                  factor=factor, metric="rel_fro", name=f"{mods.name} {grad_name}")


@pytest.mark.parametrize("name", [name for name, setting in CASES if setting == "default"])
def test_decode_kernel_matches_float64_reference(name):
    # Five queries against 103 keys: flexcore's split-KV decoding path, where h is a tile.
    variant = variants.get(name)
    mods = variant.make(B=2 if variant.batch_dependent else 1, H=HEADS, Q_LEN=5,
                        KV_LEN=variant.default_kv_len(103))
    q, k, v = _inputs(mods, seed=len(name))
    block_mask = mods.create_block_mask(BLOCK_SIZE=KERNEL_BLOCK)
    out = flex_attention(q, k, v, score_mod=mods.score_mod, block_mask=block_mask)
    golden = flex_attention_reference(q, k, v, score_mod=mods.score_mod, block_mask=block_mask)
    baseline = flex_attention_reference(q, k, v, score_mod=mods.score_mod,
                                        block_mask=block_mask, upcast=False)
    assert_close_to_reference(out, golden, baseline, name=f"{mods.name} decode")
