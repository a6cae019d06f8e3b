"""Evaluate a mod on broadcast index tensors with torch's per-element semantics.

torch's flex_attention runs a mod under ``vmap``: every index is a 0-d tensor, so
``table[q_idx][kv_idx]`` reads one element and ``intervals[doc][0]`` one bound. Calling the mod
once on broadcast index tensors (b of shape (B,1,1,1), ...) gives the same result only when it
is elementwise; nested indexing, views and reductions then mean something else. So a mod runs
on broadcast tensors directly when its traced graph shows it is elementwise (the fast common
case), and under nested vmaps, as torch does, otherwise.
"""
from __future__ import annotations

import functools

import torch
from torch.fx import Node

from flexcore.lowering.cache import FastGuard, guard_key

_plans = FastGuard(maxsize=512)
_ELEMENTWISE_STRUCTURAL = {"clone", "alias", "detach", "lift_fresh_copy", "scalar_tensor", "full",
                           "full_like", "zeros_like", "ones_like", "zeros", "ones", "new_zeros",
                           "new_ones", "new_full"}


def _name(node: Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", "")


def broadcast_safe(lowered) -> bool:
    """Whether calling the mod on broadcast index tensors equals calling it per element: every
    value is one number per position and every captured tensor is indexed in one subscript that
    covers all its dimensions."""
    from flexcore.lowering.shapes import ShapeOps

    gm = lowered.graph
    if gm is None:
        return True
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = getattr(gm, node.target)
            if t.dim() == 0:
                continue
            for user in node.users:
                if _name(user) != "index" or user.args[0] is not node \
                        or len(user.args[1]) != t.dim() or any(i is None for i in user.args[1]):
                    return False
            continue
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 0:
            return False
        name = _name(node)
        if name in ShapeOps.STRUCTURAL and name not in _ELEMENTWISE_STRUCTURAL and name != "index":
            return False
        if name == "index" and node.args[0].op != "get_attr":
            return False
    return True


def _plan(fn, kind: str) -> str:
    plan = _plans.get(fn, kind)
    if plan is not None:
        return plan
    from flexcore.lowering.api import lower_mod

    try:
        # No autograd record of the tracing: a first call inside torch.utils.checkpoint would
        # otherwise save tensors that its recomputation (with the plan known) does not.
        with torch.no_grad():
            plan = "broadcast" if broadcast_safe(lower_mod(fn, kind)) else "vmap"
    except Exception:  # noqa: BLE001 - not lowerable: torch's own (vmap) semantics
        plan = "vmap"
    _plans.put(fn, kind, guard_key(fn), plan)
    return plan


class _NotATensor(Exception):
    """A mod returned something that is neither a tensor nor a Python number (under vmap)."""

    def __init__(self, value):
        super().__init__(type(value).__name__)
        self.value = value


def _vmapped(fn, args: tuple, device):
    """``fn`` under one vmap per grid dimension that some argument spans (torch's
    _vmap_for_bhqkv, for any broadcast pattern); returns a tensor of the broadcast shape."""
    shape = tuple(torch.broadcast_shapes(*(a.shape for a in args)))
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    squeezed = [a.reshape([a.shape[d] for d in dims if a.shape[d] != 1]) for a in args]

    def per_element(*xs):
        out = fn(*xs)
        if isinstance(out, torch.Tensor):
            return out
        # Python and NumPy scalars become tensors; the callers name the mod and anything else.
        if not isinstance(out, (bool, int, float)) and not (hasattr(out, "dtype") and hasattr(out, "item")):
            raise _NotATensor(out)
        return torch.as_tensor(out, device=device)

    f = per_element
    for d in reversed(dims):
        f = torch.vmap(f, in_dims=tuple(0 if a.shape[d] != 1 else None for a in args))
    out = f(*squeezed)
    return out.reshape([shape[d] if d in dims else 1 for d in range(len(shape))]
                       + list(out.shape[len(dims):]))


def call_per_element(fn, args: tuple, kind: str):
    """``fn(*args)`` with torch's per-element semantics, for broadcast index tensors ``args``
    (``(b, h, q_idx, kv_idx)`` for a mask_mod, ``(score, b, h, q_idx, kv_idx)`` for a score_mod,
    all 4-d and broadcastable).

    Returns what the mod returns, broadcastable to the arguments' broadcast shape. Exceptions the
    mod raises propagate unchanged (an IndexError where an index is out of range, as in torch).

    Example:
        >>> table = torch.arange(12).view(3, 4)
        >>> def mod(b, h, q_idx, kv_idx):
        ...     return table[q_idx][kv_idx] % 2 == 0
        >>> q, kv = torch.arange(3).view(1, 1, 3, 1), torch.arange(4).view(1, 1, 1, 4)
        >>> call_per_element(mod, (torch.zeros(1, 1, 1, 1, dtype=torch.int32),) * 2 + (q, kv),
        ...                  "mask").shape
        torch.Size([1, 1, 3, 4])
    """
    if not all(isinstance(a, torch.Tensor) and a.dim() == 4 for a in args) or \
            _plan(fn, kind) == "broadcast":
        return fn(*args)
    try:
        return _vmapped(fn, args, args[-1].device)
    except _NotATensor as e:
        return e.value  # the callers' return checks name it
    except Exception as e:  # noqa: BLE001 - vmap's own limits fall back to one broadcast call
        if "vmap" not in str(e) and not isinstance(e, NotImplementedError):
            raise
        return fn(*args)


def per_element(fn, kind: str):
    """``fn`` as a callable that :func:`call_per_element` evaluates (``__wrapped__`` is ``fn``, so
    error messages still name the user's function and line)."""
    @functools.wraps(fn)
    def wrapper(*args):
        return call_per_element(fn, args, kind)
    return wrapper
