"""Dense masks/biases and the shapes recognised for providers without mods."""
from __future__ import annotations

import pytest
import torch

from bench import dense


def causal(b, h, q, kv):
    return q >= kv


def test_dense_mask_matches_the_mod_and_broadcasts():
    lengths = torch.tensor([5, 9])

    def padding(b, h, q, kv):
        return kv < lengths[b]

    m = dense.dense_mask(padding, 2, 3, 7, 11, "cpu")
    assert m.shape == (2, 1, 7, 11)  # depends on b, not on h
    kv = torch.arange(11)
    assert torch.equal(m[0, 0], (kv < 5).expand(7, 11)) and torch.equal(m[1, 0], (kv < 9).expand(7, 11))
    assert dense.dense_mask(causal, 2, 3, 7, 11, "cpu").shape == (1, 1, 7, 11)


def test_mask_budget_is_enforced():
    with pytest.raises(dense.NotExpressible, match="budget"):
        dense.dense_mask(causal, 1, 1, 1024, 1024, "cpu", budget_bytes=1000)


def test_classify_causal_window_and_other():
    L = 37
    assert dense.classify_mask(None, L, L).kind == "none"
    assert dense.classify_mask(dense.dense_mask(causal, 1, 1, L, L, "cpu"), L, L) == dense.MaskShape("causal", 0)
    win = dense.dense_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 5), 1, 1, L, L, "cpu")
    assert dense.classify_mask(win, L, L) == dense.MaskShape("window", 0, 5)
    # Decoding: one query at the end of 50 keys (bottom-right alignment).
    dec = dense.dense_mask(lambda b, h, q, kv: q + 49 >= kv, 1, 1, 1, 50, "cpu")
    assert dense.classify_mask(dec, 1, 50).kind == "none"  # sees every key
    dec_win = dense.dense_mask(lambda b, h, q, kv: (q + 49 >= kv) & (q + 49 - kv < 8), 1, 1, 1, 50, "cpu")
    assert dense.classify_mask(dec_win, 1, 50) == dense.MaskShape("window", 49, 8)
    other = dense.dense_mask(lambda b, h, q, kv: (q - kv) % 2 == 0, 1, 1, L, L, "cpu")
    assert dense.classify_mask(other, L, L).kind == "other"


def test_dense_bias_is_score_mod_at_zero_with_minus_inf_masked():
    slopes = torch.tensor([0.5, 0.25])

    def alibi(s, b, h, q, kv):
        return s - slopes[h] * (q - kv)

    bias = dense.dense_bias(alibi, causal, 1, 2, 6, 6, "cpu", torch.float32)
    q, kv = torch.arange(6).view(6, 1), torch.arange(6).view(1, 6)
    want = (-slopes.view(2, 1, 1) * (q - kv)).masked_fill(~(q >= kv), float("-inf"))
    assert bias.shape == (1, 2, 6, 6) and torch.equal(bias[0], want)


def test_non_additive_score_mod_is_refused():
    def softcap(s, b, h, q, kv):
        return 20 * torch.tanh(s / 20)

    with pytest.raises(dense.NotExpressible, match="additive"):
        dense.check_additive(softcap, 1, 1, 16, 16, "cpu")
    assert dense.softcap_value(softcap, 1, 1, 16, 16, "cpu") == pytest.approx(20.0)
    assert dense.softcap_value(lambda s, b, h, q, kv: s + 1, 1, 1, 16, 16, "cpu") is None


def test_alibi_slopes_are_recognised_only_for_alibi():
    slopes = torch.tensor([0.5, 0.25, 0.125])

    def alibi(s, b, h, q, kv):
        return s + slopes[h] * (kv - q)

    shape = dense.MaskShape("causal", 0)
    got = dense.alibi_slopes(alibi, shape, 1, 3, 32, 32, "cpu")
    assert got is not None and torch.allclose(got, slopes)
    assert dense.alibi_slopes(lambda s, b, h, q, kv: s + 0.1 * (kv - q) ** 2, shape, 1, 3, 32, 32, "cpu") is None
    assert dense.alibi_slopes(alibi, dense.MaskShape("none"), 1, 3, 32, 32, "cpu") is None


def test_trivial_score_detection():
    assert dense.is_trivial_score(None, 1, 1, 4, 4, "cpu")
    assert dense.is_trivial_score(lambda s, b, h, q, kv: s, 1, 1, 4, 4, "cpu")
    assert not dense.is_trivial_score(lambda s, b, h, q, kv: s * 2, 1, 1, 4, 4, "cpu")


def test_registry_variants_are_recognised_for_flash_attn():
    from bench.mods import offset_indices, resolve
    from variants.bias import alibi_slopes as registry_slopes

    def mods(spec, q_len=64, kv_len=64, H=4):
        return resolve(spec, B=1, H=H, KV_HEADS=H, Q_LEN=q_len, KV_LEN=kv_len, D=16, device="cpu")

    m = mods("alibi_causal")
    shape = dense.classify_mask(dense.dense_mask(m.mask_mod, 1, 4, 64, 64, "cpu"), 64, 64)
    assert shape == dense.MaskShape("causal", 0)
    assert torch.allclose(dense.alibi_slopes(m.score_mod, shape, 1, 4, 64, 64, "cpu"), registry_slopes(4, "cpu"))
    m = mods("softcap_causal(softcap=30)")
    assert dense.softcap_value(m.score_mod, 1, 4, 64, 64, "cpu") == pytest.approx(30.0)
    # Decoding with a sliding window: the query sits at the end, the window is bottom-right.
    m = offset_indices(mods("sliding_window(window_size=16)", 1, 100), q0=99)
    shape = dense.classify_mask(dense.dense_mask(m.mask_mod, 1, 4, 1, 100, "cpu"), 1, 100)
    assert shape == dense.MaskShape("window", 99, 16)
