"""Per-head mixed patterns: full-causal retrieval heads and sink + window streaming heads in one
layer (DuoAttention)."""
from __future__ import annotations

import torch

from variants.core import Mods, Param, Reference, Variant


def streaming_heads(H: int, streaming_fraction: float, seed: int, device) -> torch.Tensor:
    """``(H,)`` bool: which heads are streaming heads; ``round(streaming_fraction * H)`` of them,
    chosen with a seed."""
    generator = torch.Generator().manual_seed(seed)
    count = round(streaming_fraction * H)
    chosen = torch.randperm(H, generator=generator)[:count]
    is_streaming = torch.zeros(H, dtype=torch.bool)
    is_streaming[chosen] = True
    return is_streaming.to(device)


def generate_duo_attention_mask(is_streaming: torch.Tensor, num_sinks: int, window_size: int):
    """Causal attention on retrieval heads; sinks + recent window on streaming heads.

    Args:
        is_streaming: ``(H,)`` bool tensor from ``streaming_heads``.
    """
    def duo_attention(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        streaming_ok = (kv_idx < num_sinks) | (distance < window_size)
        return (distance >= 0) & (streaming_ok | ~is_streaming[h])

    duo_attention.__name__ = (f"duo_attention_{int(is_streaming.sum())}of{is_streaming.numel()}"
                              f"_sinks{num_sinks}_window{window_size}")
    return duo_attention


def _duo(shape, streaming_fraction, num_sinks, window_size, seed):
    is_streaming = streaming_heads(shape.H, streaming_fraction, seed, shape.device)
    return Mods(mask_mod=generate_duo_attention_mask(is_streaming, num_sinks, window_size),
                captured={"is_streaming": is_streaming})


VARIANTS = (
    Variant(
        name="duo_attention",
        title="Per-head mixed patterns (DuoAttention)",
        description=("Different heads of one layer use different masks: retrieval heads keep "
                     "full causal attention while streaming heads keep only attention sinks and "
                     "a recent window, which shrinks their KV cache. The head kinds are read "
                     "from a captured per-head tensor."),
        reference=Reference("DuoAttention: Efficient Long-Context LLM Inference with Retrieval "
                            "and Streaming Heads", arxiv="2410.10819"),
        kind="mask",
        params=(Param("streaming_fraction", "float", 0.5, "fraction of heads that stream",
                      low=0.0, high=1.0),
                Param("num_sinks", "int", 64, "sink tokens of streaming heads", low=0,
                      high=1 << 20),
                Param("window_size", "int", 256, "recent tokens of streaming heads", low=1,
                      high=1 << 20),
                Param("seed", "int", 0, "seed choosing the streaming heads", low=0,
                      high=2**31 - 1)),
        build=_duo,
        recipe="""
            is_streaming = streaming_heads(H, {streaming_fraction}, {seed}, device)
            mask_mod = generate_duo_attention_mask(is_streaming, {num_sinks}, {window_size})
        """,
        helpers=(streaming_heads, generate_duo_attention_mask),
        example={"streaming_fraction": 0.75, "num_sinks": 4, "window_size": 20, "seed": 1},
        head_dependent=True,
    ),
)
