"""Relative-position score biases: ALiBi, learned relative bias (Shaw et al.), T5 buckets,
Sandwich and KERPLE."""
from __future__ import annotations

import math

import torch

from variants.basic import generate_causal_mask
from variants.core import Mods, Param, Reference, Variant, VariantError


def alibi_slopes(H: int, device) -> torch.Tensor:
    """ALiBi's per-head slopes, ``(H,)`` float32: the geometric sequence starting at
    ``2**(-8/n)`` for n heads; for H not a power of two, those of the nearest lower power of two
    followed by every other slope of the next one."""
    def geometric(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 2 ** math.floor(math.log2(H))
    slopes = geometric(lower) + geometric(2 * lower)[0::2][: H - lower]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def generate_alibi_bias(slopes: torch.Tensor):
    """ALiBi: ``score - slope[h] * (q_idx - kv_idx)``, a linear penalty on distance.

    Args:
        slopes: ``(H,)`` float tensor from ``alibi_slopes``.
    """
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    alibi.__name__ = f"alibi_{slopes.numel()}heads"
    return alibi


def learned_relative_table(H: int, max_distance: int, init_std: float, seed: int,
                           device) -> torch.Tensor:
    """Learnable ``(H, 2 * max_distance + 1)`` float32 bias table, seeded normal init."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(H, 2 * max_distance + 1, generator=generator) * init_std
    return table.to(device).requires_grad_()


def generate_relative_bias(table: torch.Tensor):
    """Learned relative-position bias: ``score + table[h, clip(kv_idx - q_idx, -K, K) + K]``.

    Args:
        table: ``(H, 2K + 1)`` float tensor (learnable), K the clipping distance.
    """
    max_distance = (table.shape[-1] - 1) // 2

    def relative_bias(score, b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx
        clipped = torch.where(offset > max_distance, max_distance,
                              torch.where(offset < -max_distance, -max_distance, offset))
        return score + table[h, clipped + max_distance]

    relative_bias.__name__ = f"relative_bias_clip{max_distance}"
    return relative_bias


def t5_relative_buckets(q_len: int, kv_len: int, num_buckets: int, max_distance: int,
                        bidirectional: bool, device) -> torch.Tensor:
    """T5's bucket of every relative position ``kv - q``, indexed by ``kv - q + q_len - 1``.

    Small distances get a bucket each; larger ones share logarithmically wider buckets up to
    ``max_distance``; with ``bidirectional`` half of the buckets are for keys after the query.
    Returns ``(q_len + kv_len - 1,)`` int64.
    """
    relative = torch.arange(-(q_len - 1), kv_len, dtype=torch.int64)
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket += (relative > 0).to(torch.int64) * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=1).double() / max_exact) / math.log(
        max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.int64)
    large = large.clamp(max=num_buckets - 1)
    bucket += torch.where(distance < max_exact, distance, large)
    return bucket.to(device)


def learned_bucket_bias(H: int, num_buckets: int, init_std: float, seed: int,
                        device) -> torch.Tensor:
    """Learnable ``(H, num_buckets)`` float32 bias, seeded normal init."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(H, num_buckets, generator=generator) * init_std).to(device).requires_grad_()


def generate_t5_bias(bucket_bias: torch.Tensor, buckets: torch.Tensor, q_len: int):
    """T5 relative bias: ``score + bucket_bias[h, buckets[kv_idx - q_idx + q_len - 1]]``.

    Args:
        bucket_bias: ``(H, num_buckets)`` learnable float tensor.
        buckets: ``(q_len + kv_len - 1,)`` int tensor from ``t5_relative_buckets``.
    """
    def t5_bias(score, b, h, q_idx, kv_idx):
        return score + bucket_bias[h, buckets[kv_idx - q_idx + (q_len - 1)]]

    t5_bias.__name__ = f"t5_bias_{bucket_bias.shape[-1]}buckets"
    return t5_bias


def sandwich_table(q_len: int, kv_len: int, dim: int, device) -> torch.Tensor:
    """Sandwich's bias of every relative position ``m - n`` (indexed by ``kv - q + q_len - 1``):
    the inner product of two ``dim``-dimensional sinusoidal embeddings,
    ``sum_{i=1}^{dim/2} cos((m - n) / 10000**(2i/dim))``. Returns ``(q_len + kv_len - 1,)``."""
    relative = torch.arange(-(q_len - 1), kv_len, dtype=torch.float64)
    inverse_frequency = 10000.0 ** (-2.0 * torch.arange(1, dim // 2 + 1, dtype=torch.float64) / dim)
    table = torch.cos(relative[:, None] * inverse_frequency[None, :]).sum(-1)
    return table.to(torch.float32).to(device)


def generate_sandwich_bias(table: torch.Tensor, q_len: int, dim: int):
    """Sandwich: ``score + table[kv_idx - q_idx + q_len - 1]``.

    Args:
        table: ``(q_len + kv_len - 1,)`` float tensor from ``sandwich_table``.
        dim: the embedding dimension the table was built with (names the mod).
    """
    def sandwich(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx - q_idx + (q_len - 1)]

    sandwich.__name__ = f"sandwich_dim{dim}"
    return sandwich


def kerple_parameters(H: int, r1_init: float, r2_init: float, device):
    """KERPLE's learnable positive ``(H,)`` float32 parameters r1 and r2, head h starting at
    ``r_init * (h + 1) / H``."""
    ramp = torch.arange(1, H + 1, dtype=torch.float32) / H
    r1 = (ramp * r1_init).to(device).requires_grad_()
    r2 = (ramp * r2_init).to(device).requires_grad_()
    return r1, r2


def generate_kerple_log_bias(r1: torch.Tensor, r2: torch.Tensor):
    """KERPLE (logarithmic kernel): ``score - r1[h] * log(1 + r2[h] * |q_idx - kv_idx|)``.

    Args:
        r1, r2: ``(H,)`` positive learnable float tensors.
    """
    def kerple_log(score, b, h, q_idx, kv_idx):
        offset = q_idx - kv_idx
        distance = torch.where(offset < 0, -offset, offset)
        return score - r1[h] * torch.log(1 + r2[h] * distance)

    kerple_log.__name__ = f"kerple_log_{r1.numel()}heads"
    return kerple_log


def _alibi(shape):
    slopes = alibi_slopes(shape.H, shape.device)
    return Mods(score_mod=generate_alibi_bias(slopes), captured={"slopes": slopes})


def _alibi_causal(shape):
    mods = _alibi(shape)
    return Mods(score_mod=mods.score_mod, mask_mod=generate_causal_mask(),
                captured=mods.captured)


def _relative(shape, max_distance, init_std, seed):
    table = learned_relative_table(shape.H, max_distance, init_std, seed, shape.device)
    return Mods(score_mod=generate_relative_bias(table), captured={"table": table})


def _t5(shape, num_buckets, max_distance, bidirectional, init_std, seed):
    if bidirectional and num_buckets < 4:
        raise VariantError(f"t5_bias: parameter 'num_buckets' = {num_buckets} is invalid with "
                           f"bidirectional=True; expected at least 4 (half of the buckets per "
                           f"direction, of which half exact)")
    buckets = t5_relative_buckets(shape.Q_LEN, shape.KV_LEN, num_buckets, max_distance,
                                  bidirectional, shape.device)
    bucket_bias = learned_bucket_bias(shape.H, num_buckets, init_std, seed, shape.device)
    return Mods(score_mod=generate_t5_bias(bucket_bias, buckets, shape.Q_LEN),
                captured={"bucket_bias": bucket_bias, "buckets": buckets})


def _sandwich(shape, dim):
    table = sandwich_table(shape.Q_LEN, shape.KV_LEN, dim, shape.device)
    return Mods(score_mod=generate_sandwich_bias(table, shape.Q_LEN, dim),
                captured={"table": table})


def _kerple(shape, r1_init, r2_init):
    r1, r2 = kerple_parameters(shape.H, r1_init, r2_init, shape.device)
    return Mods(score_mod=generate_kerple_log_bias(r1, r2), captured={"r1": r1, "r2": r2})


ALIBI = Reference("Train Short, Test Long: Attention with Linear Biases Enables Input Length "
                  "Extrapolation", arxiv="2108.12409")
_SEED = Param("seed", "int", 0, "seed of the initial values", low=0, high=2**31 - 1)
_INIT_STD = Param("init_std", "float", 0.5, "standard deviation of the initial biases",
                  low=0.0, high=10.0)

VARIANTS = (
    Variant(
        name="alibi",
        title="ALiBi",
        description=("Attention with Linear Biases: no position embeddings; each head subtracts "
                     "slope[h] times the query-key distance from the score, with a geometric "
                     "sequence of slopes across heads. Trains short and extrapolates to longer "
                     "sequences. Defined for causal models (see alibi_causal); without a mask, "
                     "keys after the query get the mirrored bonus."),
        reference=ALIBI,
        kind="score",
        params=(),
        build=_alibi,
        recipe="""
            slopes = alibi_slopes(H, device)
            score_mod = generate_alibi_bias(slopes)
        """,
        helpers=(alibi_slopes, generate_alibi_bias),
    ),
    Variant(
        name="alibi_causal",
        title="ALiBi + causal",
        description=("ALiBi as its paper uses it: linear distance penalties per head on a "
                     "causal decoder. The benchmark anchor for score_mod + block sparsity."),
        reference=ALIBI,
        kind="both",
        params=(),
        build=_alibi_causal,
        recipe="""
            slopes = alibi_slopes(H, device)
            score_mod = generate_alibi_bias(slopes)
            mask_mod = generate_causal_mask()
        """,
        helpers=(alibi_slopes, generate_alibi_bias, generate_causal_mask),
    ),
    Variant(
        name="relative_bias",
        title="Learned relative-position bias",
        description=("A learned scalar per head and relative offset kv - q, clipped at "
                     "max_distance: the scalar form of Shaw et al.'s clipped relative position "
                     "representations. The table is a captured tensor with gradients."),
        reference=Reference("Self-Attention with Relative Position Representations",
                            arxiv="1803.02155"),
        kind="score",
        params=(Param("max_distance", "int", 128, "clipping distance K", low=1, high=1 << 16),
                _INIT_STD, _SEED),
        build=_relative,
        recipe="""
            table = learned_relative_table(H, {max_distance}, {init_std}, {seed}, device)
            score_mod = generate_relative_bias(table)
        """,
        helpers=(learned_relative_table, generate_relative_bias),
        example={"max_distance": 9, "init_std": 1.0, "seed": 4},
    ),
    Variant(
        name="t5_bias",
        title="T5 bucketed relative bias",
        description=("T5's relative attention bias: relative positions fall into buckets, exact "
                     "for short distances and logarithmically wider up to max_distance, and each "
                     "head learns one scalar per bucket."),
        reference=Reference("Exploring the Limits of Transfer Learning with a Unified "
                            "Text-to-Text Transformer", arxiv="1910.10683"),
        kind="score",
        params=(Param("num_buckets", "int", 32, "buckets (split between directions if "
                      "bidirectional)", low=2, high=1024),
                Param("max_distance", "int", 128, "distance where the last bucket starts",
                      low=2, high=1 << 20),
                Param("bidirectional", "bool", True, "separate buckets for keys after the query "
                      "(encoder); False for decoders"),
                _INIT_STD, _SEED),
        build=_t5,
        recipe="""
            buckets = t5_relative_buckets(Q_LEN, KV_LEN, {num_buckets}, {max_distance},
                                          {bidirectional}, device)
            bucket_bias = learned_bucket_bias(H, {num_buckets}, {init_std}, {seed}, device)
            score_mod = generate_t5_bias(bucket_bias, buckets, Q_LEN)
        """,
        helpers=(t5_relative_buckets, learned_bucket_bias, generate_t5_bias),
        example={"num_buckets": 8, "max_distance": 20, "bidirectional": False, "seed": 2},
    ),
    Variant(
        name="sandwich",
        title="Sandwich",
        description=("A parameter-free relative bias: the inner product of the sinusoidal "
                     "embeddings of the two positions, a function of their distance that "
                     "decays roughly logarithmically, like KERPLE and T5, and helps length "
                     "extrapolation."),
        reference=Reference("Dissecting Transformer Length Extrapolation via the Lens of "
                            "Receptive Field Analysis", arxiv="2212.10356"),
        kind="score",
        params=(Param("dim", "int", 128, "dimension of the sinusoidal embeddings (even)",
                      low=2, high=4096),),
        build=_sandwich,
        recipe="""
            table = sandwich_table(Q_LEN, KV_LEN, {dim}, device)
            score_mod = generate_sandwich_bias(table, Q_LEN, {dim})
        """,
        helpers=(sandwich_table, generate_sandwich_bias),
        example={"dim": 16},
    ),
    Variant(
        name="kerple",
        title="KERPLE (logarithmic kernel)",
        description=("Kernelized relative positions: each head subtracts r1 * log(1 + r2 * "
                     "|q - kv|) with learnable positive r1, r2 per head; the logarithmic "
                     "variant extrapolates best in the paper."),
        reference=Reference("KERPLE: Kernelized Relative Positional Embedding for Length "
                            "Extrapolation", arxiv="2205.09921"),
        kind="score",
        params=(Param("r1_init", "float", 1.0, "initial r1 of the last head (head h gets "
                      "(h + 1) / H of it)", low=0.0, high=100.0),
                Param("r2_init", "float", 1.0, "initial r2 of the last head", low=0.0,
                      high=100.0)),
        build=_kerple,
        recipe="""
            r1, r2 = kerple_parameters(H, {r1_init}, {r2_init}, device)
            score_mod = generate_kerple_log_bias(r1, r2)
        """,
        helpers=(kerple_parameters, generate_kerple_log_bias),
        example={"r1_init": 2.0, "r2_init": 0.3},
    ),
)
