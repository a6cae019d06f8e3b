"""Block-structured masks: block-causal attention of block diffusion (BD3-LM) and BigBird's
global + window + random blocks."""
from __future__ import annotations

import torch

from variants.core import Mods, Param, Reference, Variant


def generate_block_causal_mask(block_size: int):
    """Block-causal: a token sees every token of its own block and of all earlier blocks."""
    def block_causal(b, h, q_idx, kv_idx):
        return q_idx // block_size >= kv_idx // block_size

    block_causal.__name__ = f"block_causal_{block_size}"
    return block_causal


def generate_block_diffusion_mask(block_size: int, num_noisy: int):
    """BD3-LM's training mask over ``[x_t | x_0]``: the first ``num_noisy`` positions hold the
    noised sequence x_t, the rest the clean sequence x_0.

    x_t tokens see their own noised block (block-diagonal) and the clean blocks before it
    (offset block-causal); x_0 tokens see clean blocks up to their own (block-causal).
    """
    def block_diffusion(b, h, q_idx, kv_idx):
        q_clean = q_idx >= num_noisy
        kv_clean = kv_idx >= num_noisy
        q_block = torch.where(q_clean, q_idx - num_noisy, q_idx) // block_size
        kv_block = torch.where(kv_clean, kv_idx - num_noisy, kv_idx) // block_size
        block_diagonal = (q_block == kv_block) & (q_clean == kv_clean)
        offset_block_causal = (q_block > kv_block) & kv_clean & ~q_clean
        block_causal = (q_block >= kv_block) & kv_clean & q_clean
        return block_diagonal | offset_block_causal | block_causal

    block_diffusion.__name__ = f"block_diffusion_{block_size}_noisy{num_noisy}"
    return block_diffusion


def bigbird_random_blocks(H: int, num_q_blocks: int, num_kv_blocks: int, num_global_blocks: int,
                          window_blocks: int, num_random_blocks: int, seed: int,
                          device) -> torch.Tensor:
    """BigBird's random blocks: for each head and query block, ``num_random_blocks`` key blocks
    drawn (seeded) among those that are neither global nor in the window.

    Returns:
        ``(H, num_q_blocks, num_kv_blocks)`` bool tensor.
    """
    generator = torch.Generator().manual_seed(seed)
    q_block = torch.arange(num_q_blocks)[:, None]
    kv_block = torch.arange(num_kv_blocks)[None, :]
    taken = ((q_block - kv_block).abs() <= window_blocks // 2) | (kv_block < num_global_blocks)
    draw = torch.rand(H, num_q_blocks, num_kv_blocks, generator=generator, dtype=torch.float64)
    draw = draw.masked_fill(taken, float("inf"))
    count = min(num_random_blocks, num_kv_blocks)
    chosen = torch.zeros(H, num_q_blocks, num_kv_blocks, dtype=torch.bool)
    if count:
        values, indices = draw.topk(count, dim=-1, largest=False)
        chosen.scatter_(-1, indices, values.isfinite())
    return chosen.to(device)


def generate_bigbird_mask(block_size: int, num_global_blocks: int, window_blocks: int,
                          random_blocks: torch.Tensor):
    """BigBird: global blocks, a window of ``window_blocks`` blocks, and per-head random blocks.

    Args:
        random_blocks: ``(H, Q_BLOCKS, KV_BLOCKS)`` bool tensor from ``bigbird_random_blocks``.
    """
    half = window_blocks // 2

    def bigbird(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        kv_block = kv_idx // block_size
        distance = q_block - kv_block
        is_global = (q_block < num_global_blocks) | (kv_block < num_global_blocks)
        in_window = (distance <= half) & (distance >= -half)
        return is_global | in_window | random_blocks[h, q_block, kv_block]

    bigbird.__name__ = (f"bigbird_{block_size}_g{num_global_blocks}_w{window_blocks}"
                        f"_r{int(random_blocks.sum(-1).max()) if random_blocks.numel() else 0}")
    return bigbird


def _block_causal(shape, block_size, two_stream):
    if not two_stream:
        return Mods(mask_mod=generate_block_causal_mask(block_size))
    return Mods(mask_mod=generate_block_diffusion_mask(block_size, shape.KV_LEN // 2))


def _bigbird(shape, block_size, num_global_blocks, window_blocks, num_random_blocks, seed):
    random_blocks = bigbird_random_blocks(
        shape.H, -(-shape.Q_LEN // block_size), -(-shape.KV_LEN // block_size), num_global_blocks,
        window_blocks, num_random_blocks, seed, shape.device)
    return Mods(mask_mod=generate_bigbird_mask(block_size, num_global_blocks, window_blocks,
                                               random_blocks),
                captured={"random_blocks": random_blocks})


VARIANTS = (
    Variant(
        name="block_causal",
        title="Block-causal attention (block diffusion)",
        description=("Tokens see their whole block and every earlier block: autoregressive "
                     "across blocks, bidirectional within one, as block diffusion models "
                     "denoise a block at a time. With two_stream the sequence is BD3-LM's "
                     "training input [x_t | x_0] (noised half, then clean half) and the mask is "
                     "its block-diagonal + offset block-causal + block-causal combination."),
        reference=Reference("Block Diffusion: Interpolating Between Autoregressive and "
                            "Diffusion Language Models", arxiv="2503.09573"),
        kind="mask",
        params=(Param("block_size", "int", 128, "tokens per block", low=1, high=1 << 20),
                Param("two_stream", "bool", False,
                      "BD3-LM training layout: first half x_t, second half x_0")),
        build=_block_causal,
        recipe=lambda two_stream, **_: (
            "mask_mod = generate_block_diffusion_mask({block_size}, KV_LEN // 2)" if two_stream
            else "mask_mod = generate_block_causal_mask({block_size})"),
        helpers=lambda two_stream, **_: (
            (generate_block_diffusion_mask,) if two_stream else (generate_block_causal_mask,)),
        example={"block_size": 12, "two_stream": True},
    ),
    Variant(
        name="bigbird",
        title="BigBird (global + window + random blocks)",
        description=("Block-sparse attention combining global blocks, a sliding window of "
                     "blocks and a few random key blocks per query block (different per head, "
                     "drawn with a seed). Keeps the graph's diameter small at linear cost."),
        reference=Reference("Big Bird: Transformers for Longer Sequences", arxiv="2007.14062"),
        kind="mask",
        params=(Param("block_size", "int", 64, "tokens per block", low=1, high=4096),
                Param("num_global_blocks", "int", 2, "leading global blocks", low=0, high=4096),
                Param("window_blocks", "choice", 3, "blocks in the sliding window (centred)",
                      choices=(1, 3, 5, 7, 9)),
                Param("num_random_blocks", "int", 3, "random key blocks per query block",
                      low=0, high=4096),
                Param("seed", "int", 0, "seed of the random blocks", low=0, high=2**31 - 1)),
        build=_bigbird,
        recipe="""
            random_blocks = bigbird_random_blocks(
                H, -(-Q_LEN // {block_size}), -(-KV_LEN // {block_size}), {num_global_blocks},
                {window_blocks}, {num_random_blocks}, {seed}, device)
            mask_mod = generate_bigbird_mask({block_size}, {num_global_blocks}, {window_blocks},
                                             random_blocks)
        """,
        helpers=(bigbird_random_blocks, generate_bigbird_mask),
        example={"block_size": 16, "num_global_blocks": 1, "window_blocks": 1,
                 "num_random_blocks": 2, "seed": 7},
        head_dependent=True,
    ),
)
