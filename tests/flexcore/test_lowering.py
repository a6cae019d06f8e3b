"""Lowering of score_mod / mask_mod to Triton, checked against eager evaluation of the same mods.

Generated functions run in the dense evaluation kernel (Triton's interpreter on CPU) and are
compared with the mods evaluated by torch over the same (B, H, Q, KV) grid through nested vmaps
(the semantics of torch's flex_attention, where every index is a 0-d tensor), in float64 where the
mod computes in floats.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import flexcore
from flexcore.errors import (ControlFlowError, ModError, ModReturnError, ModSignatureError,
                             UnsupportedOpError)
from flexcore.kernels import codegen as kcodegen
from flexcore.lowering import LoweredMod, evaluate_mods, lower_mask_mod, lower_score_mod
from flexcore.lowering import api as lowering_api
from tests.flexcore.helpers import line_of

_ROOT = Path(__file__).resolve().parents[2]
# The interpreter evaluates both branches of tl.where with numpy, which warns on log(0), 1/0, ...
# (and torch.vmap, used by the eager reference, has no batching rule for masked_fill).
pytestmark = [pytest.mark.usefixtures("kernel_cache_dir"),
              pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

# 37 x 45 fills neither dimension of a tile, so every kernel call has padded rows and columns;
# one 64 x 64 tile per (b, h) keeps the interpreter fast, and the 97 x 131 tests use 32 x 32 tiles
# to cover several tiles per dimension.
B, H, Q_LEN, KV_LEN = 2, 3, 37, 45
TILE = 64


def _vmapped(mod, n_args: int):
    """mod over broadcast (b, h, q, kv) index vectors, as torch's flex_attention evaluates it."""
    def fn(*args):
        out = mod(*args)
        return out if isinstance(out, torch.Tensor) else torch.tensor(out)
    for dim in reversed(range(4)):
        in_dims = [None] * 4
        in_dims[dim] = 0
        if n_args == 5:
            in_dims = [0] + in_dims
        fn = torch.vmap(fn, in_dims=tuple(in_dims))
    return fn


def _indices(b, h, q, kv, device="cpu"):
    return [torch.arange(n, dtype=torch.int32, device=device) for n in (b, h, q, kv)]


def eager_scores(score_mod, score: torch.Tensor) -> torch.Tensor:
    b, h, q, kv = score.shape
    if score_mod is None:
        return score.clone()
    out = _vmapped(score_mod, 5)(score, *_indices(b, h, q, kv, device=score.device))
    return out.expand(score.shape).cpu()


def eager_mask(mask_mod, shape, device="cpu") -> torch.Tensor:
    if mask_mod is None:
        return torch.ones(shape, dtype=torch.bool)
    return _vmapped(mask_mod, 4)(*_indices(*shape, device=device)).expand(shape).cpu()


def assert_scores_match(score_mod, shape=(B, H, Q_LEN, KV_LEN), *, index_tiles=False,
                        atol=1e-5, rtol=1e-5, seed=0, scale=1.0, tile=TILE, device="cpu"):
    """Triton result vs eager float64; tolerance is twice eager float32's own error plus atol."""
    gen = torch.Generator().manual_seed(seed)
    score = (torch.randn(shape, generator=gen) * scale).to(device)
    out, _ = evaluate_mods(score_mod, None, *shape, score=score, index_tiles=index_tiles,
                           block_m=tile, block_n=tile)
    out, score = out.cpu(), score.cpu()
    ref64 = eager_scores(score_mod, score.double().to(device)).double()
    ref32 = eager_scores(score_mod, score.to(device)).double()
    assert out.dtype == torch.float32 and out.shape == shape
    nonfinite = ~torch.isfinite(ref64)
    assert torch.equal(torch.isnan(out), torch.isnan(ref64)), "NaN positions differ"
    assert torch.equal(out[nonfinite & ~torch.isnan(ref64)].double(),
                       ref64[nonfinite & ~torch.isnan(ref64)]), "infinities differ"
    fin = ~nonfinite
    err = (out.double() - ref64)[fin].abs()
    tol = 2 * (ref32 - ref64)[fin].abs() + atol + rtol * ref64[fin].abs()
    worst = (err - tol).max() if err.numel() else torch.tensor(-1.0)
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds tolerance"
    return out


def assert_mask_matches(mask_mod, shape=(B, H, Q_LEN, KV_LEN), *, index_tiles=False, tile=TILE,
                        device="cpu"):
    _, mask = evaluate_mods(None, mask_mod, *shape, index_tiles=index_tiles, block_m=tile,
                            block_n=tile, device=device)
    mask = mask.cpu()
    ref = eager_mask(mask_mod, shape, device=device)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, ref), f"{(mask != ref).sum().item()} positions differ"
    return mask


