"""Context-parallel flex attention over torch.distributed: the sequence sharded across ranks.

Each rank holds its shard of Q, K and V, (B, H, S_local, D). Score and mask mods see **global**
positions. Design, strategies and the merge: docs/context-parallel.md.

Example (run under ``torchrun --nproc-per-node 2``; gloo on CPUs, NCCL on GPUs):
    >>> import torch.distributed as dist
    >>> from flexcore import distributed as cp
    >>> dist.init_process_group("gloo")
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> mask = cp.create_block_mask_for_rank(causal, None, None, S, BLOCK_SIZE=32, device="cpu")
    >>> q, k, v = (cp.shard_sequence(t) for t in (q_full, k_full, v_full))
    >>> out = cp.flex_attention(q, k, v, block_mask=mask)            # (B, H, S / world, D)
    >>> full = cp.unshard_sequence(out)                               # (B, H, S, D)
"""
from __future__ import annotations

import atexit
import functools
import operator
import types
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from flexcore.lowering.cache import global_names

__all__ = ["flex_attention", "create_block_mask_for_rank", "ContextParallelMask", "shard_sequence",
           "unshard_sequence", "shard_positions", "merge_by_lse", "ContextParallelError", "SHARDINGS",
           "STRATEGIES"]

#: zigzag: rank r holds chunks r and 2W-1-r of 2W equal chunks (balances causal work);
#: contiguous: rank r holds chunk r of W.
SHARDINGS = ("zigzag", "contiguous")
#: allgather: K/V gathered once, overlapped with the local chunk; ring: K/V passed rank to rank.
STRATEGIES = ("auto", "allgather", "ring")
#: Default bound on the small collectives that check the ranks agree (seconds).
DEFAULT_TIMEOUT_S = 300.0


class ContextParallelError(ValueError):
    """Bad input to context-parallel attention, raised on every rank of the group."""


# ---- the group ---------------------------------------------------------------------------------


def _resolve_group(group, what: str):
    """The ProcessGroup of ``group`` (None: the default group; a 1-D DeviceMesh: its group)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ContextParallelError(f"{what}: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise ContextParallelError(
            f"{what}: the default process group is not initialised; call "
            "torch.distributed.init_process_group('nccl' or 'gloo') first (torchrun sets the "
            "rendezvous variables)")
    if group is not None and hasattr(group, "get_group") and hasattr(group, "ndim"):  # DeviceMesh
        if group.ndim != 1:
            raise ContextParallelError(
                f"{what}: group is a {group.ndim}-D DeviceMesh; pass its context-parallel dimension, "
                "e.g. mesh['cp']")
        group = group.get_group()
    if group is None:
        group = dist.group.WORLD
    return group


# Side groups per parent group, which flexcore holds no longer than the parent: a process group
# kept past destroy_process_group is torn down in interpreter finalization, where gloo's teardown
# is unsafe.
_SIDE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
atexit.register(_SIDE_GROUPS.clear)  # the parent may live until finalization; its side groups do not


def _side_group(group, timeout_s: float):
    """A gloo group over the same ranks whose collectives time out after ``timeout_s``: the checks
    run there, on the host, so that they neither sync a GPU nor hang past the timeout. Made again
    where destroy_process_group has destroyed the one made before."""
    import torch.distributed as dist

    sides = _SIDE_GROUPS.setdefault(group, {})
    side = sides.get(float(timeout_s))
    if side is not None:
        try:
            dist.get_process_group_ranks(side)
        except (KeyError, ValueError, RuntimeError):  # destroyed with its world
            side = None
    if side is None:
        side = sides[float(timeout_s)] = dist.new_group(
            dist.get_process_group_ranks(group), timeout=timedelta(seconds=timeout_s), backend="gloo",
            use_local_synchronization=True)
    return side


def _agree(group, timeout_s: float, error: str | None, signature: dict, what: str,
           extra=None) -> list:
    """Exchange each rank's local error and signature; raise the same error on every rank when one
    failed or the signatures differ. Returns every rank's ``extra`` (data that may differ)."""
    import torch.distributed as dist

    side = _side_group(group, timeout_s)
    entries: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(entries, (error, signature, extra), group=side)
    except RuntimeError as exc:  # a rank never arrived: gloo's timeout fired
        raise ContextParallelError(
            f"{what}: ranks did not all arrive within {timeout_s:g} s to check their inputs "
            f"({' '.join(str(exc).split())[:300]})") from None
    failed = [(r, e) for r, (e, _, _) in enumerate(entries) if e is not None]
    if failed:
        lines = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise ContextParallelError(f"{what}: {lines}")
    sigs = [s for _, s, _ in entries]
    for name in signature:
        values = [s.get(name) for s in sigs]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ContextParallelError(
                f"{what}: {name} differs across ranks ({per_rank}); every rank must pass the same "
                "shapes, options and captured tensors")
    return [x for _, _, x in entries]


# ---- sharding ----------------------------------------------------------------------------------


def _check_sharding(sharding: str, what: str) -> None:
    if sharding not in SHARDINGS:
        raise ContextParallelError(f"{what}: sharding={sharding!r}; expected one of {SHARDINGS}")


def _shard_unit(world: int, sharding: str) -> int:
    return 2 * world if sharding == "zigzag" else world


