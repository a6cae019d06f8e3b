"""Learnable attention sinks (gpt-oss; FlashAttention-4's ``learnable_sink``): one logit per query
head that joins every row's softmax denominator without a value.

    out = Σ_j exp(s_j - m) v_j / (Σ_j exp(s_j - m) + exp(sink[h] - m)),   lse' = logaddexp(lse, sink[h])

Eager calls of the forward kernels (the Triton template and the Gluon forwards) add the sink to
each row's denominator in their epilogue (flexcore.kernels.forward.forward), so their out, lse and
row statistics include it and the backward kernels run unchanged; the sink's gradient is

    dL/dsink[h] = -Σ_rows p_sink · (Σ_d dO'·O' - dL/dlse'),   p_sink = exp(sink - lse'),

a reduction over the rows' delta (:func:`sink_gradient`), which the backward kernels compute as
rowsum(P · dP) from their own probabilities: equal in exact arithmetic (the sink column has no
value), without the 16-bit output's rounding that this sum over every row would add up.
Compiled calls take the same path through flexcore's ops (flexcore.ops). Elsewhere (eager calls
of the decode kernel, FP8 calls whose sinks learn) flex_attention applies them after the kernels,
from their own (out, lse), with torch ops that autograd differentiates (:func:`apply_sinks`):
``out' = out · exp(lse - lse') = out · sigmoid(lse - sink)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flexcore.errors import InputError

__all__ = ["check_sinks", "apply_sinks", "sink_gradient"]

SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_sinks(sinks, query: Tensor) -> None:
    """Raise InputError naming ``sinks`` unless it is a (Hq,) floating tensor on the query's device
    (the checks that read shapes, dtypes and devices only, which torch.compile traces too).
    A query that is not a 4-d tensor is left to the query's own check."""
    if not isinstance(query, Tensor) or query.dim() != 4:
        return
    Hq = query.shape[1]
    if not isinstance(sinks, Tensor):
        raise InputError(f"sinks must be a torch.Tensor of shape ({Hq},) (one logit per query head) "
                         f"or None; got {type(sinks).__name__}")
    if sinks.is_nested:
        raise InputError("sinks is a nested tensor; expected a plain tensor of shape "
                         f"({Hq},), one logit per query head")
    if sinks.dim() != 1 or sinks.shape[0] != Hq:
        raise InputError(f"sinks has shape {tuple(sinks.shape)}; expected ({Hq},): one logit per "
                         f"query head (query has {Hq} heads, query shape {tuple(query.shape)})")
    if sinks.dtype not in SINK_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SINK_DTYPES)
        raise InputError(f"sinks has dtype {sinks.dtype}; expected a floating dtype: one of {names}")
    if sinks.device != query.device:
        raise InputError(f"sinks is on {sinks.device} but query is on {query.device}; move it with "
                         f"sinks.to({str(query.device)!r})")


def check_finite_sinks(sinks: Tensor) -> None:
    """Raise InputError unless every sink is finite. Reads the values: called where that costs no
    device synchronisation (CPU tensors, eager calls)."""
    if not bool(torch.isfinite(sinks).all()):
        raise InputError(f"sinks holds non-finite values {sinks.detach().tolist()}; each sink is a "
                         f"finite logit (a large negative one, such as -1e4, gives a head "
                         f"practically no sink)")


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out', lse') of attention with ``sinks`` from the (out, lse) of the same call without them.

    Args:
        out: (B, Hq, L, Dv); lse: (B, Hq, L), natural log, -inf on rows without a kept key.
        sinks: (Hq,) finite logits.

    Returns:
        out' = out · sigmoid(lse - sink) in out's dtype (computed in lse's dtype, rounded once),
        lse' = logaddexp(lse, sink) in lse's dtype. A row without a kept key gives out' 0 and
        lse' = sink: the sink takes all the weight.
    """
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    # sigmoid(lse - sink) = exp(lse - lse'): the share of each row's mass that its keys keep; it is
    # 0 (with a zero gradient) where lse is -inf, so fully masked rows need no special case.
    weight = torch.sigmoid(lse - sink).unsqueeze(-1)
    lse_sink = torch.logaddexp(lse, sink)
    if (torch.is_grad_enabled() and (out.requires_grad or weight.requires_grad)) \
            or torch.compiler.is_compiling():
        return (out * weight).to(out.dtype), lse_sink
    # Without autograd, out is the kernels' own new tensor: scaled in place (computed in weight's
    # dtype, rounded once), one read and one write instead of a float32 temporary.
    return out.mul_(weight), lse_sink


def sink_gradient(lse: Tensor, sinks: Tensor, delta: Tensor) -> Tensor:
    """dL/dsinks (Hq,) in sinks' dtype from the forward's lse (with the sinks in) and the rows'
    delta = rowsum(dO * O) - dL/dlse (B, Hq, L): -Σ_{b,l} exp(sink[h] - lse) · delta. A sum of
    torch reductions, so deterministic."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta.to(lse.dtype)).sum(dim=(0, 2)).to(sinks.dtype)