def _rand(*shape, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


# --------------------------------------------------------------------------- score mods
def _score_cases(device="cpu"):
    """name -> score_mod; captured tensors are fresh random tensors on ``device``."""
    slopes = torch.rand(H, generator=torch.Generator().manual_seed(3)) + 0.1
    table = _rand(2 * max(Q_LEN, KV_LEN) + 1, seed=4)
    pos = torch.randint(-50, 50, (max(Q_LEN, KV_LEN),),
                        generator=torch.Generator().manual_seed(5))
    t5_bias = _rand(32, H, seed=6)
    bias_bf16 = _rand(H, Q_LEN, seed=7, dtype=torch.bfloat16)
    big = (2**40 + torch.randint(0, 1000, (KV_LEN,), generator=torch.Generator().manual_seed(8)))
    wide = _rand(KV_LEN, 2 * H, seed=9)
    transposed = _rand(KV_LEN, Q_LEN, seed=10)
    offset = torch.tensor(0.25)
    w64 = _rand(H, seed=11, dtype=torch.float64)
    per_batch = torch.tensor([3, -7], dtype=torch.int64)
    half_bias = _rand(Q_LEN, seed=12, dtype=torch.float16)
    (slopes, table, pos, t5_bias, bias_bf16, big, wide, transposed, offset, w64, per_batch,
     half_bias) = (t.to(device) for t in (slopes, table, pos, t5_bias, bias_bf16, big, wide,
                                         transposed, offset, w64, per_batch, half_bias))
    noncontig = wide[:, ::2]  # strides (2H, 2): exercises the stride parameters
    transposed = transposed.t()
    bytes_u8 = torch.randint(0, 256, (Q_LEN,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(13)).to(device)
    nonfinite_bf16 = _rand(H, KV_LEN, seed=14, dtype=torch.bfloat16)
    nonfinite_bf16[0, 3], nonfinite_bf16[1, 5], nonfinite_bf16[2, 7] = float("inf"), float("nan"), -float("inf")
    nonfinite_bf16 = nonfinite_bf16.to(device)

    def t5_bucket(rel):
        # Bidirectional T5 buckets: 16 per direction, exact below 8, logarithmic up to 64.
        num_buckets, max_exact, max_distance = 16, 8, 64
        ret = (rel > 0).to(torch.int64) * num_buckets
        n = torch.abs(rel)
        is_small = n < max_exact
        log_ratio = torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
        val_large = max_exact + torch.floor_divide(log_ratio * (num_buckets - max_exact), 1).long()
        val_large = torch.clamp_max(val_large, num_buckets - 1)
        return ret + torch.where(is_small, n, val_large)

    cases = {
        "identity": lambda score, b, h, q_idx, kv_idx: score,
        "alibi": lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx),
        "softcap": lambda score, b, h, q_idx, kv_idx: 2.0 * torch.tanh(score / 2.0),
        "tanh_wide": lambda score, b, h, q_idx, kv_idx: torch.tanh(score * (q_idx - 18) / 4),
        "relative_table_twice": lambda score, b, h, q_idx, kv_idx:
            score + table[q_idx - kv_idx + KV_LEN] - table[kv_idx - q_idx + Q_LEN],
        "positions_read_twice": lambda score, b, h, q_idx, kv_idx:
            score + (pos[q_idx] - pos[kv_idx]) * 0.125,
        "t5_buckets": lambda score, b, h, q_idx, kv_idx:
            score + t5_bias[t5_bucket(kv_idx - q_idx), h],
        "arithmetic": lambda score, b, h, q_idx, kv_idx:
            (score * 2 - 1) / 3 + (-score) - q_idx * 0.01 + kv_idx / 7 + (2 - score) * b,
        "int_division_modes": lambda score, b, h, q_idx, kv_idx:
            score + torch.div(q_idx - kv_idx, 3, rounding_mode="floor")
            + 10 * torch.div(q_idx - kv_idx, 4, rounding_mode="trunc") + (q_idx - kv_idx) / 3,
        "int_floordiv_remainder_negative": lambda score, b, h, q_idx, kv_idx:
            score + (q_idx - kv_idx) // 4 + 100 * ((q_idx - kv_idx) % 5)
            + 1000 * ((q_idx - kv_idx) % -3) + 7 * ((kv_idx - 20) // -6)
            + torch.fmod(q_idx - kv_idx, 7),
        "float_floordiv_remainder": lambda score, b, h, q_idx, kv_idx:
            score // 0.3 + score % 0.7 + 10 * (score % -0.7) + torch.remainder(score, -1.5)
            + (score * 3) // -1.1 + torch.fmod(score, 0.45),
        "unary_math": lambda score, b, h, q_idx, kv_idx:
            torch.abs(score) + torch.exp(score) + torch.exp2(score) + torch.log(score.abs() + 1)
            + torch.log2(score.abs() + 2) + torch.sqrt(score.abs()) + torch.rsqrt(score.abs() + .1)
            + torch.sigmoid(score) + torch.sign(score) + torch.log1p(score.abs())
            + torch.expm1(score) + torch.sin(score) + torch.cos(score) + torch.erf(score),
        "small_arguments": lambda score, b, h, q_idx, kv_idx:
            torch.log1p(score * 1e-6) * 1e6 + torch.expm1(score * 1e-6) * 1e6
            + torch.tanh(score * 1e-4) * 1e4,
        "rounding": lambda score, b, h, q_idx, kv_idx:
            torch.floor(score * 3) + torch.ceil(score * 3) + torch.round(score * 4)
            + torch.trunc(score * 3) + torch.round((q_idx - 18) * 0.5) + torch.floor(q_idx),
        "pow": lambda score, b, h, q_idx, kv_idx:
            score ** 2 + score ** 3 + score.abs() ** 0.5 + score.abs() ** 1.7 + 2 ** score
            + torch.pow(score, (kv_idx % 4).float()) + ((q_idx % 5) ** 2) * 0.01
            + 0.01 * torch.pow(q_idx % 4, kv_idx % 3) + (score.abs() + 0.5) ** -1.5,
        "min_max_clamp": lambda score, b, h, q_idx, kv_idx:
            torch.minimum(score, torch.tensor(0.5)) + torch.maximum(score, kv_idx * 0.01)
            + torch.clamp(score, -1, 1) + score.clamp_min(-0.2) + score.clamp_max(0.3)
            + torch.clamp(score, min=0.1) + torch.clamp(q_idx - kv_idx, -5, 5)
            + torch.relu(score),
        "where_inf": lambda score, b, h, q_idx, kv_idx:
            torch.where(q_idx >= kv_idx, score, -float("inf")),
        "masked_fill_and_nan_checks": lambda score, b, h, q_idx, kv_idx:
            score.masked_fill(q_idx < kv_idx, -float("inf")).masked_fill(kv_idx == 3, score * 2)
            + torch.isnan(torch.log(score)).float() + torch.isinf(torch.log(score.abs())).float()
            + torch.isfinite(1 / (q_idx - kv_idx)).float() + torch.square(score),
        "where_mixed_dtypes": lambda score, b, h, q_idx, kv_idx:
            torch.where((q_idx % 3 == 0) | (kv_idx % 5 == 1), q_idx - kv_idx, score),
        "casts": lambda score, b, h, q_idx, kv_idx:
            score + (q_idx > kv_idx).float() + (score * 10).int() + q_idx.long() * 0.5
            + score.to(torch.bfloat16).float() * 3 + score.half() + score.double() / 3
            + (score > 0).int() + (score * 5).to(torch.int64) + score.bool().float(),
        "constants": lambda score, b, h, q_idx, kv_idx:
            score * torch.tensor(2.5) + torch.scalar_tensor(0.5) + torch.full_like(score, 1.5)
            + torch.zeros_like(score) + torch.ones_like(q_idx) + torch.tensor(3),
        "bf16_capture": lambda score, b, h, q_idx, kv_idx: score + bias_bf16[h, q_idx],
        "fp16_capture": lambda score, b, h, q_idx, kv_idx: score * half_bias[q_idx],
        "int64_exact": lambda score, b, h, q_idx, kv_idx:
            score + (big[kv_idx] - big[0]).float() * 0.01 + per_batch[b],
        "noncontiguous_captures": lambda score, b, h, q_idx, kv_idx:
            score + noncontig[kv_idx, h] + transposed[q_idx, kv_idx],
        "zero_dim_capture": lambda score, b, h, q_idx, kv_idx: score + offset + offset * q_idx,
        "float64_capture": lambda score, b, h, q_idx, kv_idx: score + w64[h] / 3,
        "negative_index_wraps": lambda score, b, h, q_idx, kv_idx:
            score + slopes[-1 - h] + table[q_idx - kv_idx],
        "int_literal_index": lambda score, b, h, q_idx, kv_idx: score + wide[3, 1] + wide[-1][h],
        "ellipsis_and_slices": lambda score, b, h, q_idx, kv_idx:
            score + wide[:, h][kv_idx] + wide[..., 0][q_idx],
        "shifts_and_folded_constants": lambda score, b, h, q_idx, kv_idx:
            score * torch.sqrt(torch.tensor(2.0)) + ((q_idx << 2) + ((kv_idx - 20) >> 1)) * 0.01
            + torch.bitwise_left_shift(kv_idx, q_idx % 4) * 0.001,
        "bool_arithmetic": lambda score, b, h, q_idx, kv_idx:
            score + ((q_idx > 3) & (kv_idx < 30) | ~(q_idx == kv_idx) ^ (b == 1)).float(),
        "python_float_return": lambda score, b, h, q_idx, kv_idx: 1.5,
        # Integer powers with negative exponents (0, or +-1 for bases of +-1) and a literal base.
        "int_pow_negative_exponent": lambda score, b, h, q_idx, kv_idx:
            score + torch.pow(q_idx - 20, (kv_idx % 4) - 2) + 0.01 * torch.pow(2, q_idx % 10),
        # int32 products that wrap to negative indices, which wrap around the table as in torch.
        "int32_wrap_around_index": lambda score, b, h, q_idx, kv_idx:
            score + table[(q_idx * 100000000) // 100000000] + wide[torch.fmod(kv_idx * 1000000007, KV_LEN), h],
        # An int64 product narrowed to int32 wraps to negative indices too.
        "narrowing_cast_wraps_index": lambda score, b, h, q_idx, kv_idx:
            score + table[(q_idx.long() * 3000000000).int() // 1000000000],
        # int8/int16 division and remainder at -128 and beyond (their absolute value overflows).
        "int8_floor_division_at_its_minimum": lambda score, b, h, q_idx, kv_idx:
            score + ((q_idx.to(torch.int8) * 100) // 100).float(),
        "narrow_int_remainders": lambda score, b, h, q_idx, kv_idx:
            score + ((q_idx.to(torch.int8) * 100) % 7) + torch.fmod(kv_idx.to(torch.int16) * 1000, 300)
            + torch.div(q_idx.to(torch.int8) * 3, -7, rounding_mode="trunc"),
        "python_ints_beyond_int32": lambda score, b, h, q_idx, kv_idx:
            score + (q_idx * 3000000000) * 1e-9 + (q_idx < 2**31) * 1.0,
        "uint8_bitwise_not": lambda score, b, h, q_idx, kv_idx: score + (~bytes_u8[q_idx]) * 0.01,
        "nan_to_num_bfloat16": lambda score, b, h, q_idx, kv_idx:
            score + torch.nan_to_num(nonfinite_bf16[h, kv_idx]).float() * 1e-38,
        "logical_and_of_a_head_float": lambda score, b, h, q_idx, kv_idx:
            score + torch.logical_and(h * 1.0, q_idx >= kv_idx) * 1.0,
    }
    return cases


SCORE_CASES = _score_cases()


@pytest.mark.parametrize("name", list(SCORE_CASES))
def test_score_mod_matches_eager(name):
    assert_scores_match(SCORE_CASES[name])


@pytest.mark.parametrize("name", ["alibi", "t5_buckets", "int64_exact", "negative_index_wraps"])
def test_score_mod_with_index_tiles(name):
    # The decode kernel passes b and h as [BLOCK_M, 1] tiles.
    assert_scores_match(SCORE_CASES[name], index_tiles=True)


def test_score_mod_odd_large_shape():
    # 97 x 131: several tiles in each direction, none a multiple of 32.
    table = _rand(2 * 131 + 1)
    assert_scores_match(lambda score, b, h, q_idx, kv_idx: score + table[q_idx - kv_idx + 131]
                        - table[kv_idx - q_idx + 97], shape=(1, 2, 97, 131), tile=32)


def test_bfloat16_casts_round_to_nearest_even():
    # float32 values exactly halfway between bfloat16 neighbours: truncation would differ.
    lo = torch.randn(KV_LEN).to(torch.bfloat16)
    hi = (lo.view(torch.int16) + 1).view(torch.bfloat16)  # the next magnitude up
    ties = (lo.float() + hi.float()) / 2
    assert torch.all(ties != lo.float()) and torch.all(ties != hi.float())
    assert_scores_match(lambda score, b, h, q_idx, kv_idx:
                        score * 0 + ties[kv_idx].to(torch.bfloat16).float())


def test_softcap_large_scores():
    out = assert_scores_match(SCORE_CASES["softcap"], scale=20.0)
    assert out.abs().max() <= 2.0


# --------------------------------------------------------------------------- mask mods
def _mask_cases(device="cpu"):
    doc_ids = torch.sort(torch.randint(0, 4, (max(Q_LEN, KV_LEN),),
                                       generator=torch.Generator().manual_seed(20))).values
    prefix = torch.tensor([5, 17], dtype=torch.int32)
    keep_q = torch.rand(Q_LEN, generator=torch.Generator().manual_seed(21)) > 0.3
    per_head = torch.tensor([1, 0, 1], dtype=torch.uint8)
    shift = torch.tensor(2)
    doc_lengths = torch.tensor([9, 30, 3, 40])
    tenth_f16 = torch.full((KV_LEN,), 0.1, dtype=torch.float16)
    big_f16 = torch.full((KV_LEN,), 30000.0, dtype=torch.float16)
    doc_ids, prefix, keep_q, per_head, shift, doc_lengths, tenth_f16, big_f16 = (
        t.to(device) for t in (doc_ids, prefix, keep_q, per_head, shift, doc_lengths, tenth_f16,
                               big_f16))
    window = 6

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window

    def document(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    def prefix_lm(b, h, q_idx, kv_idx):
        return kv_idx < prefix[b]

    return {
        "noop": flexcore.noop_mask,
        "causal": causal,
        "sliding_window": flexcore.and_masks(causal, sliding),
        "document": document,
        "document_causal": flexcore.and_masks(document, causal),
        "prefix_lm": flexcore.or_masks(prefix_lm, causal),
        "query_only": lambda b, h, q_idx, kv_idx: q_idx < 10,
        "captured_bool": lambda b, h, q_idx, kv_idx: keep_q[q_idx] & (kv_idx % 3 != 0),
        "head_dependent": lambda b, h, q_idx, kv_idx: (per_head[h] == 1) | (q_idx >= kv_idx),
        "logical_ops": lambda b, h, q_idx, kv_idx:
            torch.logical_xor(q_idx > kv_idx, torch.logical_not(kv_idx % 2 == 0))
            | torch.logical_and(q_idx == 3, kv_idx < 5) | torch.logical_or(b == 1, h == 2) & False,
        "negative_floordiv": lambda b, h, q_idx, kv_idx:
            ((q_idx - kv_idx) // 8 == -1) | ((kv_idx - q_idx) % 7 == 2),
        "python_true": lambda b, h, q_idx, kv_idx: True,
        "zero_dim_int_capture": lambda b, h, q_idx, kv_idx: q_idx + shift >= kv_idx,
        "nested_index": lambda b, h, q_idx, kv_idx: kv_idx < doc_lengths[doc_ids[q_idx]],
        "constant_false": lambda b, h, q_idx, kv_idx: torch.zeros_like(q_idx, dtype=torch.bool),
        "bool_cast": lambda b, h, q_idx, kv_idx: ((q_idx - kv_idx) % 4).bool(),
        # A Python float meets a float16 tensor in its dtype: f16(0.1) == 0.1, and 1e5 is inf.
        "half_compared_with_python_floats": lambda b, h, q_idx, kv_idx:
            (tenth_f16[kv_idx] == 0.1) & ~((big_f16[kv_idx] * 4.0) > 1e5) & (q_idx >= kv_idx),
    }


MASK_CASES = _mask_cases()


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_mask_mod_matches_eager(name):
    assert_mask_matches(MASK_CASES[name])


@pytest.mark.parametrize("name", ["document_causal", "prefix_lm", "head_dependent"])
def test_mask_mod_with_index_tiles(name):
    assert_mask_matches(MASK_CASES[name], index_tiles=True)


def test_mask_mod_odd_large_shape():
    assert_mask_matches(MASK_CASES["sliding_window"], shape=(2, 1, 97, 131), tile=32)


@pytest.mark.gpu
@pytest.mark.parametrize("index_tiles", [False, True])
@pytest.mark.parametrize("name", list(SCORE_CASES))
def test_score_mod_matches_eager_gpu(name, index_tiles):
    # Compiled Triton rather than the interpreter: libdevice helpers, literals, bf16/int1 loads.
    assert_scores_match(_score_cases("cuda")[name], device="cuda", index_tiles=index_tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("index_tiles", [False, True])
@pytest.mark.parametrize("name", list(MASK_CASES))
def test_mask_mod_matches_eager_gpu(name, index_tiles):
    assert_mask_matches(_mask_cases("cuda")[name], device="cuda", index_tiles=index_tiles)


@pytest.mark.gpu
def test_odd_shapes_and_large_scores_gpu():
    assert_scores_match(_score_cases("cuda")["softcap"], device="cuda", scale=20.0)
    assert_scores_match(_score_cases("cuda")["t5_buckets"], shape=(1, 2, 97, 131), tile=32,
                        device="cuda")
    doc_ids = (torch.arange(131) // 29).cuda()

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

    assert_mask_matches(document_causal, shape=(2, 1, 97, 131), tile=32, device="cuda")


def test_score_and_mask_together():
    gen = torch.Generator().manual_seed(0)
    score = torch.randn(B, H, Q_LEN, KV_LEN, generator=gen)
    out, mask = evaluate_mods(SCORE_CASES["alibi"], MASK_CASES["document_causal"], B, H, Q_LEN,
                              KV_LEN, score=score)
    torch.testing.assert_close(out, eager_scores(SCORE_CASES["alibi"], score))
    assert torch.equal(mask, eager_mask(MASK_CASES["document_causal"], score.shape))


# --------------------------------------------------------------------------- LoweredMod contract
def test_lowered_mod_fields_and_kernel_args():
    bias = _rand(H, Q_LEN)
    pos = torch.arange(KV_LEN)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx] + pos[kv_idx] - pos[q_idx]

    lowered = lower_score_mod(mod)
    assert isinstance(lowered, LoweredMod)
    assert lowered.kind == "score" and lowered.fn_name == "score_mod_fn"
    assert lowered.source.startswith("@triton.jit\ndef score_mod_fn(score, b, h, q_idx, kv_idx, "
                                     "q_ok, kv_ok, sm_c0_ptr, sm_c0_s0, sm_c0_s1, sm_c1_ptr, "
                                     "sm_c1_s0):")
    assert lowered.cap_params == ("sm_c0_ptr", "sm_c0_s0", "sm_c0_s1", "sm_c1_ptr", "sm_c1_s0")
    # The user's own objects (not copies), deduplicated though pos is read twice.
    assert len(lowered.captured) == 2
    assert lowered.captured[0] is bias and lowered.captured[1] is pos
    assert lowered.kernel_args() == [bias, *bias.stride(), pos, *pos.stride()]
    assert not lowered.is_trivial
    with pytest.raises(Exception):
        lowered.source = ""  # frozen


def test_captures_that_require_grad_are_the_original_objects():
    # The backward accumulates gradients into exactly these objects.
    slopes = torch.rand(H, requires_grad=True)
    weight = torch.nn.Parameter(torch.rand(H))

    def mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * weight[h] * (kv_idx - q_idx)

    lowered = lower_score_mod(mod)
    assert lowered.captured[0] is slopes and lowered.captured[1] is weight
    with torch.no_grad():
        assert_scores_match(mod)


def test_same_tensor_under_two_names_is_captured_once():
    table = _rand(KV_LEN)
    alias = table

    def mod(b, h, q_idx, kv_idx):
        return table[kv_idx] > alias[q_idx]

    lowered = lower_mask_mod(mod)
    assert lowered.cap_params == ("mm_c0_ptr", "mm_c0_s0")
    assert lowered.captured[0] is table
    assert lowered.kind == "mask" and lowered.fn_name == "mask_mod_fn"


def test_loads_are_masked_by_the_indices_they_depend_on():
    table = _rand(KV_LEN)
    bias = _rand(H)
    src = lower_score_mod(lambda s, b, h, q_idx, kv_idx: s + table[kv_idx] + bias[h]
                          + table[q_idx - kv_idx]).source
    assert "mask=kv_ok, other=0" in src
    assert "mask=q_ok & kv_ok, other=0" in src
    assert "tl.load(sm_c1_ptr + h * sm_c1_s0)" in src  # b/h-only loads need no mask


def test_none_and_trivial_mods():
    for lowered, kind in ((lower_score_mod(None), "score"), (lower_mask_mod(None), "mask")):
        assert lowered.is_trivial and lowered.kind == kind
        assert lowered.cap_params == () and lowered.captured == () and lowered.kernel_args() == []
        assert lowered.source.startswith("@triton.jit\ndef ")
    assert lower_score_mod(lambda score, b, h, q_idx, kv_idx: score).is_trivial
    assert lower_mask_mod(flexcore.noop_mask).is_trivial
    assert lower_mask_mod(lambda b, h, q_idx, kv_idx: True).is_trivial
    assert lower_mask_mod(flexcore.and_masks(flexcore.noop_mask, flexcore.noop_mask)).is_trivial
    assert not lower_score_mod(lambda score, b, h, q_idx, kv_idx: score * 1.0).is_trivial
    assert not lower_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= 0).is_trivial
    assert not lower_mask_mod(lambda b, h, q_idx, kv_idx: False).is_trivial
    out, mask = evaluate_mods(None, None, 1, 1, 5, 7, score=torch.arange(35.0).view(1, 1, 5, 7))
    assert torch.equal(out, torch.arange(35.0).view(1, 1, 5, 7)) and bool(mask.all())


def test_int64_stays_int64():
    # 2**40 + small differences are exact only in int64; int32 would silently wrap.
    big = 2**40 + torch.arange(KV_LEN, dtype=torch.int64) * 3
    src = lower_mask_mod(lambda b, h, q_idx, kv_idx: big[kv_idx] - 2**40 < q_idx.long() * 3).source
    assert "tl.int64" in src
    assert_mask_matches(lambda b, h, q_idx, kv_idx: big[kv_idx] - 2**40 < q_idx.long() * 3)


# --------------------------------------------------------------------------- errors
def _check_error(err, cls, mod_name, marker, *words):
    assert isinstance(err, cls), type(err)
    assert err.mod_name == mod_name
    assert err.filename == __file__
    assert err.lineno == line_of(__file__, marker), (err.lineno, line_of(__file__, marker))
    text = str(err)
    assert f"{__file__}:{err.lineno}" in text and mod_name in text
    for word in words:
        assert word in text, (word, text)


def test_unsupported_op_names_op_and_line():
    def uses_zeta(score, b, h, q_idx, kv_idx):
        x = score * 2
        return torch.special.zeta(x / 10, 2.0)  # MARK-zeta

    with pytest.raises(UnsupportedOpError) as info:
        lower_score_mod(uses_zeta)
    _check_error(info.value, UnsupportedOpError, "uses_zeta", "MARK-zeta",
                 "torch.special.zeta", "aten.special_zeta", "no Triton implementation")
    assert info.value.op == "torch.special.zeta"


def test_unsupported_tensor_method_names_method():
    def uses_nextafter(b, h, q_idx, kv_idx):
        return q_idx.float().nextafter(kv_idx.float()) > 0.5  # MARK-nextafter

    with pytest.raises(UnsupportedOpError) as info:
        lower_mask_mod(uses_nextafter)
    _check_error(info.value, UnsupportedOpError, "uses_nextafter", "MARK-nextafter",
                 "Tensor.nextafter")


@pytest.mark.parametrize("variant", ["if", "bool", "item", "int", "while", "and", "range"])
def test_python_control_flow_on_tensors(variant):
    def branchy(b, h, q_idx, kv_idx):
        if variant == "if":
            if q_idx > 5:  # MARK-cf-if
                return q_idx >= kv_idx
            return kv_idx > 3
        if variant == "bool":
            return torch.tensor(bool(q_idx > kv_idx))  # MARK-cf-bool
        if variant == "item":
            return q_idx > (kv_idx.item() + 1)  # MARK-cf-item
        if variant == "int":
            return kv_idx < int(q_idx)  # MARK-cf-int
        if variant == "while":
            x = kv_idx
            while x < q_idx:  # MARK-cf-while
                x = x + 1
            return x > 0
        if variant == "and":
            return (q_idx > 3) and (kv_idx > 2)  # MARK-cf-and
        return q_idx > sum(1 for _ in range(kv_idx))  # MARK-cf-range

    with pytest.raises(ControlFlowError) as info:
        lower_mask_mod(branchy)
    _check_error(info.value, ControlFlowError, "branchy", f"MARK-cf-{variant}", "torch.where")


def test_wrong_arity():
    def three(b, h, q_idx):
        return q_idx > 0

    with pytest.raises(ModSignatureError) as info:
        lower_mask_mod(three)
    assert info.value.mod_name == "three" and "4 arguments" in str(info.value)
    with pytest.raises(ModSignatureError, match="5 arguments"):
        lower_score_mod(lambda b, h, q_idx, kv_idx: q_idx > 0)
    with pytest.raises(ModSignatureError):
        lower_mask_mod(lambda score, b, h, q_idx, kv_idx: q_idx > 0)
    # *args and trailing defaults are fine.
    assert not lower_mask_mod(lambda *args: args[2] >= args[3]).is_trivial
    assert lower_score_mod(lambda s, b, h, q, kv, extra=1.0: s * extra).cap_params == ()


def test_bad_return_values():
    def float_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).float()  # MARK-floatmask

    with pytest.raises(ModReturnError) as info:
        lower_mask_mod(float_mask)
    _check_error(info.value, ModReturnError, "float_mask", "MARK-floatmask", "bool tensor")

    def bool_score(score, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(ModReturnError, match="mask_mod"):
        lower_score_mod(bool_score)
    with pytest.raises(ModReturnError):
        lower_score_mod(lambda score, b, h, q_idx, kv_idx: "score")
    with pytest.raises(ModReturnError):
        lower_mask_mod(lambda b, h, q_idx, kv_idx: 1.0)
    table = _rand(H, KV_LEN)
    with pytest.raises(ModError, match="index every dimension"):
        lower_score_mod(lambda score, b, h, q_idx, kv_idx: score + table[h])


@pytest.mark.parametrize("op", ["floor_divide", "remainder", "div_floor", "div_trunc", "fmod"])
def test_integer_division_by_a_constant_zero(op):
    """torch raises ZeroDivisionError for an integer division by zero; the lowering names the
    mod and its line instead of letting the kernel compute an arbitrary value."""
    divide = {"floor_divide": lambda x: x // 0, "remainder": lambda x: x % 0,
              "div_floor": lambda x: torch.div(x, 0, rounding_mode="floor"),
              "div_trunc": lambda x: torch.div(x, 0, rounding_mode="trunc"),
              "fmod": lambda x: torch.fmod(x, 0)}[op]

    def by_zero(score, b, h, q_idx, kv_idx):
        return score + divide(q_idx)  # MARK-zerodiv

    with pytest.raises(ModError, match="integer division by zero") as info:
        lower_score_mod(by_zero)
    assert info.value.mod_name == "by_zero"
    # Dividing by a nonzero constant, or a float by zero (inf, as in torch), lowers.
    lower_score_mod(lambda score, b, h, q_idx, kv_idx: score + q_idx // 3)
    lower_score_mod(lambda score, b, h, q_idx, kv_idx: score + q_idx / 0.0)


def test_mod_errors_are_the_exceptions_torch_raises():
    """A mod torch cannot trace raises RuntimeError there; a wrong signature TypeError; an index
    out of range IndexError: flexcore's errors are those too, for code that catches torch's."""
    with pytest.raises(RuntimeError):
        lower_score_mod(lambda score, b, h, q_idx, kv_idx: score * (q_idx.item() + 1))
    with pytest.raises(TypeError):
        lower_score_mod(lambda score, b, h: score)
    with pytest.raises(ModSignatureError):
        lower_score_mod(lambda score, b, h: score)
    table = _rand(H, KV_LEN)
    with pytest.raises(IndexError):
        lower_mask_mod(lambda b, h, q_idx, kv_idx: table[H, kv_idx] > 0)


def test_a_captured_meta_tensor_is_named():
    """The lowering traces meta tensors (flexcore.ops lowers on stand-ins); a call that would
    run the kernels on one is refused, naming it."""
    on_meta = torch.empty(H, device="meta")
    lower_score_mod(lambda score, b, h, q_idx, kv_idx: score + on_meta[h])
    q = torch.randn(1, H, 16, 16)
    with pytest.raises(ModError, match=r"on_meta is a meta tensor: it holds no values"):
        flexcore.flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score + on_meta[h])


def test_constant_index_out_of_range():
    table = _rand(H, KV_LEN)

    def off_the_end(b, h, q_idx, kv_idx):
        return table[H, kv_idx] > 0  # MARK-oob

    with pytest.raises(ModError, match="out of range") as info:
        lower_mask_mod(off_the_end)
    assert info.value.lineno == line_of(__file__, "MARK-oob")


def test_other_exceptions_are_wrapped_with_line():
    def typo(b, h, q_idx, kv_idx):
        return q_idx >= kv_idxx  # noqa: F821  MARK-nameerror

    with pytest.raises(ModError) as info:
        lower_mask_mod(typo)
    _check_error(info.value, ModError, "typo", "MARK-nameerror", "NameError")
    assert isinstance(info.value.__cause__, NameError)

    table = _rand(H, KV_LEN)

    def too_many(b, h, q_idx, kv_idx):
        return table[h, q_idx, kv_idx] > 0  # MARK-toomany

    with pytest.raises(ModError) as info:
        lower_mask_mod(too_many)
    assert info.value.lineno == line_of(__file__, "MARK-toomany")

    def bad_slice(b, h, q_idx, kv_idx):
        return table[q_idx:, kv_idx][h] > 0  # MARK-slice

    with pytest.raises(ModError, match="slice") as info:
        lower_mask_mod(bad_slice)
    assert info.value.lineno == line_of(__file__, "MARK-slice")


# --------------------------------------------------------------------------- caching
def test_repeat_lowering_is_cached_and_cheap():
    import time
    slopes = _rand(H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    first = lower_score_mod(alibi)
    traces = lowering_api.trace_count
    start = time.perf_counter()
    for _ in range(200):
        again = lower_score_mod(alibi)
    per_call = (time.perf_counter() - start) / 200
    assert again is first and lowering_api.trace_count == traces
    assert per_call < 5e-4, f"{per_call * 1e6:.0f} us per cached lowering"


def test_mutating_a_capture_keeps_source_and_is_seen():
    slopes = _rand(H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    before = lower_score_mod(alibi)
    assert_scores_match(alibi)
    compiled = kcodegen.compile_count
    slopes.mul_(-3.0).add_(1.0)
    after = lower_score_mod(alibi)
    assert after is before and after.key == before.key and after.source == before.source
    assert_scores_match(alibi, seed=5)  # evaluation sees the new values
    assert kcodegen.compile_count == compiled


BIAS_GLOBAL = torch.zeros(H)


def _global_bias_mod(score, b, h, q_idx, kv_idx):
    return score + BIAS_GLOBAL[h]


def test_rebinding_a_global_gives_new_capture_same_source():
    global BIAS_GLOBAL
    first = lower_score_mod(_global_bias_mod)
    assert first.captured[0] is BIAS_GLOBAL
    assert_scores_match(_global_bias_mod)
    compiled = kcodegen.compile_count
    BIAS_GLOBAL = _rand(H, seed=42)
    second = lower_score_mod(_global_bias_mod)
    assert second.captured[0] is BIAS_GLOBAL
    assert second.source == first.source and second.key == first.key
    assert_scores_match(_global_bias_mod)
    assert kcodegen.compile_count == compiled  # same source: nothing recompiles


def test_rebinding_a_closure_and_inner_mods_of_and_masks():
    doc = torch.zeros(KV_LEN, dtype=torch.int64)
    window = 4

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < window

    combined = flexcore.and_masks(same_doc, near)
    first = lower_mask_mod(combined)
    assert_mask_matches(combined)
    doc = torch.arange(KV_LEN) // 10  # a new tensor through the inner closure
    second = lower_mask_mod(combined)
    assert second.captured[0] is doc and second.source == first.source
    assert_mask_matches(combined)
    window = 9  # a scalar is part of the code: new source, correct result
    third = lower_mask_mod(combined)
    assert third.source != second.source and "9" in third.source
    assert_mask_matches(combined)


WINDOWS = [4]


def _list_window_mask(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < WINDOWS[0]


def test_in_place_changes_are_seen_through_the_fast_path():
    # Reuse by identity (no key rebuilt) must not hide what changes in place: a list's contents,
    # a tensor's shape or dtype, a function's code.
    first = lower_mask_mod(_list_window_mask)
    assert lower_mask_mod(_list_window_mask) is first
    WINDOWS[0] = 11
    second = lower_mask_mod(_list_window_mask)
    assert second.source != first.source and "11" in second.source
    assert_mask_matches(_list_window_mask)

    table = _rand(H, seed=3)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * table[h]

    before = lower_score_mod(scaled)
    assert lower_score_mod(scaled) is before
    table.resize_(H + 3)  # same object, new shape: the strides and bounds change
    resized = lower_score_mod(scaled)
    assert resized is not before and resized.captured[0] is table

    def plus_one(score, b, h, q_idx, kv_idx):
        return score + 1.0

    one = lower_score_mod(plus_one)
    plus_one.__code__ = (lambda score, b, h, q_idx, kv_idx: score - 2.0).__code__
    two = lower_score_mod(plus_one)
    assert two is not one and two.source != one.source


def test_new_capture_object_with_same_shape_reuses_source():
    def make(slopes):
        return lambda score, b, h, q_idx, kv_idx: score * slopes[h]

    a, b = lower_score_mod(make(_rand(H, seed=1))), lower_score_mod(make(_rand(H, seed=2)))
    assert a.captured[0] is not b.captured[0]
    assert a.source == b.source and a.key == b.key


def test_lowering_does_not_import_kernel_helpers():
    # triton_helpers runs @triton.jit at import, so only generated kernel modules may import it
    # (a subprocess would check this directly but costs seconds of torch import).
    import ast
    for path in (_ROOT / "flexcore" / "lowering").glob("*.py"):
        if path.name == "triton_helpers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "triton_helpers" not in (node.module or ""), path
                assert all(a.name != "triton_helpers" for a in node.names), path
            elif isinstance(node, ast.Import):
                assert all("triton_helpers" not in a.name for a in node.names), path


def test_fast_math_lowers_tanh_to_the_approximate_instruction():
    # 16-bit inputs: softcapping's tanh becomes one MUFU instruction; float32/float64 stay exact.
    from flexcore.lowering import lower_score_mod

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    fast = lower_score_mod(softcap, torch.float32, fast_math=True)
    exact = lower_score_mod(softcap, torch.float32)
    assert "fl_tanh_approx(" in fast.source and "fl_tanh_approx(" not in exact.source
    assert "fl_tanh(" in exact.source and fast.key != exact.key
    assert "fl_tanh_approx(" not in lower_score_mod(softcap, torch.float64, fast_math=True).source


def test_bf16_softcap_matches_the_reference_through_fast_math():
    from flexcore import AuxRequest, create_block_mask, flex_attention
    from flexcore.lowering import api
    from tests.flexcore.compare import assert_matches_reference

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    gen = torch.Generator().manual_seed(77)
    q, k, v = (torch.randn(1, 2, 80, 32, generator=gen).to(torch.bfloat16) * 4 for _ in range(3))
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 80, 80, device="cpu", BLOCK_SIZE=32)
    out, aux = flex_attention(q, k, v, score_mod=softcap, block_mask=bm,
                              return_aux=AuxRequest(lse=True))
    lse = aux.lse
    assert "fl_tanh_approx(" in api.lower_mod(softcap, "score", torch.float32, True).source
    assert_matches_reference(q, k, v, softcap, bm, out, lse, "bf16 softcap")


# --------------------------------------------------------------------------- per-element semantics
# attention-gym's masks and mods (pytorch-labs/attention-gym, attn_gym/masks and attn_gym/mods),
# written again here, checked against torch's own create_mask / eager flex_attention.
def _flamingo(intervals, image_tokens):
    """Flamingo cross-attention: text token q sees the tokens of image i when q lies in
    intervals[i] = [start, end)."""
    image_of = torch.arange(intervals.shape[0]).repeat_interleave(image_tokens)

    def vision_cross_attention(b, h, q_idx, kv_idx):
        bounds = intervals[image_of[kv_idx]]
        return (q_idx >= bounds[0]) & (q_idx < bounds[1])
    return vision_cross_attention


def _document(offsets, inner):
    """Packed documents: position p belongs to document doc[p]; inner sees document-local
    positions p - offsets[doc[p]]."""
    doc = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets[1:] - offsets[:-1])

    def document(b, h, q_idx, kv_idx):
        local_q = q_idx - offsets[doc[q_idx]]
        local_kv = kv_idx - offsets[doc[kv_idx]]
        return (doc[q_idx] == doc[kv_idx]) & inner(b, h, local_q, local_kv)
    return document


def _natten(width, height, kernel_w, kernel_h):
    def natten(b, h, q_idx, kv_idx):
        qx, qy = q_idx // width, q_idx % width
        kx, ky = kv_idx // width, kv_idx % width
        cx = qx.clamp(kernel_w // 2, (width - 1) - kernel_w // 2)
        cy = qy.clamp(kernel_h // 2, (height - 1) - kernel_h // 2)
        return ((cx - kx).abs() <= kernel_w // 2) & ((cy - ky).abs() <= kernel_h // 2)
    return natten


def _spread_bits(x):
    x = x & 0x0000FFFF
    x = (x | (x << 8)) & 0x00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F
    x = (x | (x << 2)) & 0x33333333
    return (x | (x << 1)) & 0x55555555


def _gather_bits(code):
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    code = (code | (code >> 4)) & 0x00FF00FF
    return (code | (code >> 8)) & 0x0000FFFF


def _morton_natten(width, kernel):
    """NATTEN over a Morton (Z-order) layout: coordinates come from de-interleaved bits."""
    def morton_natten(b, h, q_idx, kv_idx):
        qx, qy = _gather_bits(q_idx), _gather_bits(q_idx >> 1)
        kx, ky = _gather_bits(kv_idx), _gather_bits(kv_idx >> 1)
        cx = qx.clamp(kernel // 2, width - 1 - kernel // 2)
        cy = qy.clamp(kernel // 2, width - 1 - kernel // 2)
        return ((cx - kx).abs() <= kernel // 2) & ((cy - ky).abs() <= kernel // 2) \
            & (_spread_bits(qx) | (_spread_bits(qy) << 1) == q_idx)
    return morton_natten


def _sta_2d(canvas, kernel, tile, text):
    """Sliding tile attention over a (canvas x canvas) image of (tile x tile) tiles, then text."""
    tiles = canvas // tile
    kt = kernel // tile
    vision = canvas * canvas

    def sta(b, h, q_idx, kv_idx):
        qt, kt_ = q_idx // (tile * tile), kv_idx // (tile * tile)
        qh, qw, kh, kw = qt // tiles, qt % tiles, kt_ // tiles, kt_ % tiles
        ch = qh.clamp(kt // 2, tiles - 1 - (kt // 2 + kt % 2 - 1))
        cw = qw.clamp(kt // 2, tiles - 1 - (kt // 2 + kt % 2 - 1))
        near = ((kh >= ch - kt // 2) & (kh <= ch + kt // 2 + kt % 2 - 1)
                & (kw >= cw - kt // 2) & (kw <= cw + kt // 2 + kt % 2 - 1))
        both_vision = (q_idx < vision) & (kv_idx < vision)
        to_text = (q_idx < vision) & (kv_idx >= vision) & (kv_idx < vision + text)
        from_text = (q_idx >= vision) & (kv_idx < vision + text)
        return (both_vision & near) | to_text | from_text
    return sta


def _svg_temporal(prompt, frames, per_frame, width):
    def temporal(b, h, q_idx, kv_idx):
        band = (width * per_frame) // frames
        q_tok = (q_idx - prompt) % per_frame
        kv_tok = (kv_idx - prompt) % per_frame
        return (kv_idx < prompt) | (q_idx < prompt) | (torch.abs(q_tok - kv_tok) < band)
    return temporal


def _gym_masks():
    intervals = torch.tensor([[0, 7], [1, 7], [7, 12], [3, 10]], dtype=torch.int32)
    offsets = torch.tensor([0, 5, 6, 17, 30, 41])
    prefix = torch.tensor([9, 14])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def dilated(b, h, q_idx, kv_idx):
        d = torch.abs(q_idx - kv_idx)
        return (d <= 9) & (d % 3 == 0)

    def batchify(b, h, q_idx, kv_idx):
        return (q_idx // 8 == kv_idx // 8) & causal(b, h, q_idx % 8, kv_idx % 8)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    return {  # name -> (mask_mod, (B, H, Q_LEN, KV_LEN))
        "flamingo": (_flamingo(intervals, 3), (1, 1, 12, 12)),
        "flamingo_batched": (_flamingo(intervals, 5), (2, 2, 12, 20)),
        "document_causal": (_document(offsets, causal), (1, 1, 41, 41)),
        "natten": (_natten(6, 7, 3, 3), (1, 1, 42, 42)),
        "morton_natten": (_morton_natten(8, 3), (1, 1, 64, 64)),
        "sta_2d": (_sta_2d(8, 4, 2, 5), (1, 1, 69, 69)),
        "dilated_sliding_window": (dilated, (1, 2, 37, 45)),
        "batchify": (batchify, (1, 1, 32, 32)),
        "svg_temporal": (_svg_temporal(3, 4, 9, 2), (1, 1, 39, 39)),
        "prefix_lm": (prefix_lm, (2, 1, 33, 33)),
    }


GYM_MASKS = _gym_masks()


@pytest.mark.parametrize("name", list(GYM_MASKS))
def test_attention_gym_masks_match_torch(name):
    from torch.nn.attention.flex_attention import create_mask as torch_create_mask

    from flexcore.lowering import call_per_element

    mod, shape = GYM_MASKS[name]
    expected = torch_create_mask(mod, *shape, device="cpu")
    _, kernel = evaluate_mods(None, mod, *shape, block_m=32, block_n=32)
    assert torch.equal(kernel, expected), f"kernel: {(kernel != expected).sum()} positions differ"
    grid = [torch.arange(n, dtype=torch.int32).view([-1 if d == k else 1 for d in range(4)])
            for k, n in enumerate(shape)]
    eager = call_per_element(mod, tuple(grid), "mask").expand(shape)
    assert torch.equal(eager, expected), f"eager: {(eager != expected).sum()} positions differ"


def test_per_element_evaluation_matches_vmap_for_views_and_reductions():
    from flexcore.lowering import call_per_element

    table = torch.randn(9, 11)
    rows = torch.randn(3, 4)

    def mod(score, b, h, q_idx, kv_idx):
        return (score + table[q_idx][kv_idx] + torch.dot(rows[h], rows[2 - h])
                + q_idx.unsqueeze(0).float().sum() + table.T[kv_idx][q_idx])

    score = torch.randn(2, 3, 9, 11)
    grid = [torch.arange(n, dtype=torch.int32).view([-1 if d == k else 1 for d in range(4)])
            for k, n in enumerate(score.shape)]
    ours = call_per_element(mod, (score, *grid), "score")
    torch.testing.assert_close(ours, eager_scores(mod, score))


def test_mla_rope_dot_matches_torch_flex_attention():
    # attention-gym's multi-head latent attention RoPE term: a dot product of per-position rows.
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    from flexcore import AuxRequest, flex_attention
    from tests.flexcore.compare import assert_matches_reference

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    query_rope = torch.randn(1, 2, 40, 8, generator=gen)
    key_rope = torch.randn(1, 1, 40, 8, generator=gen)

    def mla_rope(score, b, h, q_idx, kv_idx):
        return score + 0.5 * torch.dot(query_rope[b, h, q_idx], key_rope[b, h // 2, kv_idx])

    expected = torch_flex_attention(q, k, v, score_mod=mla_rope)
    out, aux = flex_attention(q, k, v, score_mod=mla_rope, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert_matches_reference(q, k, v, mla_rope, None, out, lse, "mla rope")


def test_nested_index_of_a_trained_bias_gets_its_gradient():
    # score + bias[q_idx][kv_idx] with a learnable bias: the backward scatters into bias.
    from flexcore import flex_attention
    from flexcore.reference import flex_attention_reference

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen).requires_grad_() for _ in range(3))
    bias = torch.randn(24, 24, generator=gen).requires_grad_()

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx][kv_idx]

    grad = torch.randn(1, 2, 24, 16, generator=gen)
    out = flex_attention(q, k, v, score_mod=rel_bias)
    got = torch.autograd.grad(out, (q, k, v, bias), grad)
    gold = flex_attention_reference(q, k, v, score_mod=rel_bias)
    want = torch.autograd.grad(gold, (q, k, v, bias), grad.double())
    base = flex_attention_reference(q, k, v, score_mod=rel_bias, upcast=False)
    base_grads = torch.autograd.grad(base, (q, k, v, bias), grad)
    for name, g, w, b in zip("qkv", got, want, base_grads):
        err = (g.double() - w).norm() / w.norm()
        base_err = (b.double() - w).norm() / w.norm()
        assert err <= 2 * base_err + 1e-5, f"d{name}: {err:.3g} vs torch {base_err:.3g}"
    err = (got[3].double() - want[3]).norm() / want[3].norm()
    base_err = (base_grads[3].double() - want[3]).norm() / want[3].norm()
    assert err <= 2 * base_err + 1e-5, f"d bias: {err:.3g} vs torch {base_err:.3g}"


def test_flamingo_through_create_block_mask_and_flex_attention():
    # Needs create_block_mask to evaluate mask_mods per element on the CPU (flexcore.blockmask's
    # _call_mod through flexcore.lowering.call_per_element).
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    from flexcore import create_block_mask, flex_attention

    mod, (B, H, L, S) = GYM_MASKS["flamingo_batched"]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, L, 16, generator=gen)
    k, v = (torch.randn(B, H, S, 16, generator=gen) for _ in range(2))
    bm = create_block_mask(mod, B, H, L, S, device="cpu", BLOCK_SIZE=16)
    expected = torch_flex_attention(q, k, v, block_mask=torch_block_mask(mod, B, H, L, S,
                                                                          device="cpu"))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=bm), expected,
                               atol=2e-5, rtol=2e-5)


def test_flamingo_mask_in_the_kernels_matches_torch():
    # Every block partial, so the kernel evaluates the lowered mask_mod at every position.
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    from flexcore import BlockMask, flex_attention

    mod, (B, H, L, S) = GYM_MASKS["flamingo_batched"]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(B, H, L, 16, generator=gen)
    k, v = (torch.randn(B, H, S, 16, generator=gen) for _ in range(2))
    num = torch.full((B, H, 1), 2, dtype=torch.int32)
    idx = torch.arange(2, dtype=torch.int32).expand(B, H, 1, 2).contiguous()
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, mask_mod=mod, seq_lengths=(L, S))
    expected = torch_flex_attention(q, k, v, block_mask=torch_block_mask(mod, B, H, L, S,
                                                                          device="cpu"))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=bm), expected,
                               atol=2e-5, rtol=2e-5)


def test_a_mod_lowered_for_many_values_says_why_once():
    """A mod reading a Python number that changes between calls (a decoding position) is lowered
    once per value: the 8th distinct lowering warns, naming the mod and the remedy; repeated values
    and captured tensors do not count."""
    import warnings

    from flexcore.errors import RelowerWarning
    from flexcore.lowering import api

    def at(pos):
        def shifted_alibi(score, b, h, q_idx, kv_idx):
            return score + (kv_idx - q_idx - pos) * 0.125
        return shifted_alibi

    api.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RelowerWarning)
        for pos in list(range(api.RELOWER_WARNING_AT - 1)) * 2:  # seven values, each twice
            lower_score_mod(at(pos))
        def shifted_by(offset):
            def shifted(score, b, h, q_idx, kv_idx):
                return score + (kv_idx - q_idx - offset) * 0.125
            return shifted

        for pos in range(20):  # a captured tensor: one lowering for every value
            lower_score_mod(shifted_by(torch.tensor(pos)))
    with pytest.warns(RelowerWarning, match="score_mod 'shifted_alibi' has been lowered to 8 different kernels"):
        lower_score_mod(at(100))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RelowerWarning)
        lower_score_mod(at(101))  # once per mod
    api.clear_cache()