def _as_int(value):
    """``value`` as a Python int where it is an integer (NumPy ints and 0-d integer tensors
    included, bools not), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_rank(rank, world, what: str) -> tuple[int, int]:
    """(rank, world) as Python ints, or ContextParallelError unless world is a positive integer
    and rank an integer in [0, world)."""
    w, r = _as_int(world), _as_int(rank)
    if w is None or w < 1:
        raise ContextParallelError(f"{what}: world_size={world!r}; expected a positive int")
    if r is None or not 0 <= r < w:
        raise ContextParallelError(f"{what}: rank={rank!r}; expected an int in [0, {w})")
    return r, w


def _check_dim(x: Tensor, dim, what: str) -> int:
    """``dim`` as a non-negative axis of ``x``, or ContextParallelError naming it."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ContextParallelError(f"{what}: dim={dim!r} is not an axis of x of shape "
                                   f"{tuple(x.shape)}; expected an int in [{-x.dim()}, {x.dim()})")
    return dim % x.dim()


def _check_length(S: int, world: int, sharding: str, what: str, arg: str) -> None:
    unit = _shard_unit(world, sharding)
    if S % unit:
        rule = (f"2 x world size = {unit} (zigzag cuts the sequence into 2W chunks)"
                if sharding == "zigzag" else f"the world size {unit}")
        raise ContextParallelError(
            f"{what}: {arg}={S} is not divisible by {rule}; pad the sequence to a multiple of {unit}")


def _chunks(world: int, rank: int, sharding: str) -> list[int]:
    """Which chunks of the global sequence a rank holds, in order (2W chunks for zigzag, W else)."""
    return [rank, 2 * world - 1 - rank] if sharding == "zigzag" else [rank]


def shard_positions(seq_len: int, world_size: int, rank: int, sharding: str = "zigzag",
                    device=None) -> Tensor:
    """Global positions (int64, (seq_len / world_size,)) of the tokens that ``rank`` holds.

    Example:
        >>> shard_positions(8, 2, 0)      # zigzag: chunks 0 and 3 of 4
        tensor([0, 1, 6, 7])
    """
    _check_sharding(sharding, "shard_positions")
    rank, world_size = _check_rank(rank, world_size, "shard_positions")
    _check_length(seq_len, world_size, sharding, "shard_positions", "seq_len")
    n = len(_chunks(world_size, 0, sharding))
    size = seq_len // (world_size * n)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in _chunks(world_size, rank, sharding)])


def _rank_world(group, rank, world_size, what: str) -> tuple[int, int]:
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ContextParallelError(f"{what}: give both rank and world_size, or neither (group)")
        return _check_rank(rank, world_size, what)
    import torch.distributed as dist

    group = _resolve_group(group, what)
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: Tensor, group=None, dim: int = 2, sharding: str = "zigzag", *,
                   rank: int | None = None, world_size: int | None = None) -> Tensor:
    """This rank's shard of a full sequence ``x`` along ``dim`` (no communication).

    Args:
        x: the full tensor, the same on every rank (e.g. (B, H, S, D) with dim=2, or tokens (B, S)
            with dim=1).
        group: process group or 1-D DeviceMesh (default: the world); or give ``rank`` and
            ``world_size`` to shard without a process group.
        sharding: ``"zigzag"`` or ``"contiguous"`` (see :data:`SHARDINGS`).

    Returns:
        A contiguous tensor with ``x.shape[dim] / world_size`` positions along ``dim``.
    """
    r, w = _rank_world(group, rank, world_size, "shard_sequence")
    _check_sharding(sharding, "shard_sequence")
    dim = _check_dim(x, dim, "shard_sequence")
    _check_length(x.shape[dim], w, sharding, "shard_sequence", f"x.shape[{dim}]")
    pieces = x.chunk(_shard_unit(w, sharding), dim=dim)
    return torch.cat([pieces[c] for c in _chunks(w, r, sharding)], dim=dim).contiguous()


