"""A BlockMask's tables as the kernels read them: BlockTensors (views expanded to (B, H, ...)), their
statistics and launch orders, and the finer tables over REFINE_BLOCK-sized blocks."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flexcore._runtime import capturing

#: Side of the finer blocks (flexcore.blockmask.refine_block_map) that the template may read.
REFINE_BLOCK = 64


def table_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides as the kernels take a table's, 0 on every dim of size 1: a table of batch or
    head 1 serves every batch or head without an expanded view."""
    return tuple(0 if n == 1 else st for n, st in zip(t.shape, t.stride()))


@dataclass(frozen=True)
class BlockTensors:
    """The BlockMask tensors a kernel reads, (B, H, ...) or of batch or head 1 (the kernels read
    them through :func:`table_strides`)."""

    num_blocks: torch.Tensor
    indices: torch.Tensor
    full_num_blocks: torch.Tensor | None
    full_indices: torch.Tensor | None
    sparse_block: tuple[int, int]  # (rows, cols) of one mask block along this iteration

    # Schedules computed for these tables (see schedule). ``expanded`` may share one dict that
    # lives as long as the BlockMask, so that a CUDA graph that captured an order keeps it.
    _orders: dict = field(default_factory=dict, compare=False, repr=False)
    # ``refine(mask_lowered, compute)``: the same mask's tables over finer blocks, their transpose and
    # their cost relative to these ((BlockTensors, BlockTensors, ratio), see finer_tables), or
    # None; ``compute`` False answers
    # only what is already known (inside a CUDA graph capture). Set by flexcore.attention.
    refine: object = field(default=None, compare=False, repr=False)

    @classmethod
    def broadcast(cls, num_blocks, indices, full_num_blocks, full_indices, sparse_block) -> "BlockTensors":
        """Tables of shape (1 or B, 1 or H, ...) as they are, for a kernel that reads them through
        :func:`table_strides`: inside compiled graphs each expanded view is one more step per call."""
        return cls(num_blocks, indices, full_num_blocks, full_indices, tuple(sparse_block))

    @classmethod
    def expanded(cls, num_blocks, indices, full_num_blocks, full_indices, sparse_block,
                 B: int, H: int, orders: dict | None = None, refine=None) -> "BlockTensors":
        """Tables of shape (1 or B, 1 or H, ...) viewed as (B, H, ...) without a copy. ``orders``:
        where to keep the schedules (a new dict by default); ``refine``: see the field."""
        def expand(t):
            return None if t is None else t.expand(B, H, *t.shape[2:])

        return cls(expand(num_blocks), expand(indices), expand(full_num_blocks),
                   expand(full_indices), tuple(sparse_block), {} if orders is None else orders, refine)

    def full_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(full_num_blocks, full_indices); for tables without full blocks, the partial ones stand in
        as the kernels' pointer arguments (HAS_FULL_BLOCKS is then False and they are not read)."""
        if self.full_num_blocks is None:
            return self.num_blocks, self.indices
        return self.full_num_blocks, self.full_indices

    def schedule(self, rows: int, group: int, min_mean_blocks: float = 0.0) -> torch.Tensor | None:
        """int32 launch order of the (batch·head, mask row) tiles of the first ``rows`` mask rows,
        flattened as ``bh * rows + row``, or None where the natural order serves as well.

        Tiles are taken ``group`` at a time in their natural order (neighbouring heads and rows
        share key and value blocks in L2); within each group the longest run first, so that the
        last programs of the grid are short and no SM idles behind a long one. Length counts
        partial blocks 5/4 of a full one (:meth:`row_cost`). None when every row has the same work
        (nothing to reorder) or when rows visit fewer than ``min_mean_blocks`` blocks on average.
        Cached per (B, H, rows, group, min_mean_blocks); computing it needs :meth:`stats`, so
        inside a CUDA graph capture it answers None until a call outside one has computed them.
        """
        key = (*self.num_blocks.shape[:2], rows, group, min_mean_blocks)
        if key not in self._orders:
            stats = self.stats(rows)
            if stats is None:
                return None
            low, high = stats[:2]
            order = None
            if low != high and self.visits_on_average(rows, min_mean_blocks):
                order = longest_first(self.row_cost(rows).reshape(-1), group).to(torch.int32)
            self._orders[key] = order
        return self._orders[key]

    def visits_on_average(self, rows: int, blocks: float) -> bool:
        """Whether the first ``rows`` mask rows of every batch and head visit ``blocks`` key blocks
        or more on average, counted as :meth:`row_cost` does (a partial block 5/4 of a full one).
        False inside a CUDA graph capture until a call outside one has computed :meth:`stats`."""
        stats = self.stats(rows)
        return stats is not None and stats[2] >= 4 * blocks * self.num_blocks[..., :rows].numel()

    def stats(self, rows: int) -> tuple[int, int, int, int, int, int] | None:
        """Over the first ``rows`` mask rows of every batch and head: the least, most and total
        :meth:`row_cost`, the total partial blocks, the least full blocks, and the number of rows
        whose full blocks are not one ascending run of consecutive blocks; all 0 when there are
        none. One read-back from the device (shared with other tables by :func:`gather_stats`),
        cached per (B, H, rows) as long as the schedules are; None inside a CUDA graph capture when
        not computed yet (a read-back would break the capture)."""
        key = self._stats_key(rows)
        if key not in self._orders:
            if capturing():
                return None
            gather_stats([(self, rows)])
        return self._orders[key]

    def _stats_key(self, rows: int) -> tuple:
        return ("stats", *self.num_blocks.shape[:2], rows)

    def _stat_terms(self, rows: int) -> torch.Tensor:
        """:meth:`stats` as a device tensor of six int64 values (no read-back)."""
        cost = self.row_cost(rows)
        if not cost.numel():
            return torch.zeros(6, dtype=torch.int64, device=cost.device)
        full_low = broken = cost.new_zeros(())
        if self.full_num_blocks is not None:
            # Listed indices increase strictly (BlockMask checks it): a row is one run when its last
            # listed index is its first plus the count less one.
            # Only (B, H, rows) values are gathered: the tables may be broadcast views.
            n = self.full_num_blocks[..., :rows].to(torch.int64)
            idx = self.full_indices[..., :rows, :]
            last = idx.gather(-1, (n - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1).to(torch.int64)
            broken = ((n > 0) & (last - idx[..., 0].to(torch.int64) != n - 1)).sum()
            full_low = n.min()
        return torch.stack([cost.min(), cost.max(), cost.sum(),
                            self.num_blocks[..., :rows].sum().to(torch.int64), full_low, broken])

    def full_runs(self, rows: int) -> bool:
        """Whether the full blocks of each of the first ``rows`` mask rows are one ascending run
        of consecutive blocks (causal, sliding-window, prefix and document masks): the forward
        then steps over them from the first index instead of reading one index per tile. False
        inside a CUDA graph capture until a call outside one has computed :meth:`stats`."""
        if self.full_num_blocks is None:
            return False
        stats = self.stats(rows)
        return stats is not None and stats[5] == 0

    def all_full(self, rows: int, kv_blocks: int) -> bool:
        """Whether each of the first ``rows`` mask rows lists all ``kv_blocks`` key blocks as full
        blocks and none as partial (no mask, noop_mask): the forward's dense path then visits
        every key tile without reading the tables. False inside a CUDA graph capture until a call
        outside one has computed :meth:`stats`."""
        if self.full_num_blocks is None or kv_blocks <= 0:
            return False
        stats = self.stats(rows)
        return stats is not None and stats[3] == 0 and stats[4] == kv_blocks and rows > 0

    def row_cost(self, rows: int) -> torch.Tensor:
        """(B, H, rows) int64: the work of each of the first ``rows`` mask rows, in quarter blocks:
        a full block counts 4 and a partial one 5 (its mask hook runs per element)."""
        cost = self.num_blocks[..., :rows].to(torch.int64) * 5
        if self.full_num_blocks is not None:
            cost = cost + self.full_num_blocks[..., :rows].to(torch.int64) * 4
        return cost


def _read_back(values: torch.Tensor) -> list:
    """The host's copy of ``values`` (a synchronising read-back; one per call)."""
    return values.tolist()


def gather_stats(pairs) -> None:
    """Compute :meth:`BlockTensors.stats` of several ``(blocks, rows)`` pairs with one read-back
    (e.g. the forward's key-block tables and the backward's transposed tables of a new mask, so
    that a training step with a new mask waits on the GPU once, not twice). Pairs already computed
    are skipped; nothing is computed inside a CUDA graph capture."""
    todo = [(blocks, rows) for blocks, rows in pairs if blocks._stats_key(rows) not in blocks._orders]
    if not todo or capturing():
        return
    values = _read_back(torch.stack([blocks._stat_terms(rows) for blocks, rows in todo]))
    for (blocks, rows), row in zip(todo, values):
        blocks._orders[blocks._stats_key(rows)] = tuple(int(x) for x in row)


def longest_first(cost: torch.Tensor, group: int) -> torch.Tensor:
    """Indices that order the 1-d int64 ``cost`` longest first within consecutive groups of
    ``group`` entries (all of them if ``group`` <= 0; ties keep their order); the groups stay in
    their order."""
    if not cost.numel():
        return torch.zeros(0, dtype=torch.int64, device=cost.device)
    chunk = torch.arange(cost.numel(), device=cost.device) // (group if group > 0 else cost.numel())
    key = chunk * (1 << 40) - cost  # costs stay far below 2**40: no read-back of the maximum
    return torch.argsort(key, stable=True)



def versions(tensors) -> tuple:
    """The identities and version counters of ``tensors``: equal while none is replaced or
    modified in place (the finer tables hold for a mask_mod's captured tensors as they were).
    An inference tensor has no version counter: its identity alone (finer_tables takes none for
    a mask_mod that reads one)."""
    return tuple((id(t), None if t.is_inference() else t._version) for t in tensors)


_READS: dict = {}  # lowered mod's key (its source's hash) -> reads_batch_head


def reads_batch_head(mask_lowered) -> tuple[bool, bool]:
    """Whether the lowered mask_mod reads its ``b`` and its ``h`` argument (per call: kept by
    the mod's key, which its source decides)."""
    found = _READS.get(mask_lowered.key)
    if found is None:
        graph = getattr(mask_lowered, "graph", None)
        args = [] if graph is None else [n for n in graph.graph.nodes if n.op == "placeholder"]
        found = ((False, False) if graph is None else (True, True) if len(args) != 4
                 else (bool(args[0].users), bool(args[1].users)))
        _READS[mask_lowered.key] = found
    return found


def refine_key(mask_lowered) -> tuple:
    """What finer_tables reads besides a plan key's call and options: the lowered mask_mod
    (a rebound global changes it), the versions of its captured tensors, and whether it reads
    ``b`` and ``h``."""
    return mask_lowered.key, versions(mask_lowered.captured), reads_batch_head(mask_lowered)


def finer_tables(blocks: BlockTensors, q_len: int, mask_lowered, opts, serves_own=None):
    """(key-block tables, transposed tables) of the mask of ``blocks`` over REFINE_BLOCK-sized
    blocks where the policy's ``forward.refine`` takes them for a call with ``q_len`` queries,
    else None. ``serves_own()``: whether another kernel serves the mask's own tables (then kept),
    asked only where the finer ones would be taken. Cheap once decided: the finer tables live
    with the mask."""
    policy = opts.dispatch.forward
    rule = policy.refine
    if rule == "off" or blocks.refine is None or opts.BLOCK_M or opts.BLOCK_N:
        return None
    sparse_q, sparse_kv = blocks.sparse_block
    fine = REFINE_BLOCK
    if sparse_q % fine or sparse_kv % fine or (sparse_q == fine and sparse_kv == fine):
        return None
    if rule == "auto":
        stats = blocks.stats(math.ceil(q_len / sparse_q))
        if stats is None or stats[3] == 0:  # unknown yet (graph capture), or no partial block
            return None
        # At best a partial block keeps one partial sub-block of its r: the saving's bound.
        r = (sparse_q // fine) * (sparse_kv // fine)
        if (stats[2] * r - stats[3] * (5 * r - 5)) > policy.refine_max_cost * stats[2] * r:
            return None
        if serves_own is not None and serves_own():
            return None
    if any(t.is_inference() for t in mask_lowered.captured):
        return None  # no version counter: an edit in place could not be seen, so none are kept
    found = blocks.refine(mask_lowered, not capturing())
    if found is None:
        return None
    kv_fine, q_fine, ratio = found
    return (kv_fine, q_fine) if rule == "on" or ratio <= policy.refine_max_cost else None


def q_block_tensors(block_mask, B: int, Hq: int) -> BlockTensors:
    """The BlockMask's transposed tables (q_*, full_q_*), expanded to (B, Hq, KV_BLOCKS[, Q_BLOCKS]).

    A BlockMask built with ``compute_q_blocks=False`` gets its transpose computed here.
    """
    if block_mask.q_indices is None:
        from flexcore.blockmask import BlockMask

        block_mask = BlockMask.from_kv_blocks(
            block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, BLOCK_SIZE=block_mask.BLOCK_SIZE,
            mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths)

    bq, bkv = block_mask.BLOCK_SIZE
    return BlockTensors.expanded(block_mask.q_num_blocks, block_mask.q_indices,
                                 block_mask.full_q_num_blocks, block_mask.full_q_indices,
                                 (bkv, bq), B, Hq)


def refine_tables(block_mask, B: int, Hq: int, own: BlockTensors, reads: tuple[bool, bool]):
    """(finer key-block tables, their transpose, their cost relative to ``own``: the mask's own
    key-block tables) over REFINE_BLOCK-sized blocks, expanded to (B, Hq, ...), or None where
    flexcore.blockmask.refine_block_map gives none. One read-back. ``reads``: whether the
    mask_mod reads ``b`` and ``h``; over a size the mask broadcasts, the mask_mod is then
    evaluated per batch or head (the mask's one block map holds for all of them only at block
    level)."""
    from flexcore.blockmask import BlockMask, refine_block_map

    size = (REFINE_BLOCK, REFINE_BLOCK)
    stored_b, stored_h = block_mask.kv_num_blocks.shape[:2]
    batch_heads = (B if reads[0] and stored_b == 1 else stored_b, Hq if reads[1] and stored_h == 1 else stored_h)
    fine = refine_block_map(block_mask, size, batch_heads=batch_heads)
    if fine is None:
        return None
    finer = BlockMask.from_trusted_block_map(fine, size, block_mask.seq_lengths, block_mask.mask_mod)
    kv_fine = BlockTensors.expanded(finer.kv_num_blocks, finer.kv_indices, finer.full_kv_num_blocks,
                                    finer.full_kv_indices, size, B, Hq)
    bq, bkv = block_mask.BLOCK_SIZE
    per_block = (bq // REFINE_BLOCK) * (bkv // REFINE_BLOCK)  # finer blocks per block of the mask
    costs = torch.stack([own.row_cost(own.num_blocks.shape[-1]).sum() * per_block,
                         kv_fine.row_cost(kv_fine.num_blocks.shape[-1]).sum()])
    coarse, cost = costs.tolist()  # one read-back per mask
    return kv_fine, q_block_tensors(finer, B, Hq), (cost / coarse if coarse else 1.0)
