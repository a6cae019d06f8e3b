"""Local windows: sliding (Mistral), bidirectional and dilated (Longformer), global + window
(Longformer), sinks + window (StreamingLLM), a window with learnable sinks (gpt-oss) and chunked
attention (Llama 4)."""
from __future__ import annotations

import torch

from flexcore import or_masks
from variants.core import Mods, Param, Reference, Variant

MAX_WINDOW = 1 << 20


def generate_sliding_window(window_size: int):
    """Causal sliding window: a query sees itself and the ``window_size - 1`` keys before it."""
    def sliding_window(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance < window_size)

    sliding_window.__name__ = f"sliding_window_{window_size}"
    return sliding_window


def generate_local_window(window_size: int):
    """Bidirectional window: a query sees the ``window_size // 2`` keys on each side of it."""
    half = window_size // 2

    def local_window(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance <= half) & (distance >= -half)

    local_window.__name__ = f"local_window_{window_size}"
    return local_window


def generate_dilated_window(window_size: int, dilation: int, causal: bool):
    """Dilated window: ``window_size // 2`` keys on each side (or behind only, if causal),
    ``dilation`` positions apart."""
    reach = (window_size // 2) * dilation

    def dilated_window(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        lowest = 0 if causal else -reach
        return (distance <= reach) & (distance >= lowest) & (distance % dilation == 0)

    dilated_window.__name__ = (f"dilated_window_{window_size}_d{dilation}"
                               + ("_causal" if causal else ""))
    return dilated_window


def generate_global_tokens(num_global: int):
    """The first ``num_global`` positions attend everywhere and are attended by every query."""
    def global_tokens(b, h, q_idx, kv_idx):
        return (q_idx < num_global) | (kv_idx < num_global)

    global_tokens.__name__ = f"global_{num_global}"
    return global_tokens


def generate_streaming_llm(num_sinks: int, window_size: int):
    """Causal attention to the first ``num_sinks`` keys plus the ``window_size`` most recent."""
    def streaming_llm(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & ((kv_idx < num_sinks) | (distance < window_size))

    streaming_llm.__name__ = f"streaming_llm_sinks{num_sinks}_window{window_size}"
    return streaming_llm


def generate_chunked_causal(chunk_size: int):
    """Causal attention within fixed chunks of ``chunk_size`` tokens, none across chunks."""
    def chunked_causal(b, h, q_idx, kv_idx):
        return (q_idx // chunk_size == kv_idx // chunk_size) & (q_idx >= kv_idx)

    chunked_causal.__name__ = f"chunked_causal_{chunk_size}"
    return chunked_causal


def generate_learnable_sinks(H: int, sink_logit: float, device):
    """One learnable sink logit per head for ``flex_attention(..., sinks=)``, all ``sink_logit``
    at the start of training."""
    return torch.full((H,), float(sink_logit), device=device, requires_grad=True)


def _window_param(default: int, help: str) -> Param:
    return Param("window_size", "int", default, help, low=1, high=MAX_WINDOW)


VARIANTS = (
    Variant(
        name="sliding_window",
        title="Causal sliding window",
        description=("Each query attends to the most recent window_size tokens, itself included. "
                     "Memory and compute grow linearly with length, and stacked layers still "
                     "reach far back; Mistral 7B uses a 4096-token window."),
        reference=Reference("Mistral 7B", arxiv="2310.06825"),
        kind="mask",
        params=(_window_param(256, "keys each query sees, itself included"),),
        build=lambda shape, window_size: Mods(mask_mod=generate_sliding_window(window_size)),
        recipe="mask_mod = generate_sliding_window({window_size})",
        helpers=(generate_sliding_window,),
        example={"window_size": 40},
    ),
    Variant(
        name="local_window",
        title="Bidirectional local window",
        description=("Each token attends to window_size // 2 neighbours on either side: the "
                     "encoder-side sliding window of Longformer, for long documents where "
                     "context is mostly local."),
        reference=Reference("Longformer: The Long-Document Transformer", arxiv="2004.05150"),
        kind="mask",
        params=(_window_param(512, "total window width w (w // 2 keys on each side)"),),
        build=lambda shape, window_size: Mods(mask_mod=generate_local_window(window_size)),
        recipe="mask_mod = generate_local_window({window_size})",
        helpers=(generate_local_window,),
        example={"window_size": 30},
    ),
    Variant(
        name="dilated_window",
        title="Dilated sliding window",
        description=("A sliding window with gaps: each query sees window_size // 2 keys on each "
                     "side, dilation positions apart, widening the receptive field at the same "
                     "cost. Longformer uses it on a few heads of upper layers."),
        reference=Reference("Longformer: The Long-Document Transformer", arxiv="2004.05150"),
        kind="mask",
        params=(_window_param(256, "attended keys on both sides together (w)"),
                Param("dilation", "int", 2, "distance between attended keys", low=1, high=1024),
                Param("causal", "bool", False, "only look backwards (autoregressive LM)")),
        build=lambda shape, window_size, dilation, causal: Mods(
            mask_mod=generate_dilated_window(window_size, dilation, causal)),
        recipe="mask_mod = generate_dilated_window({window_size}, {dilation}, {causal})",
        helpers=(generate_dilated_window,),
        example={"window_size": 20, "dilation": 3, "causal": True},
    ),
    Variant(
        name="longformer",
        title="Global + sliding window (Longformer)",
        description=("A bidirectional local window plus a few global tokens (e.g. [CLS] or the "
                     "question) that attend to, and are attended by, every position. Keeps "
                     "task-critical tokens connected at linear cost."),
        reference=Reference("Longformer: The Long-Document Transformer", arxiv="2004.05150"),
        kind="mask",
        params=(_window_param(512, "total local window width w (w // 2 keys each side)"),
                Param("num_global", "int", 16, "leading tokens with global attention",
                      low=0, high=MAX_WINDOW)),
        build=lambda shape, window_size, num_global: Mods(mask_mod=or_masks(
            generate_global_tokens(num_global), generate_local_window(window_size))),
        recipe=("mask_mod = or_masks(generate_global_tokens({num_global}), "
                "generate_local_window({window_size}))"),
        helpers=(generate_global_tokens, generate_local_window),
        example={"window_size": 16, "num_global": 5},
    ),
    Variant(
        name="streaming_llm",
        title="Attention sinks + sliding window (StreamingLLM)",
        description=("A causal sliding window that always keeps the first few tokens, which "
                     "absorb attention mass (attention sinks). Lets a model trained on short "
                     "contexts stream indefinitely with a fixed-size KV cache."),
        reference=Reference("Efficient Streaming Language Models with Attention Sinks",
                            arxiv="2309.17453"),
        kind="mask",
        params=(Param("num_sinks", "int", 4, "leading tokens every query keeps",
                      low=0, high=MAX_WINDOW),
                _window_param(1024, "recent keys each query sees, itself included")),
        build=lambda shape, num_sinks, window_size: Mods(
            mask_mod=generate_streaming_llm(num_sinks, window_size)),
        recipe="mask_mod = generate_streaming_llm({num_sinks}, {window_size})",
        helpers=(generate_streaming_llm,),
        example={"num_sinks": 2, "window_size": 24},
    ),
    Variant(
        name="gpt_oss_sinks",
        title="Sliding window + learnable sinks (gpt-oss)",
        description=("A causal sliding window whose softmax also holds one learned logit per "
                     "head, a sink with no value: a query can give its attention to nothing "
                     "when no key in its window fits. gpt-oss alternates such 128-token banded "
                     "layers with dense ones. The sinks are not a mask: pass "
                     "sinks=mods.sinks to flex_attention."),
        reference=Reference("gpt-oss-120b & gpt-oss-20b Model Card", arxiv="2508.10925"),
        kind="mask",
        params=(_window_param(128, "keys each query sees, itself included"),
                Param("sink_logit", "float", 0.0, "every head's sink logit before training",
                      low=-20.0, high=20.0)),
        build=lambda shape, window_size, sink_logit: Mods(
            mask_mod=generate_sliding_window(window_size),
            sinks=generate_learnable_sinks(shape.H, sink_logit, shape.device)),
        recipe=("mask_mod = generate_sliding_window({window_size})\n"
                "sinks = generate_learnable_sinks(H, {sink_logit}, device)  # flex_attention(..., sinks=sinks)"),
        helpers=(generate_sliding_window, generate_learnable_sinks),
        example={"window_size": 40, "sink_logit": 2.5},
    ),
    Variant(
        name="chunked",
        title="Chunked causal attention (Llama 4)",
        description=("The sequence is cut into fixed chunks and each token attends causally "
                     "within its own chunk only. Llama 4 interleaves such local layers "
                     "(8192-token chunks) with global NoPE layers for long context."),
        reference=Reference("The Llama 4 herd",
                            url="https://ai.meta.com/blog/llama-4-multimodal-intelligence/"),
        kind="mask",
        params=(Param("chunk_size", "int", 1024, "tokens per chunk", low=1, high=MAX_WINDOW),),
        build=lambda shape, chunk_size: Mods(mask_mod=generate_chunked_causal(chunk_size)),
        recipe="mask_mod = generate_chunked_causal({chunk_size})",
        helpers=(generate_chunked_causal,),
        example={"chunk_size": 48},
    ),
)
