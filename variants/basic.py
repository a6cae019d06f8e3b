"""Full and causal attention, the masks every other variant starts from (Vaswani et al.)."""
from __future__ import annotations

from flexcore import noop_mask
from variants.core import Mods, Reference, Variant


def generate_causal_mask():
    """Causal mask: a query sees its own position and every earlier key."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return causal


def generate_noop_mask():
    """The mask that keeps every position (dense attention)."""
    def noop(b, h, q_idx, kv_idx):
        return noop_mask(b, h, q_idx, kv_idx)

    return noop


ATTENTION_IS_ALL = Reference("Attention Is All You Need", arxiv="1706.03762")

VARIANTS = (
    Variant(
        name="noop",
        title="Full (bidirectional) attention",
        description=("Every query attends to every key, as in an encoder or in cross-attention. "
                     "The dense baseline that every sparse pattern is measured against."),
        reference=ATTENTION_IS_ALL,
        kind="mask",
        params=(),
        build=lambda shape: Mods(mask_mod=generate_noop_mask()),
        recipe="mask_mod = generate_noop_mask()",
        helpers=(generate_noop_mask,),
    ),
    Variant(
        name="causal",
        title="Causal attention",
        description=("Each query attends to its own position and all earlier ones: the "
                     "autoregressive decoder mask of language models. Half of the blocks are "
                     "empty, so a block-sparse kernel does half the work of dense attention."),
        reference=ATTENTION_IS_ALL,
        kind="mask",
        params=(),
        build=lambda shape: Mods(mask_mod=generate_causal_mask()),
        recipe="mask_mod = generate_causal_mask()",
        helpers=(generate_causal_mask,),
    ),
)