def unshard_sequence(x: Tensor, group=None, dim: int = 2, sharding: str = "zigzag") -> Tensor:
    """The full sequence from every rank's shard along ``dim`` (an all-gather; not differentiable).

    Inverse of :func:`shard_sequence`; every rank receives the whole tensor.
    """
    import torch.distributed as dist

    group = _resolve_group(group, "unshard_sequence")
    _check_sharding(sharding, "unshard_sequence")
    dim = _check_dim(x, dim, "unshard_sequence")
    w = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(parts, x.contiguous(), group=group)
    per_rank = len(_chunks(w, 0, sharding))
    chunks: list = [None] * (w * per_rank)
    for r, part in enumerate(parts):
        for c, piece in zip(_chunks(w, r, sharding), part.chunk(per_rank, dim=dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)


class _Layout:
    """Maps local positions to global ones inside mods, as index arithmetic the kernels lower.

    ``local(idx, src)``: position ``idx`` of rank ``src``'s shard. ``gathered(idx)``: position
    ``idx`` of all shards concatenated in rank order (what an all-gather returns)."""

    def __init__(self, world: int, shard_len: int, sharding: str):
        self.world, self.shard_len, self.sharding = world, shard_len, sharding

    def local(self, idx, src):
        if self.sharding == "contiguous":
            return src * self.shard_len + idx
        half = self.shard_len // 2
        # The first half of a shard is chunk src, the second chunk 2W-1-src.
        return torch.where(idx < half, src * half + idx, (2 * self.world - 2 - src) * half + idx)

    def gathered(self, idx):
        src = idx // self.shard_len
        return self.local(idx - src * self.shard_len, src)


# ---- the per-rank mask -------------------------------------------------------------------------


def _always(b, h, q_idx, kv_idx):
    return q_idx >= 0


@dataclass
class ContextParallelMask:
    """The BlockMasks of one rank's query rows against every rank's key shard.

    Built by :func:`create_block_mask_for_rank`; pass it as ``block_mask`` to
    :func:`flex_attention`. It never holds the global mask: ``sources[s]`` covers this rank's
    S_local query rows against rank s's S_local keys (None where the mask leaves that pair empty),
    and ``need[a][s]`` says whether rank a attends to rank s's keys at all (every rank's row,
    exchanged once when the mask is built).
    """

    mask_mod: object
    B: int | None
    H: int | None
    seq_len: int
    world_size: int
    rank: int
    sharding: str
    block_size: tuple[int, int]
    device: torch.device
    sources: tuple
    need: tuple
    _gathered: object = field(default=None, repr=False)

    @property
    def shard_len(self) -> int:
        return self.seq_len // self.world_size

    def layout(self) -> _Layout:
        return _Layout(self.world_size, self.shard_len, self.sharding)

    def src_tensor(self, src: int) -> Tensor:
        return torch.tensor(src, dtype=torch.int32, device=self.device)

    def gathered(self):
        """BlockMask of this rank's rows against all ranks' keys concatenated in rank order, with
        its own shard's columns left empty (they are computed first, from the local K/V)."""
        if self._gathered is None:
            from flexcore import create_block_mask

            layout, mod = self.layout(), self.mask_mod or _always
            own, q_src = self.rank, self.src_tensor(self.rank)

            def cp_gathered_mask(b, h, q_idx, kv_idx):
                keep = mod(b, h, layout.local(q_idx, q_src), layout.gathered(kv_idx))
                return keep & (kv_idx // layout.shard_len != own)

            self._gathered = create_block_mask(cp_gathered_mask, self.B, self.H, self.shard_len,
                                               self.seq_len, device=self.device,
                                               BLOCK_SIZE=self.block_size)
        return self._gathered

    def density(self) -> float:
        """Fraction of this rank's (query block, key block) pairs over the global keys it computes."""
        computed = total = 0
        for bm in self.sources:
            if bm is None:
                continue
            computed += int(bm.kv_num_blocks.sum())
            if bm.full_kv_num_blocks is not None:
                computed += int(bm.full_kv_num_blocks.sum())
        first = next((bm for bm in self.sources if bm is not None), None)
        if first is None:
            return 0.0
        b, h, qb = first.kv_num_blocks.shape
        total = b * h * qb * first.kv_indices.shape[-1] * self.world_size
        return computed / total if total else 0.0


def _block_size(BLOCK_SIZE) -> tuple[int, int]:
    if isinstance(BLOCK_SIZE, int):
        return BLOCK_SIZE, BLOCK_SIZE
    return int(BLOCK_SIZE[0]), int(BLOCK_SIZE[1])


def _local_mask_mod(mask_mod, layout: _Layout, q_src: Tensor, kv_src: Tensor):
    mod = mask_mod or _always

    def cp_mask(b, h, q_idx, kv_idx):
        return mod(b, h, layout.local(q_idx, q_src), layout.local(kv_idx, kv_src))

    cp_mask.__name__ = f"cp_{getattr(mod, '__name__', 'mask')}"
    return cp_mask


def create_block_mask_for_rank(mask_mod, B: int | None, H: int | None, seq_len: int, group=None, *,
                               sharding: str = "zigzag", BLOCK_SIZE=128, device=None,
                               timeout_s: float = DEFAULT_TIMEOUT_S) -> ContextParallelMask:
    """The BlockMasks of this rank's query rows against the global keys, for :func:`flex_attention`.

    Every rank of ``group`` must call it with the same arguments (a collective). ``mask_mod`` sees
    global positions; tensors it captures must hold the global sequence on every rank. Each rank
    evaluates the mask over its own S_local rows only.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` over global positions; None keeps everything.
        B, H: as in ``flexcore.create_block_mask`` (None: broadcast).
        seq_len: the global sequence length; divisible by 2·world (zigzag) or world (contiguous).
        group: process group or 1-D DeviceMesh (default: the world).
        sharding: ``"zigzag"`` (default) or ``"contiguous"``.
        BLOCK_SIZE: the BlockMasks' block size (int or (Q, KV)).
        device: where the masks live (default: the current CUDA device, else CPU).
        timeout_s: bound on the check that every rank arrived and agrees.

    Raises:
        ContextParallelError: on every rank, when one rank's arguments or mask_mod fail (e.g. a
            captured tensor too short for the global positions) or the ranks disagree.
    """
    import torch.distributed as dist

    what = "create_block_mask_for_rank"
    group = _resolve_group(group, what)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    signature = {"seq_len": seq_len, "B": B, "H": H, "sharding": sharding,
                 "BLOCK_SIZE": _block_size(BLOCK_SIZE), "captured tensors": _captured_signature(mask_mod)}
    error, sources, need = None, [], []
    try:
        _check_sharding(sharding, what)
        _check_length(seq_len, world, sharding, what, "seq_len")
        from flexcore import create_block_mask

        layout = _Layout(world, seq_len // world, sharding)
        q_src = torch.tensor(rank, dtype=torch.int32, device=device)
        for src in range(world):
            kv_src = torch.tensor(src, dtype=torch.int32, device=device)
            bm = create_block_mask(_local_mask_mod(mask_mod, layout, q_src, kv_src), B, H,
                                   seq_len // world, seq_len // world, device=device,
                                   BLOCK_SIZE=BLOCK_SIZE)
            listed = int(bm.kv_num_blocks.sum())
            if bm.full_kv_num_blocks is not None:
                listed += int(bm.full_kv_num_blocks.sum())
            need.append(listed > 0)
            sources.append(bm if listed else None)
    except Exception as exc:  # noqa: BLE001 - told to every rank by _agree, then raised there
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    rows = _agree(group, timeout_s, error, signature, what, extra=need)
    return ContextParallelMask(mask_mod, B, H, seq_len, world, rank, sharding, _block_size(BLOCK_SIZE),
                               device, tuple(sources), tuple(tuple(r) for r in rows))


# ---- captured tensors --------------------------------------------------------------------------


def _walk_captures(obj, name: str = "", seen=None, depth: int = 0) -> list:
    """(name, tensor) of the tensors a mod can read: a function's closure cells, globals and
    default arguments, a partial's arguments, a bound method's object, a module's or callable
    object's attributes, and the containers and functions these hold, as the lowering's guard key
    reaches them (flexcore.lowering.cache). Each tensor once, under the first name found."""
    seen = set() if seen is None else seen
    if isinstance(obj, Tensor):
        if id(obj) in seen:
            return []
        seen.add(id(obj))
        return [(name, obj)]
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, type, types.ModuleType)):
        return []
    if depth > 8 or id(obj) in seen:
        return []
    seen.add(id(obj))
    found = []

    def walk(value, sub):
        found.extend(_walk_captures(value, sub, seen, depth + 1))

    if isinstance(obj, types.FunctionType):
        for cell_name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            if _cell_ok(cell):
                walk(cell.cell_contents, cell_name)
        for glob in global_names(obj.__code__):
            if glob in obj.__globals__:
                walk(obj.__globals__[glob], glob)
        for value in obj.__defaults__ or ():
            walk(value, f"{obj.__name__} default")
        for key, value in (obj.__kwdefaults__ or {}).items():
            walk(value, key)
    elif isinstance(obj, functools.partial):
        walk(obj.func, name)
        for i, value in enumerate(obj.args):
            walk(value, f"{name or 'partial'} argument {i}")
        for key, value in obj.keywords.items():
            walk(value, key)
    elif isinstance(obj, types.MethodType):
        walk(obj.__self__, "self")
        walk(obj.__func__, name)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            walk(value, f"{name}[{i}]")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            walk(value, f"{name}[{key!r}]")
    elif isinstance(obj, torch.nn.Module):
        prefix = f"{name}." if name else ""
        for sub, t in (*obj.named_parameters(), *obj.named_buffers()):
            walk(t, prefix + sub)
        for attr, value in vars(obj).items():
            if not attr.startswith("_"):  # plain tensor attributes, functions it holds
                walk(value, prefix + attr)
        walk(type(obj).forward, name)
    elif callable(obj) and hasattr(obj, "__dict__"):
        prefix = f"{name}." if name else ""
        for attr, value in vars(obj).items():
            walk(value, prefix + attr)
        walk(type(obj).__call__, name)
    return found


def _cell_ok(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later)
        return False
    return True


def _captured_signature(*mods) -> list:
    """Name, shape, dtype and requires_grad of every tensor the mods capture: ranks must agree on
    them (a tensor that holds only the local shard on one rank shows up as a different shape
    there; one that learns on some ranks only would leave the others waiting in the backward's
    sum)."""
    out = []
    for mod in mods:
        for name, t in _walk_captures(mod):
            out.append((name, tuple(t.shape), str(t.dtype), bool(t.requires_grad)))
    return out


def _mod_name(mod) -> str | None:
    """What names a mod across ranks (ranks run one program: a differing name is a mix-up)."""
    if mod is None:
        return None
    mod = getattr(mod, "func", mod)  # a partial's function
    return getattr(mod, "__qualname__", None) or type(mod).__qualname__


class _SumOverGroup(torch.autograd.Function):
    """Identity whose backward sums the gradient over the group. Its token input orders it after
    the call's other collectives in the backward pass, the same on every rank."""

    @staticmethod
    def forward(ctx, group, token, *tensors):
        ctx.group = group
        return (token.detach().clone(), *(t.view_as(t) for t in tensors))

    @staticmethod
    def backward(ctx, d_token, *grads):
        import torch.distributed as dist

        summed = []
        for g in grads:
            g = g.contiguous()
            dist.all_reduce(g, group=ctx.group)
            summed.append(g)
        return (None, d_token, *summed)


class _Substitute(TorchFunctionMode):
    """Passes ``replace[id(t)]`` wherever a torch function gets tensor ``t``: a mod run under it
    reads the group-summed identities of its learning tensors, however it holds them (closure,
    module attribute, default argument, partial)."""

    def __init__(self, replace: dict):
        super().__init__()
        self.replace = replace

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        def swap(x):
            return self.replace.get(id(x), x) if isinstance(x, Tensor) else x

        args, kwargs = tree_map(swap, (tuple(args), kwargs or {}))
        return func(*args, **kwargs)


def _substituted(score_mod, replaced: tuple, originals: tuple):
    """``score_mod`` reading each of ``replaced`` where it reads the matching original tensor.
    The replacements are a closure cell here, so the lowering's key (which counts tensors by
    identity) changes with them, as it must: they are new tensors at every call."""
    def cp_learning_score(score, b, h, q_idx, kv_idx):
        with _Substitute({id(t): r for t, r in zip(originals, replaced)}):
            return score_mod(score, b, h, q_idx, kv_idx)

    return cp_learning_score


# ---- merging partial results --------------------------------------------------------------------


def merge_by_lse(parts: list[tuple[Tensor, Tensor]], out_dtype) -> tuple[Tensor, Tensor]:
    """Combine attention over disjoint key sets from (out_i, lse_i): weights exp(lse_i - lse).
    Rows no part attends to give 0 and lse -inf (as flexcore does), with finite gradients. One
    fused pass forward and one backward (flexcore.kernels.merge)."""
    from flexcore.kernels.merge import merge

    return merge(parts, out_dtype)


class _Tie(torch.autograd.Function):
    """Returns ``out``; the other tensors get zero gradients, so that their backward (a
    collective) runs on every rank even where this rank's result did not use them."""

    @staticmethod
    def forward(ctx, out, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad, *unused):
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


# ---- the all-gather strategy -------------------------------------------------------------------


class _GatheredKV(torch.autograd.Function):
    """Waits for the all-gather of K and V started before the local chunk's compute and returns
    them as (B, Hkv, W·S_local, D); the backward reduce-scatters their gradients."""

    @staticmethod
    def forward(ctx, group, pending, token, k, v):
        ctx.group, ctx.world = group, pending["world"]
        for work in pending["works"]:
            work.wait()
        outs = [_seq_from_ranks(buf, ctx.world) for buf in pending["bufs"]]
        return (token.detach().clone(), *outs)

    @staticmethod
    def backward(ctx, d_token, dk_full, dv_full):
        grads, works = [], []
        for g in (dk_full, dv_full):
            stacked = _ranks_from_seq(g, ctx.world)           # (W·B, H, S_local, D), rank-major
            out = stacked.new_empty((stacked.shape[0] // ctx.world, *stacked.shape[1:]))
            works.append(_reduce_scatter(out, stacked, group=ctx.group, async_op=True))
            grads.append(out)
        for work in works:
            work.wait()
        return (None, None, d_token, *grads)


def _all_gather(out, inp, group, async_op):
    import torch.distributed as dist

    # torch 2.13 renames the single-tensor collectives; the GPU machine's torch has the old names.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter(out, inp, group, async_op):
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _seq_from_ranks(buf: Tensor, world: int) -> Tensor:
    """(W·B, H, S_local, D) from all_gather_into_tensor -> (B, H, W·S_local, D), rank order."""
    wb, h, s, d = buf.shape
    return buf.view(world, wb // world, h, s, d).permute(1, 2, 0, 3, 4).reshape(wb // world, h, world * s, d)


def _ranks_from_seq(x: Tensor, world: int) -> Tensor:
    b, h, ws, d = x.shape
    stacked = x.reshape(b, h, world, ws // world, d).permute(2, 0, 1, 3, 4).contiguous()
    return stacked.view(world * b, h, ws // world, d)


def _allgather(call, mask: ContextParallelMask, q, k, v, group, token):
    world, rank = mask.world_size, mask.rank
    parts = []
    others = any(mask.need[a][s] for a in range(world) for s in range(world) if a != s)
    pending = None
    if others:  # some rank reads another's keys: every rank joins the gather
        bufs, works = [], []
        for t in (k, v):
            t = t.detach().contiguous()
            buf = t.new_empty((world * t.shape[0], *t.shape[1:]))
            works.append(_all_gather(buf, t, group=group, async_op=True))
            bufs.append(buf)
        pending = {"world": world, "works": works, "bufs": bufs}
    if mask.sources[rank] is not None:  # the local chunk, while the gather is in flight
        parts.append(call(q, k, v, rank, mask.sources[rank]))
    tied = []
    if pending is not None:
        token, k_full, v_full = _GatheredKV.apply(group, pending, token, k, v)
        if any(mask.need[rank][s] for s in range(world) if s != rank):
            parts.append(call(q, k_full, v_full, None, mask.gathered()))
        else:
            tied += [k_full, v_full]
    return parts, tied, token


# ---- the ring strategy -------------------------------------------------------------------------


class _RingStep(torch.autograd.Function):
    """One hop of the ring: send the held K/V to the next rank and receive the previous rank's,
    without waiting (``pending['works']`` is waited before the data is read or forwarded). The
    backward sends the received shard's gradient back and receives the sent shard's."""

    @staticmethod
    def forward(ctx, spec, token, k_send, v_send):
        import torch.distributed as dist

        ctx.spec = spec
        ops, out = [], []
        if spec["send_to"] is not None:
            # Kept in spec until waited: the transport reads them asynchronously.
            spec["sent"] = [t.detach().contiguous() for t in (k_send, v_send)]
            ops += [dist.P2POp(dist.isend, t, spec["send_to"], spec["group"]) for t in spec["sent"]]
        if spec["recv_from"] is not None:
            out = [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in spec["shapes"]]
            ops += [dist.P2POp(dist.irecv, t, spec["recv_from"], spec["group"]) for t in out]
        else:
            out = [torch.empty(0, dtype=dt, device=dev) for _, dt, dev in spec["shapes"]]
        spec["works"] = dist.batch_isend_irecv(ops) if ops else []
        spec["send_shapes"] = [(tuple(t.shape), t.dtype, t.device) for t in (k_send, v_send)]
        return (token.detach().clone(), *out)

    @staticmethod
    def backward(ctx, d_token, dk_recv, dv_recv):
        # Started already where _GradHop moved the exchange earlier; only its wait is left here.
        pending = ctx.spec.pop("grad_pending", None)
        works, grads, _sent = pending or _exchange_grads(ctx.spec, dk_recv, dv_recv)
        for work in works:
            work.wait()
        return (None, d_token, *grads)


def _exchange_grads(spec, dk_recv, dv_recv) -> tuple[list, list, list]:
    """Start one hop's backward exchange: the received shard's gradient goes back to its sender
    (zeros where it got none) and the sent shard's comes in. (works, the gradients coming in,
    the ones going out): the latter stay referenced until the works are waited, since the
    transport reads them asynchronously."""
    import torch.distributed as dist

    ops, received, sent = [], [None, None], []
    if spec["recv_from"] is not None:
        sent = [g.contiguous() if g is not None else torch.zeros(s, dtype=dt, device=dev)
                for g, (s, dt, dev) in zip((dk_recv, dv_recv), spec["shapes"])]
        ops += [dist.P2POp(dist.isend, g, spec["recv_from"], spec["group"]) for g in sent]
    if spec["send_to"] is not None:
        received = [torch.empty(s, dtype=dt, device=dev) for s, dt, dev in spec["send_shapes"]]
        ops += [dist.P2POp(dist.irecv, g, spec["send_to"], spec["group"]) for g in received]
    return (dist.batch_isend_irecv(ops) if ops else []), received, sent


class _GradHop(torch.autograd.Function):
    """Identity on a received shard that goes no farther. Its backward, which autograd runs as
    soon as the step that read the shard is differentiated, starts the hop's exchange
    (:func:`_exchange_grads`); the waiting is left to :class:`_RingStep`'s backward, which runs
    after the local step's backward is queued, so the exchange overlaps that compute."""

    @staticmethod
    def forward(ctx, spec, k, v):
        ctx.spec = spec
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        ctx.spec["grad_pending"] = _exchange_grads(ctx.spec, dk, dv)
        return None, dk, dv


def _ring_plan(need, world: int) -> list[int]:
    """last[s]: the farthest hop that rank s's K/V must travel (0: nobody else reads it)."""
    last = []
    for s in range(world):
        hops = [j for j in range(1, world) if need[(s + j) % world][s]]
        last.append(max(hops, default=0))
    return last


def _ring(call, mask: ContextParallelMask, q, k, v, group, token):
    import torch.distributed as dist

    world, rank = mask.world_size, mask.rank
    last = _ring_plan(mask.need, world)
    # sends[h - 1]: whether this rank forwards a shard at hop h (the one it holds at step h - 1).
    sends = [h <= last[(rank - h + 1) % world] for h in range(1, world)]
    global_rank = [dist.get_global_rank(group, r) for r in range(world)]
    held = {0: (k, v, [], None)}  # step -> (k, v, works to wait for before reading, its hop's spec)
    parts = []
    for t in range(world):
        kt, vt, works, arrived = held.pop(t)
        hop = t + 1
        if hop < world:  # start the next hop before computing this step
            src_next = (rank - hop) % world
            send = sends[t]
            recv = hop <= last[src_next]
            if send or recv:
                if send:
                    works = _waited(works, arrived)
                spec = {"group": group, "send_to": global_rank[(rank + 1) % world] if send else None,
                        "recv_from": global_rank[(rank - 1) % world] if recv else None,
                        "shapes": [(tuple(k.shape), k.dtype, k.device), (tuple(v.shape), v.dtype, v.device)]}
                k_send = kt if send else k
                v_send = vt if send else v
                token, k_next, v_next = _RingStep.apply(spec, token, k_send, v_send)
                held[hop] = (k_next, v_next, spec["works"], spec)
            else:
                held[hop] = (k, v, [], None)  # nothing travels: a placeholder never read
        src = (rank - t) % world
        if mask.need[rank][src]:
            works = _waited(works, arrived)
            # P2P ops between two ranks match in the order they are issued, and the backward's
            # hops are issued in descending order along the token chain: an early exchange keeps
            # that order only where this rank sends nothing at this hop or any later one.
            if arrived is not None and arrived["recv_from"] is not None and not any(sends[t:]) \
                    and torch.is_grad_enabled():
                kt, vt = _GradHop.apply(arrived, kt, vt)
            parts.append(call(q, kt, vt, src, mask.sources[src]))
        _waited(works, arrived)  # data only relayed onward was waited above before its send
    return parts, [], token


def _waited(works: list, spec: dict | None) -> list:
    """Wait for a hop's transfers, and drop their handles and sent buffers from its spec, which
    the autograd graph holds (handles kept past destroy_process_group outlive their group)."""
    for w in works:
        w.wait()
    if spec is not None:
        spec["works"] = []
        spec.pop("sent", None)
    return []


# ---- the entry point ---------------------------------------------------------------------------


def _pick_strategy(strategy: str, hq: int, hkv: int) -> str:
    """auto: all-gather when K/V have fewer heads than Q (GQA: K/V are small next to the work, and
    one collective beats W-1 hops); ring otherwise, since it skips the shards a rank's mask leaves
    empty and overlaps each hop with a step's compute."""
    if strategy != "auto":
        return strategy
    return "allgather" if hkv < hq else "ring"


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask=None,
                   scale: float | None = None, enable_gqa: bool = False, kernel_options=None, *,
                   mask_mod=None, group=None, strategy: str = "auto", sharding: str | None = None,
                   return_lse: bool = False, return_aux=None, BLOCK_SIZE=128, check: bool = True,
                   timeout_s: float = DEFAULT_TIMEOUT_S):
    """Context-parallel ``flexcore.flex_attention``: each rank passes its shard of the sequence.

    Args:
        query, key, value: this rank's shards, (B, Hq, S_local, D), (B, Hkv, S_local, D),
            (B, Hkv, S_local, Dv), as :func:`shard_sequence` cuts them.
        score_mod: ``(score, b, h, q_idx, kv_idx)`` over **global** positions. Tensors it captures
            must be the same (global) on every rank; those that require grad get the gradient
            summed over the group (the gradient of the sum of every rank's loss).
        block_mask: a :class:`ContextParallelMask` from :func:`create_block_mask_for_rank`
            (build it once and reuse it), or None.
        mask_mod: instead of block_mask: a mask_mod over global positions, built into a
            ContextParallelMask on every call (a collective).
        scale, enable_gqa, kernel_options: as in ``flexcore.flex_attention``.
        group: process group or 1-D DeviceMesh (default: the world).
        strategy: ``"allgather"``, ``"ring"`` or ``"auto"`` (see :func:`_pick_strategy`).
        sharding: ``"zigzag"`` or ``"contiguous"``; default the block_mask's, else zigzag.
        return_lse: also return the (B, Hq, S_local) log-sum-exp over the global keys
            (deprecated, as in torch: use ``return_aux``).
        return_aux: an ``AuxRequest(lse=..., max_scores=...)``: lse as above (differentiable),
            max_scores the rows' largest score over the global keys (not differentiable).
        BLOCK_SIZE: block size of the mask built from ``mask_mod``.
        check: exchange a signature of the inputs first (a small host collective on a gloo group,
            bounded by ``timeout_s``) so that bad input raises on every rank instead of hanging.

    Returns:
        out (B, Hq, S_local, Dv); with ``return_aux``, ``(out, AuxOutput(lse, max_scores))``, a
        field None unless requested; with ``return_lse``, ``(out, lse)``.
    """
    import torch.distributed as dist

    from flexcore.attention import _requested

    what = "flexcore.distributed.flex_attention"
    want_lse, want_max = _requested(return_lse, return_aux)
    group = _resolve_group(group, what)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if sharding is None:
        sharding = block_mask.sharding if isinstance(block_mask, ContextParallelMask) else "zigzag"
    error = None
    try:
        _check_inputs(query, key, value, block_mask, mask_mod, world, rank, sharding, strategy,
                      enable_gqa, scale, what)
    except ContextParallelError as exc:
        if not check:
            raise
        error = str(exc).removeprefix(what + ": ")
    if check:
        def described(t):
            return (tuple(t.shape), str(t.dtype), bool(t.requires_grad)) if isinstance(t, Tensor) else None

        mask_mod_used = getattr(block_mask, "mask_mod", None) if mask_mod is None else mask_mod
        # What every rank must pass alike; an error on one rank after this point would leave the
        # others waiting in a collective.
        signature = {
            "query": described(query), "key": described(key), "value": described(value),
            "enable_gqa": enable_gqa, "scale": scale, "strategy": strategy, "sharding": sharding,
            "return_lse": return_lse, "return_aux": repr(return_aux),
            "mask": (block_mask.seq_len, block_mask.world_size)
            if isinstance(block_mask, ContextParallelMask) else None,
            "score_mod": _mod_name(score_mod), "mask_mod": _mod_name(mask_mod_used),
            "captured tensors": _captured_signature(score_mod, mask_mod_used),
        }
        _agree(group, timeout_s, error, signature, what)
    seq_len = query.shape[2] * world
    if block_mask is None:
        block_mask = create_block_mask_for_rank(mask_mod, None, None, seq_len, group, sharding=sharding,
                                                BLOCK_SIZE=BLOCK_SIZE, device=query.device,
                                                timeout_s=timeout_s)
    mask = block_mask
    strategy = _pick_strategy(strategy, query.shape[1], key.shape[1])

    # The call's collectives in the backward are ordered by a token: hops/gather, then the sum
    # of captured gradients, the same on every rank.
    sum_node = None
    if score_mod is not None and torch.is_grad_enabled():
        learn = {}
        for _, t in _walk_captures(score_mod):
            if t.requires_grad:
                learn.setdefault(id(t), t)
        if learn:
            sum_node = list(learn.values())
    needs_grad = torch.is_grad_enabled() and (
        sum_node is not None or any(t.requires_grad for t in (query, key, value)))
    token = torch.zeros((), device=query.device, requires_grad=needs_grad)
    layout = mask.layout()
    q_src = mask.src_tensor(rank)
    src_tensors = {s: mask.src_tensor(s) for s in range(world)}

    maxima = []  # each part's max_scores, where requested

    def call(q, k, v, src, bm, user_score):
        from flexcore import AuxRequest
        from flexcore import flex_attention as local_attention

        score = None
        if user_score is not None:
            if src is None:
                def cp_score(score, b, h, q_idx, kv_idx):
                    return user_score(score, b, h, layout.local(q_idx, q_src), layout.gathered(kv_idx))
            else:
                kv_src = src_tensors[src]

                def cp_score(score, b, h, q_idx, kv_idx):
                    return user_score(score, b, h, layout.local(q_idx, q_src), layout.local(kv_idx, kv_src))
            score = cp_score
        out, aux = local_attention(q, k, v, score_mod=score, block_mask=bm, scale=scale,
                                   enable_gqa=enable_gqa, kernel_options=kernel_options,
                                   return_aux=AuxRequest(lse=True, max_scores=want_max))
        if want_max:
            maxima.append(aux.max_scores)
        return out, aux.lse

    user_score = score_mod
    replaced = []
    if sum_node is not None:
        token_sum, *replaced = _SumOverGroup.apply(group, token, *sum_node)
        user_score = _substituted(score_mod, tuple(replaced), tuple(sum_node))
        token = token_sum

    def bound(q, k, v, src, bm):
        return call(q, k, v, src, bm, user_score)

    run = _allgather if strategy == "allgather" else _ring
    parts, tied, token = run(bound, mask, query, key, value, group, token)
    if parts:
        out, lse = merge_by_lse(parts, query.dtype)
    else:  # this rank's rows attend nowhere
        B, Hq, L = query.shape[:3]
        out = query.new_zeros((B, Hq, L, value.shape[-1]))
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        lse = torch.full((B, Hq, L), -torch.inf, dtype=lse_dtype, device=query.device)
        tied += [t for t in (query, key, value) if t.requires_grad]
    if needs_grad:
        tied = [t for t in (*tied, token, *replaced) if t.requires_grad]
        if tied:
            out = _Tie.apply(out, *tied)
    if return_aux is not None:
        from flexcore import AuxOutput

        max_scores = None
        if want_max:
            max_scores = (torch.stack(maxima).amax(0) if maxima
                          else torch.full_like(lse.detach(), -torch.inf))
        return out, AuxOutput(lse=lse if want_lse else None, max_scores=max_scores)
    return (out, lse) if return_lse else out


def _check_inputs(query, key, value, block_mask, mask_mod, world, rank, sharding, strategy,
                  enable_gqa, scale, what):
    from flexcore.attention import check_call
    from flexcore.errors import InputError

    _check_sharding(sharding, what)
    if strategy not in STRATEGIES:
        raise ContextParallelError(f"{what}: strategy={strategy!r}; expected one of {STRATEGIES}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ContextParallelError(f"{what}: {name} has shape {shape}; expected this rank's "
                                       "shard (B, H, S_local, D)")
    # The local call's own checks, here, so that a rank's error reaches every rank.
    try:
        check_call(query, key, value, None, None, scale, enable_gqa)
    except InputError as exc:
        raise ContextParallelError(f"{what}: {exc}") from None
    if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        raise ContextParallelError(
            f"{what}: query, key and value shards must have the same length; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    S = query.shape[2] * world
    _check_length(S, world, sharding, what, f"global length (S_local={query.shape[2]} x world {world})")
    if block_mask is not None and mask_mod is not None:
        raise ContextParallelError(f"{what}: give block_mask or mask_mod, not both")
    if block_mask is not None:
        if not isinstance(block_mask, ContextParallelMask):
            raise ContextParallelError(
                f"{what}: block_mask is a {type(block_mask).__name__}; expected the "
                "ContextParallelMask of flexcore.distributed.create_block_mask_for_rank")
        if block_mask.world_size != world or block_mask.rank != rank:
            raise ContextParallelError(
                f"{what}: block_mask was built for rank {block_mask.rank} of {block_mask.world_size}, "
                f"but this is rank {rank} of {world}; build it with the same group")
        if block_mask.seq_len != S:
            raise ContextParallelError(
                f"{what}: block_mask covers a global length of {block_mask.seq_len}, but the shards "
                f"give {S} (S_local={query.shape[2]} x world {world})")
        if block_mask.sharding != sharding:
            raise ContextParallelError(
                f"{what}: block_mask was built for sharding={block_mask.sharding!r}, the call asks "
                f"for {sharding!r}")
