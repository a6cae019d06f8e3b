"""Sequence layouts: packed documents (Krell et al.), prefix LM (T5), shared prompt prefixes
(Hydragen) and key padding."""
from __future__ import annotations

import torch

from variants.core import Mods, Param, Reference, Variant


def random_document_lengths(total: int, num_documents: int, seed: int) -> list[int]:
    """Split ``total`` tokens into ``num_documents`` non-empty documents at seeded random cuts."""
    num_documents = max(1, min(num_documents, total))
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=generator)[: num_documents - 1] + 1
    bounds = [0] + sorted(cuts.tolist()) + [total]
    return [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def document_ids(lengths: list[int], device) -> torch.Tensor:
    """Per-token document index, shape ``(sum(lengths),)``, from the document lengths."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(lengths, device=device))


def generate_document_mask(document_id: torch.Tensor, causal: bool):
    """Tokens attend only within their own document (causally, if ``causal``).

    Args:
        document_id: ``(L,)`` int tensor, the document of each position (L >= Q_LEN, KV_LEN).
    """
    def document_mask(b, h, q_idx, kv_idx):
        same = document_id[q_idx] == document_id[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    num_documents = int(document_id.max()) + 1 if document_id.numel() else 0
    document_mask.__name__ = f"document_{num_documents}docs" + ("_causal" if causal else "")
    return document_mask


def prefix_lengths_for(B: int, seq_len: int, prefix_fraction: float, device) -> torch.Tensor:
    """Prefix length of each batch element: ``prefix_fraction * seq_len * (b + 1) / B``, rounded."""
    scale = torch.arange(1, B + 1, dtype=torch.float64) / B
    return torch.round(prefix_fraction * seq_len * scale).to(torch.int64).to(device)


def generate_prefix_lm_mask(prefix_length: torch.Tensor):
    """Bidirectional attention inside each batch element's prefix, causal after it.

    Args:
        prefix_length: ``(B,)`` int tensor.
    """
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length[b]) | (q_idx >= kv_idx)

    prefix_lm.__name__ = "prefix_lm_" + "_".join(str(int(n)) for n in prefix_length[:4])
    return prefix_lm


def shared_prefix_segments(seq_len: int, prefix_fraction: float, num_suffixes: int,
                           device) -> torch.Tensor:
    """Segment of each position: 0 for the shared prefix, 1..num_suffixes for the suffixes,
    which split the rest evenly."""
    prefix = min(seq_len, round(prefix_fraction * seq_len))
    position = torch.arange(seq_len - prefix, dtype=torch.int64)
    suffix = position * num_suffixes // max(seq_len - prefix, 1) + 1
    return torch.cat([torch.zeros(prefix, dtype=torch.int64), suffix]).to(device)


def generate_shared_prefix_mask(segment: torch.Tensor):
    """Causal attention where each suffix sees the shared prefix and itself, not other suffixes.

    Args:
        segment: ``(L,)`` int tensor from ``shared_prefix_segments``.
    """
    def shared_prefix(b, h, q_idx, kv_idx):
        kv_segment = segment[kv_idx]
        visible = (kv_segment == 0) | (kv_segment == segment[q_idx])
        return visible & (q_idx >= kv_idx)

    prefix = int((segment == 0).sum())
    shared_prefix.__name__ = f"shared_prefix_{prefix}_{int(segment.max())}suffixes"
    return shared_prefix


def key_lengths_for(B: int, kv_len: int, pad_fraction: float, device) -> torch.Tensor:
    """Valid keys of each batch element: ``kv_len`` minus ``pad_fraction * kv_len * (b+1) / B``."""
    scale = torch.arange(1, B + 1, dtype=torch.float64) / B
    padding = torch.round(pad_fraction * kv_len * scale).to(torch.int64)
    return (kv_len - padding).clamp(min=1).to(device)


def generate_key_padding_mask(kv_length: torch.Tensor):
    """Queries attend only to the first ``kv_length[b]`` keys (the rest is padding).

    Args:
        kv_length: ``(B,)`` int tensor.
    """
    def key_padding(b, h, q_idx, kv_idx):
        return kv_idx < kv_length[b]

    key_padding.__name__ = "key_padding_" + "_".join(str(int(n)) for n in kv_length[:4])
    return key_padding


def _document(shape, num_documents, causal, seed):
    document_id = document_ids(
        random_document_lengths(max(shape.Q_LEN, shape.KV_LEN), num_documents, seed), shape.device)
    return Mods(mask_mod=generate_document_mask(document_id, causal),
                captured={"document_id": document_id})


def _prefix_lm(shape, prefix_fraction):
    prefix_length = prefix_lengths_for(shape.B, shape.KV_LEN, prefix_fraction, shape.device)
    return Mods(mask_mod=generate_prefix_lm_mask(prefix_length),
                captured={"prefix_length": prefix_length})


def _shared_prefix(shape, prefix_fraction, num_suffixes):
    segment = shared_prefix_segments(max(shape.Q_LEN, shape.KV_LEN), prefix_fraction,
                                     num_suffixes, shape.device)
    return Mods(mask_mod=generate_shared_prefix_mask(segment), captured={"segment": segment})


def _key_padding(shape, pad_fraction):
    kv_length = key_lengths_for(shape.B, shape.KV_LEN, pad_fraction, shape.device)
    return Mods(mask_mod=generate_key_padding_mask(kv_length), captured={"kv_length": kv_length})


VARIANTS = (
    Variant(
        name="document",
        title="Document mask (packed sequences)",
        description=("Several documents are packed into one sequence to avoid padding; each "
                     "token attends only within its own document, so packing does not leak "
                     "context across examples. Document lengths are drawn with a seed."),
        reference=Reference("Efficient Sequence Packing without Cross-contamination",
                            arxiv="2107.02027"),
        kind="mask",
        params=(Param("num_documents", "int", 8, "documents packed into the sequence",
                      low=1, high=1 << 16),
                Param("causal", "bool", True, "causal within each document (decoder)"),
                Param("seed", "int", 0, "seed of the random document lengths", low=0,
                      high=2**31 - 1)),
        build=_document,
        recipe="""
            document_id = document_ids(
                random_document_lengths(max(Q_LEN, KV_LEN), {num_documents}, seed={seed}), device)
            mask_mod = generate_document_mask(document_id, {causal})
        """,
        helpers=(random_document_lengths, document_ids, generate_document_mask),
        example={"num_documents": 5, "causal": False, "seed": 3},
    ),
    Variant(
        name="prefix_lm",
        title="Prefix LM (per-batch prefix lengths)",
        description=("The prefix (an input or prompt) is attended bidirectionally and the rest "
                     "is generated causally. Each batch element has its own prefix length, "
                     "read from a captured tensor, so one kernel serves the whole batch."),
        reference=Reference("Exploring the Limits of Transfer Learning with a Unified "
                            "Text-to-Text Transformer", arxiv="1910.10683"),
        kind="mask",
        params=(Param("prefix_fraction", "float", 0.25,
                      "prefix of the last batch element, as a fraction of the length; element "
                      "b gets (b + 1) / B of it", low=0.0, high=1.0),),
        build=_prefix_lm,
        recipe="""
            prefix_length = prefix_lengths_for(B, KV_LEN, {prefix_fraction}, device)
            mask_mod = generate_prefix_lm_mask(prefix_length)
        """,
        helpers=(prefix_lengths_for, generate_prefix_lm_mask),
        example={"prefix_fraction": 0.6},
        batch_dependent=True,
    ),
    Variant(
        name="shared_prefix",
        title="Shared-prefix mask",
        description=("One prompt followed by several completions in the same sequence: every "
                     "completion attends causally to the shared prompt and to itself, never to "
                     "its siblings. Used to score or train many samples of one prompt while "
                     "storing the prompt once."),
        reference=Reference("Hydragen: High-Throughput LLM Inference with Shared Prefixes",
                            arxiv="2402.05099"),
        kind="mask",
        params=(Param("prefix_fraction", "float", 0.25, "shared prefix, as a fraction of the "
                      "length", low=0.0, high=1.0),
                Param("num_suffixes", "int", 4, "completions after the prefix", low=1,
                      high=1 << 16)),
        build=_shared_prefix,
        recipe="""
            segment = shared_prefix_segments(max(Q_LEN, KV_LEN), {prefix_fraction}, {num_suffixes},
                                             device)
            mask_mod = generate_shared_prefix_mask(segment)
        """,
        helpers=(shared_prefix_segments, generate_shared_prefix_mask),
        example={"prefix_fraction": 0.4, "num_suffixes": 3},
    ),
    Variant(
        name="key_padding",
        title="Key padding mask",
        description=("Batches of unequal-length sequences are padded to one length; the padded "
                     "keys are masked out. Element b keeps KV_LEN minus (b + 1) / B of "
                     "pad_fraction * KV_LEN keys."),
        reference=Reference("BERT: Pre-training of Deep Bidirectional Transformers for "
                            "Language Understanding", arxiv="1810.04805"),
        kind="mask",
        params=(Param("pad_fraction", "float", 0.25,
                      "padding of the last batch element, as a fraction of KV_LEN",
                      low=0.0, high=0.99),),
        build=_key_padding,
        recipe="""
            kv_length = key_lengths_for(B, KV_LEN, {pad_fraction}, device)
            mask_mod = generate_key_padding_mask(kv_length)
        """,
        helpers=(key_lengths_for, generate_key_padding_mask),
        example={"pad_fraction": 0.5},
        batch_dependent=True,
    ),
)
