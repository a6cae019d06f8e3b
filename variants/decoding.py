"""Tree attention for speculative decoding: verifying a tree of draft tokens in one pass
(SpecInfer, Medusa)."""
from __future__ import annotations

import torch

from variants.core import Mods, Param, Reference, Variant, VariantError


def tree_ancestors(depth: int, branching: int, device) -> torch.Tensor:
    """Ancestor matrix of a complete token tree in breadth-first order.

    The tree has ``branching`` children per node and ``depth`` levels below the root (the last
    accepted token, which is part of the context), so ``branching + ... + branching**depth``
    draft tokens. Returns ``(T, T)`` bool: ``[i, j]`` is True when node j is node i or one of
    its ancestors.
    """
    parent = []  # -1: the root, i.e. the context
    previous_start, previous_size = 0, 1
    for level in range(depth):
        start, size = len(parent), previous_size * branching
        parent.extend(-1 if level == 0 else previous_start + node // branching
                      for node in range(size))
        previous_start, previous_size = start, size
    count = len(parent)
    ancestors = torch.eye(count, dtype=torch.bool)
    for node in range(count):
        up = parent[node]
        while up >= 0:
            ancestors[node, up] = True
            up = parent[up]
    return ancestors.to(device)


def generate_tree_mask(ancestors: torch.Tensor, q_len: int, kv_len: int):
    """Causal attention over the context, then tree attention over the last T positions: a
    draft token sees the whole context and its own ancestors in the tree.

    Queries are the last ``q_len`` of the ``kv_len`` positions (``q_len == kv_len`` for a full
    pass, ``q_len == T`` when only the draft tokens are queried against a KV cache).

    Args:
        ancestors: ``(T, T)`` bool tensor from ``tree_ancestors``.
    """
    num_draft = ancestors.shape[0]
    tree_start = kv_len - num_draft
    query_offset = kv_len - q_len

    def tree(b, h, q_idx, kv_idx):
        q_pos = q_idx + query_offset
        q_in_tree = q_pos >= tree_start
        kv_in_tree = kv_idx >= tree_start
        # Clamp to 0 outside the tree so the table is never read out of bounds.
        q_node = torch.where(q_in_tree, q_pos - tree_start, 0)
        kv_node = torch.where(kv_in_tree, kv_idx - tree_start, 0)
        return torch.where(kv_in_tree, q_in_tree & ancestors[q_node, kv_node], q_pos >= kv_idx)

    tree.__name__ = f"tree_{num_draft}draft"
    return tree


def _tree(shape, depth, branching):
    num_draft = sum(branching ** level for level in range(1, depth + 1))
    if shape.KV_LEN < num_draft or shape.Q_LEN > shape.KV_LEN:
        raise VariantError(f"speculative_tree: the tree has {num_draft} draft tokens; "
                           f"it needs KV_LEN >= that (got {shape.KV_LEN}) and Q_LEN <= KV_LEN "
                           f"(got {shape.Q_LEN}); lower depth or branching")
    ancestors = tree_ancestors(depth, branching, shape.device)
    return Mods(mask_mod=generate_tree_mask(ancestors, shape.Q_LEN, shape.KV_LEN),
                captured={"ancestors": ancestors})


VARIANTS = (
    Variant(
        name="speculative_tree",
        title="Speculative-decoding tree mask",
        description=("A draft model proposes a tree of candidate continuations; the target "
                     "model verifies all of them in one pass. The last tokens of the sequence "
                     "are the tree: each draft token attends to the whole context and to its "
                     "own ancestors, so sibling branches never see each other."),
        reference=Reference("SpecInfer: Accelerating Generative Large Language Model Serving "
                            "with Tree-based Speculative Inference and Verification",
                            arxiv="2305.09781"),
        kind="mask",
        params=(Param("depth", "int", 4, "tree levels of draft tokens", low=1, high=12),
                Param("branching", "int", 2, "children per node", low=1, high=16)),
        build=_tree,
        recipe="""
            ancestors = tree_ancestors({depth}, {branching}, device)
            mask_mod = generate_tree_mask(ancestors, Q_LEN, KV_LEN)
        """,
        helpers=(tree_ancestors, generate_tree_mask),
        example={"depth": 3, "branching": 3},
    ),
)
