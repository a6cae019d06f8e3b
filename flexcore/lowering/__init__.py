"""Lower score_mod / mask_mod to Triton: trace to an aten graph, emit one ``@triton.jit`` function.

See flexcore/README.md ("Lowering contract"). Generated code calls the ``fl_*`` helpers of
``flexcore.lowering.triton_helpers``, which only generated kernel modules import.
"""
from __future__ import annotations

from flexcore.lowering.api import LoweredMod, lower_mask_mod, lower_score_mod
from flexcore.lowering.eager import call_per_element, per_element
from flexcore.lowering.indexcheck import IndexVerdict, check_indices


def evaluate_mods(*args, **kwargs):
    """See :func:`flexcore.lowering.evaluate.evaluate_mods`."""
    from flexcore.lowering.evaluate import evaluate_mods as _evaluate_mods
    return _evaluate_mods(*args, **kwargs)


def evaluate_score_backward(*args, **kwargs):
    """See :func:`flexcore.lowering.evaluate.evaluate_score_backward`."""
    from flexcore.lowering.evaluate import evaluate_score_backward as _evaluate_score_backward
    return _evaluate_score_backward(*args, **kwargs)


__all__ = ["LoweredMod", "lower_score_mod", "lower_mask_mod", "evaluate_mods",
           "evaluate_score_backward", "check_indices", "IndexVerdict", "call_per_element",
           "per_element"]
