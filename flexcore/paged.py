"""Paged KV cache for decoding (PagedAttention, Kwon et al. 2023, arXiv 2309.06180).

Sequences of different lengths share one physical cache of fixed-size pages,
``k_cache (1, H, n_pages * page_size, D)``. A page table maps each sequence's logical blocks to
physical pages. Attention reads the physical cache directly: :meth:`PagedAttention.convert_logical_block_mask`
rewrites a BlockMask's key-block indices to physical pages, and the wrapped mods translate a
physical key index back to the logical one through captured tables, so the kernels are the usual
ones and a new page table never recompiles.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from flexcore._types import MaskMod, ScoreMod
from flexcore.errors import InputError

__all__ = ["PagedAttention"]


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} = {value!r}: expected a positive int")
    return value


def _int_list(value, name: str) -> list[int]:
    """Batch indices or lengths as Python ints (from an int, or an int tensor of any shape)."""
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise InputError(f"{name} has dtype {value.dtype}; expected an integer tensor")
        return [int(x) for x in value.reshape(-1).tolist()]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an int or an integer tensor; got {type(value).__name__}")
    return [value]


class PagedAttention:
    """A page allocator and page table for a paged KV cache, with torch's experimental API.

    Args:
        n_pages: physical pages in the cache.
        page_size: tokens per page; equal to the key BLOCK_SIZE of the BlockMasks used with it.
        max_batch_size: number of sequence slots (batch indices ``0 .. max_batch_size - 1``).
        device: where the page tables live (the cache's device).

    Attributes:
        page_table: (max_batch_size, n_pages) int64, logical block -> physical page (-1: none).
        physical_to_logical: (max_batch_size, n_pages) int64, physical page -> logical block of that
            sequence (-1: not its page).
        capacity: (max_batch_size,) int64, reserved tokens per sequence.

    Example:
        >>> paged = PagedAttention(n_pages=64, page_size=128, max_batch_size=4, device="cuda")
        >>> k_cache = torch.zeros(1, Hkv, 64 * 128, D, device="cuda", dtype=torch.bfloat16)
        >>> paged.reserve(torch.tensor(0), torch.tensor(1000))
        >>> paged.assign(torch.tensor([0]), torch.arange(1000)[None], k, v, k_cache, v_cache)
        >>> bm = paged.convert_logical_block_mask(logical_block_mask)
        >>> out = flex_attention(q, k_cache, v_cache, block_mask=bm,
        ...                      score_mod=paged.get_score_mod(alibi))
    """

    def __init__(self, n_pages: int, page_size: int, max_batch_size: int, device="cuda"):
        self.n_pages = _positive(n_pages, "n_pages")
        self.page_size = _positive(page_size, "page_size")
        self.max_batch_size = _positive(max_batch_size, "max_batch_size")
        self.device = torch.device(device)
        self.page_table = torch.full((max_batch_size, n_pages), -1, dtype=torch.int64, device=self.device)
        self.physical_to_logical = torch.full((max_batch_size, n_pages), -1, dtype=torch.int64,
                                              device=self.device)
        self.capacity = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)
        # Host copies of the bookkeeping: errors are found without reading the device tables.
        self._pages: list[list[int]] = [[] for _ in range(max_batch_size)]
        self.empty_pages: list[int] = list(range(n_pages - 1, -1, -1))  # popped from the end
        # A flat view shares storage with physical_to_logical, so mods that capture it see every
        # later reserve/erase without being rebuilt (and without recompiling).
        self._p2l_flat = self.physical_to_logical.view(-1)
        # Page-table changes: in all, and per sequence (a mask depends on its own rows only).
        self._version = 0
        self._row_versions = [0] * max_batch_size

    @property
    def version(self) -> int:
        """Counts the changes of the page table (a reserve that allocates, an erase). A BlockMask
        converted before a change to one of its sequences' pages is refused: those pages may
        belong to another sequence now. ``assign`` writes keys and values without moving pages,
        so it leaves the version alone."""
        return self._version

    def _changed(self, b: int) -> None:
        self._version += 1
        self._row_versions[b] += 1

    def _guard(self, rows=None):
        """A check, attached to the BlockMasks built for the page table as it is now, that raises
        once the pages of one of ``rows`` (page-table rows; None: all) have changed."""
        rows = tuple(range(self.max_batch_size)) if rows is None else tuple(rows)
        return functools.partial(self._check_rows, self._version, rows,
                                 tuple(self._row_versions[r] for r in rows))

    def _check_rows(self, version: int, rows: tuple, row_versions: tuple) -> None:
        if self._version == version:  # nothing changed at all: the common case, one comparison
            return
        for row, seen in zip(rows, row_versions):
            if self._row_versions[row] != seen:
                raise InputError(
                    f"this BlockMask was built for the paged cache's pages of batch_idx {row}, "
                    f"but erase/reserve changed them since: they may now belong to another "
                    f"sequence. Convert the logical mask again with "
                    f"paged.convert_logical_block_mask(...) (or rebuild a mask made from "
                    f"paged.get_mask_mod) after erase/reserve")

    # -- allocation ------------------------------------------------------------------------------

    def _batch(self, batch_idx, what: str) -> int:
        values = _int_list(batch_idx, "batch_idx")
        if len(values) != 1:
            raise InputError(f"{what}: batch_idx must hold one index; got {len(values)}")
        b = values[0]
        if not 0 <= b < self.max_batch_size:
            raise InputError(f"{what}: batch_idx {b} is out of range [0, {self.max_batch_size}) "
                             f"(max_batch_size={self.max_batch_size})")
        return b

    def reserved_length(self, batch_idx) -> int:
        """Tokens reserved for one sequence (0 if it holds no pages)."""
        return len(self._pages[self._batch(batch_idx, "reserved_length")]) * self.page_size

    def reserve(self, batch_idx, seq_len) -> None:
        """Make sure sequence ``batch_idx`` can hold ``seq_len`` tokens, allocating pages as needed.

        Args:
            batch_idx: int or 1-element int tensor.
            seq_len: int or 1-element int tensor, the total length needed (not an increment).

        Raises:
            InputError: when fewer pages are free than needed (nothing is allocated then).
        """
        b = self._batch(batch_idx, "reserve")
        lengths = _int_list(seq_len, "seq_len")
        if len(lengths) != 1 or lengths[0] < 0:
            raise InputError(f"reserve: seq_len must be one non-negative length; got {lengths}")
        have = len(self._pages[b])
        need = -(-lengths[0] // self.page_size) - have
        if need <= 0:
            return
        if need > len(self.empty_pages):
            raise InputError(
                f"reserve(batch_idx={b}, seq_len={lengths[0]}): out of pages: needs {need} more pages of "
                f"{self.page_size} tokens but only {len(self.empty_pages)} of {self.n_pages} are free. "
                f"Erase finished sequences, or create PagedAttention with a larger n_pages")
        pages = self.empty_pages[-need:][::-1]
        del self.empty_pages[-need:]
        self._pages[b].extend(pages)
        page_ids = torch.tensor(pages, dtype=torch.int64, device=self.device)
        logical = torch.arange(have, have + need, dtype=torch.int64, device=self.device)
        self.page_table[b, have:have + need] = page_ids
        self.physical_to_logical[b, page_ids] = logical
        self.capacity[b] = (have + need) * self.page_size
        self._changed(b)

    def erase(self, batch_idx) -> None:
        """Free every page of sequence ``batch_idx`` (its slot can be reserved again).

        Raises:
            InputError: when the sequence holds no pages (never reserved, or already erased).
        """
        b = self._batch(batch_idx, "erase")
        pages = self._pages[b]
        if not pages:
            raise InputError(f"erase: batch_idx {b} holds no pages (never reserved, or already erased)")
        page_ids = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.physical_to_logical[b, page_ids] = -1
        self.page_table[b] = -1
        self.capacity[b] = 0
        self.empty_pages.extend(reversed(pages))
        self._pages[b] = []
        self._changed(b)

    # -- cache writes ----------------------------------------------------------------------------

    def assign(self, batch_idx: Tensor, input_pos: Tensor, k_val: Tensor, v_val: Tensor,
               k_cache: Tensor, v_cache: Tensor) -> None:
        """Write new keys and values at logical positions of some sequences into the paged cache.

        Args:
            batch_idx: (B,) int tensor, the sequences written.
            input_pos: (B, S) int tensor, logical positions of the S new tokens of each sequence.
            k_val: (B, H, S, D); v_val: (B, H, S, Dv).
            k_cache: (1, H, n_pages * page_size, D); v_cache: (1, H, n_pages * page_size, Dv).

        Raises:
            InputError: on mismatched shapes/dtypes, a sequence with no pages, or a position past the
            reserved length; the caches are untouched then.
        """
        for name, t in (("batch_idx", batch_idx), ("input_pos", input_pos), ("k_val", k_val),
                        ("v_val", v_val), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, Tensor):
                raise InputError(f"assign: {name} must be a torch.Tensor; got {type(t).__name__}")
        if k_val.requires_grad or v_val.requires_grad:
            raise InputError("assign: k_val and v_val must not require grad (detach them first)")
        if batch_idx.dim() != 1 or input_pos.dim() != 2 or input_pos.shape[0] != batch_idx.shape[0]:
            raise InputError(f"assign: batch_idx must be (B,) and input_pos (B, S); got "
                             f"{_shape(batch_idx)} and {_shape(input_pos)}")
        B, S = input_pos.shape
        slots = self.n_pages * self.page_size
        if k_val.dim() != 4 or v_val.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
            raise InputError(f"assign: k_val/v_val must be (B, H, S, D) and the caches (1, H, "
                             f"{slots}, D); got {_shape(k_val)}, {_shape(v_val)}, {_shape(k_cache)}, "
                             f"{_shape(v_cache)}")
        H = k_cache.shape[1]
        for name, val, cache in (("k", k_val, k_cache), ("v", v_val, v_cache)):
            if cache.shape[0] != 1 or cache.shape[2] != slots:
                raise InputError(f"assign: {name}_cache has shape {_shape(cache)}; expected "
                                 f"(1, H, n_pages * page_size = {slots}, D)")
            if tuple(val.shape) != (B, H, S, cache.shape[3]):
                raise InputError(f"assign: {name}_val has shape {_shape(val)}; expected "
                                 f"{(B, H, S, cache.shape[3])} (batch_idx, input_pos and {name}_cache "
                                 f"give B={B}, S={S}, H={H}, D={cache.shape[3]})")
            if val.dtype != cache.dtype or val.device != cache.device:
                raise InputError(f"assign: {name}_val is {val.dtype} on {val.device} but {name}_cache is "
                                 f"{cache.dtype} on {cache.device}")
        if v_cache.shape[1] != H:
            raise InputError(f"assign: k_cache has {H} heads and v_cache {v_cache.shape[1]}")
        if input_pos.dtype.is_floating_point or input_pos.dtype == torch.bool:
            raise InputError(f"assign: input_pos has dtype {input_pos.dtype}; expected an integer dtype")

        batches = _int_list(batch_idx, "batch_idx")
        for b in batches:
            if not 0 <= b < self.max_batch_size:
                raise InputError(f"assign: batch_idx {b} is out of range [0, {self.max_batch_size})")
            if not self._pages[b]:
                raise InputError(f"assign: batch_idx {b} holds no pages (never reserved, or erased); "
                                 f"call reserve({b}, seq_len) first")
        pos = input_pos.to(device=self.device, dtype=torch.int64)
        rows = torch.tensor(batches, dtype=torch.int64, device=self.device)
        reserved = torch.tensor([len(self._pages[b]) * self.page_size for b in batches],
                                dtype=torch.int64, device=self.device)
        bad = (pos < 0) | (pos >= reserved[:, None])
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise InputError(f"assign: input_pos[{i}, {j}] = {int(pos[i, j])} is past the reserved length "
                             f"{int(reserved[i])} of batch_idx {batches[i]}; reserve(batch_idx, "
                             f"seq_len) enough tokens first")
        pages = torch.gather(self.page_table[rows], 1, pos // self.page_size)
        addr = (pages * self.page_size + pos % self.page_size).reshape(-1).to(k_cache.device)
        if addr.numel() > 1 and torch.unique(addr).numel() != addr.numel():
            raise InputError("assign: two new tokens have one cache slot (a position repeated in "
                             "input_pos, or one sequence named twice in batch_idx with the same "
                             "position); index_copy_ keeps no defined one of two")
        # (B, H, S, D) -> (H, B * S, D), matching addr's (batch, position) order.
        k_cache[0].index_copy_(1, addr, k_val.transpose(0, 1).reshape(H, B * S, -1))
        v_cache[0].index_copy_(1, addr, v_val.transpose(0, 1).reshape(H, B * S, -1))

    # -- attention -------------------------------------------------------------------------------

    def _batch_rows(self, batch_idx, what: str) -> Tensor | None:
        """batch_idx as a device tensor of page-table rows, each checked to hold pages."""
        if batch_idx is None:
            return None
        batches = _int_list(batch_idx, "batch_idx")
        for b in batches:
            if not 0 <= b < self.max_batch_size:
                raise InputError(f"{what}: batch_idx {b} is out of range [0, {self.max_batch_size})")
            if not self._pages[b]:
                raise InputError(f"{what}: batch_idx {b} holds no pages (never reserved, or erased)")
        return torch.tensor(batches, dtype=torch.int64, device=self.device)

    def _logical_kv(self, b, physical_kv_idx, rows: Tensor | None):
        """(logical kv index clamped to >= 0, page is live) for the mods, through captured tables."""
        page = physical_kv_idx // self.page_size
        row = b if rows is None else rows[b]
        logical_block = self._p2l_flat[row * self.n_pages + page]
        live = logical_block >= 0
        logical = torch.where(live, logical_block * self.page_size + physical_kv_idx % self.page_size, 0)
        return logical, live

    def get_mask_mod(self, mask_mod: MaskMod | None, kv_len: Tensor | None = None, *,
                     batch_idx: Tensor | None = None) -> MaskMod:
        """A mask_mod over physical key positions that applies ``mask_mod`` to the logical ones.

        Physical positions not owned by the sequence are masked, and with ``kv_len`` (B,) so are
        logical positions ``>= kv_len[b]``.

        Args:
            mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` in logical positions; None keeps everything.
            kv_len: optional (B,) int tensor of valid lengths.
            batch_idx: optional (B,) tensor mapping the mask's batch ``b`` to the page-table row
                (default: ``b`` is the row itself).

        Example:
            >>> bm = create_block_mask(paged.get_mask_mod(causal), B, None, 1, n_pages * page_size,
            ...                        BLOCK_SIZE=page_size)
        """
        _check_wrapped(mask_mod, kv_len, "get_mask_mod", "mask_mod", "(b, h, q_idx, kv_idx) -> bool")
        return self._wrap_mask(mask_mod, kv_len, self._batch_rows(batch_idx, "get_mask_mod"))

    def _wrap_mask(self, mask_mod, kv_len, rows) -> MaskMod:
        name = getattr(mask_mod, "__name__", "noop") if mask_mod is not None else "noop"

        def paged_mask(b, h, q_idx, kv_idx):
            logical, keep = self._logical_kv(b, kv_idx, rows)
            if kv_len is not None:
                keep = keep & (logical < kv_len[b])
            if mask_mod is None:
                return keep
            return keep & mask_mod(b, h, q_idx, logical)

        paged_mask.__name__ = paged_mask.__qualname__ = f"paged_{name}"
        # create_block_mask attaches the page table's guard to the masks it builds from this mod.
        paged_mask._flexcore_guard_factory = functools.partial(
            self._guard, None if rows is None else rows.tolist())
        return paged_mask

    def get_score_mod(self, score_mod: ScoreMod | None, kv_len: Tensor | None = None, *,
                      batch_idx: Tensor | None = None) -> ScoreMod:
        """A score_mod over physical key positions that applies ``score_mod`` to the logical ones.

        Scores at positions the sequence does not own (or past ``kv_len``) become -inf. With no
        score_mod and no kv_len the result is the identity: the BlockMask from
        :meth:`convert_logical_block_mask` already lists only the sequence's own pages, so
        nothing needs translating and the kernels keep their fast path.

        Args:
            score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` in logical positions, or None.
            kv_len, batch_idx: as in :meth:`get_mask_mod`.
        """
        _check_wrapped(score_mod, kv_len, "get_score_mod", "score_mod",
                       "(score, b, h, q_idx, kv_idx) -> score")
        rows = self._batch_rows(batch_idx, "get_score_mod")
        if score_mod is None and kv_len is None:
            def paged_identity(score, b, h, q_idx, kv_idx):
                return score

            return paged_identity
        name = getattr(score_mod, "__name__", "identity") if score_mod is not None else "identity"

        def paged_score(score, b, h, q_idx, kv_idx):
            logical, keep = self._logical_kv(b, kv_idx, rows)
            if kv_len is not None:
                keep = keep & (logical < kv_len[b])
            if score_mod is not None:
                score = score_mod(score, b, h, q_idx, logical)
            return torch.where(keep, score, float("-inf"))

        paged_score.__name__ = paged_score.__qualname__ = f"paged_{name}"
        return paged_score

    def convert_logical_block_mask(self, block_mask, batch_idx: Tensor | None = None,
                                   kv_len: Tensor | None = None):
        """A BlockMask over the physical cache from one over logical positions.

        Key-block indices become physical pages, the mask_mod is wrapped with :meth:`get_mask_mod`,
        and seq_lengths become ``(Q_LEN, n_pages * page_size)``: the length of ``k_cache``. Logical
        positions at or past the mask's KV_LEN (or ``kv_len[b]``) are never attended: blocks past
        them are dropped, a full block that straddles them becomes partial, and so are blocks the
        sequence has not reserved.

        Args:
            block_mask: logical :class:`flexcore.BlockMask` whose key BLOCK_SIZE equals page_size;
                its batch is 1 or len(batch_idx).
            batch_idx: (B,) page-table rows of the mask's batches (default ``arange(B)``).
            kv_len: optional (B,) valid logical lengths (default: the mask's KV_LEN for all).

        Returns:
            BlockMask with tables (B, H, Q_BLOCKS, n_pages), listing physical pages.

        Example:
            >>> logical = create_block_mask(causal_at_pos, B, None, 1, max_len, BLOCK_SIZE=(128, 128))
            >>> physical = paged.convert_logical_block_mask(logical, batch_idx=torch.arange(B))
        """
        from flexcore.blockmask import BlockMask

        if not isinstance(block_mask, BlockMask):
            raise InputError(f"block_mask must be a flexcore.BlockMask; got {type(block_mask).__name__}")
        q_block, page = block_mask.BLOCK_SIZE
        if page != self.page_size:
            raise InputError(f"block_mask has key BLOCK_SIZE {page} but page_size is {self.page_size}: "
                             f"they must be equal. Build the logical mask with create_block_mask(..., "
                             f"BLOCK_SIZE=({q_block}, {self.page_size}))")
        Bm, H, R, C = block_mask.kv_indices.shape
        rows = self._batch_rows(torch.arange(Bm) if batch_idx is None else batch_idx,
                                "convert_logical_block_mask")
        B = rows.shape[0]
        if Bm not in (1, B):
            raise InputError(f"convert_logical_block_mask: block_mask has batch {Bm} but batch_idx has "
                             f"{B} entries; they must match (or the mask's batch be 1)")
        logical_len = block_mask.seq_lengths[1]
        if kv_len is None:
            bound = torch.full((B,), logical_len, dtype=torch.int64, device=self.device)
        else:
            if not isinstance(kv_len, Tensor) or tuple(kv_len.shape) != (B,):
                raise InputError(f"kv_len must be a ({B},) int tensor (one length per batch); got "
                                 f"{tuple(kv_len.shape) if isinstance(kv_len, Tensor) else type(kv_len).__name__}")
            bound = kv_len.to(self.device, torch.int64).clamp(max=logical_len)

        # Dense (B, H, R, C) maps of the listed logical blocks, then the physical page of each column.
        cols = torch.arange(C, device=self.device)

        def dense(num, idx):
            num = num.to(self.device).expand(B, H, R)
            idx = idx.to(self.device).expand(B, H, R, C).long()
            target = torch.where(cols < num[..., None], idx, C)  # column C is a discard slot
            out = torch.zeros(B, H, R, C + 1, dtype=torch.bool, device=self.device)
            return out.scatter_(-1, target, True)[..., :C]

        partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = (dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
                if block_mask.full_kv_num_blocks is not None else torch.zeros_like(partial))
        pages = torch.full((B, C), -1, dtype=torch.int64, device=self.device)
        width = min(C, self.n_pages)
        pages[:, :width] = self.page_table[rows, :width]  # a snapshot: convert again after reserve
        live = (pages >= 0) & (cols * page < bound[:, None])  # reserved, and starts before the bound
        whole = (cols + 1) * page <= bound[:, None]            # ends before the bound
        partial = (partial | (full & ~whole[:, None, None, :])) & live[:, None, None, :]
        full = full & (live & whole)[:, None, None, :]

        def listing(block_map):
            # Listed pages first, increasing (the BlockMask layout), padded with zeros to n_pages.
            key = torch.where(block_map, pages[:, None, None, :], self.n_pages).sort(dim=-1).values
            key = key[..., :min(C, self.n_pages)]
            idx = torch.zeros(B, H, R, self.n_pages, dtype=torch.int32, device=self.device)
            idx[..., :key.shape[-1]] = torch.where(key < self.n_pages, key, 0).to(torch.int32)
            device = block_mask.kv_indices.device
            return block_map.sum(-1).to(torch.int32).to(device), idx.to(device)

        num, idx = listing(partial)
        full_num, full_idx = listing(full) if block_mask.full_kv_num_blocks is not None else (None, None)
        identity_rows = torch.equal(rows.cpu(), torch.arange(B))
        mask_mod = self._wrap_mask(block_mask.mask_mod, bound, None if identity_rows else rows)
        lengths = (block_mask.seq_lengths[0], self.n_pages * page)
        physical = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, block_mask.BLOCK_SIZE,
                                            mask_mod, seq_lengths=lengths, compute_q_blocks=False)
        physical._add_guards((self._guard(rows.tolist()),))
        return physical


def _check_wrapped(mod, kv_len, what: str, name: str, signature: str) -> None:
    """InputError naming the argument unless ``mod`` is None or callable and ``kv_len`` None or
    an integer tensor: the wrapper would otherwise fail later, under its own name."""
    if mod is not None and not callable(mod):
        raise InputError(f"{what}: {name} must be None or a callable {signature}; got "
                         f"{type(mod).__name__}")
    if kv_len is not None and (not isinstance(kv_len, Tensor) or kv_len.is_floating_point()
                               or kv_len.dtype == torch.bool or kv_len.dim() != 1):
        got = (f"{kv_len.dtype} tensor of shape {tuple(kv_len.shape)}" if isinstance(kv_len, Tensor)
               else type(kv_len).__name__)
        raise InputError(f"{what}: kv_len must be None or a (B,) integer tensor of valid lengths; "
                         f"got {got}")
