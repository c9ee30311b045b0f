"""Paged KV (``CachePolicy(page_size=N)``): keys and values in fixed-size pages from one pool per layer, shared
by all rows of a cache, with a block table per row.

A row stores only its real tokens: its left padding takes no slot (the view handed to attention puts each key
back at its slot, padding slots masked). Rows made by :meth:`PagedKV.select` from one row (``n`` samples of a
prompt, beam expansion) share that row's pages through reference counts; a row appending into a shared page
that still has room copies that page first (copy-on-write), so a shared page never changes.

Bytes held: ``P * 2 * H * page_size * D * e + 4 * T + 8 * batch`` for ``P`` distinct pages in use, ``T``
block-table entries (int32, what the decode kernel reads) and the int64 padding counters. Without sharing or
padding, a row with ``n`` tokens holds ``ceil(n / page_size)`` pages. Block tables, reference counts and the
free list are host-side lists, so appending and decoding read no tensor back; :meth:`select` reads its index.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from hybridlm import ops
from hybridlm.cache.kv.base import DenseKV, KVView
from hybridlm.cache.states import LayerState, _tensor_nbytes
from hybridlm.ops import backends

TABLE_ENTRY_BYTES = 4  # int32 block-table entries


@dataclasses.dataclass
class PagedKV(DenseKV):
    """``keys``, ``values [kv_heads, pool pages, page_size, head_dim]`` (the pool: pages in use and free pages;
    heads first, so that gathering a row's pages leaves each head's keys one dense ``[slots, head_dim]`` block),
    ``padding [batch]``; ``tables[b]`` the pages of row ``b`` in token order (its real tokens only), ``refs[p]``
    the rows using page ``p``, ``free`` the unused pages; ``pads[b]`` the host copy of ``padding``. Keys are
    stored rotated."""

    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor
    page_size: int
    tables: list[list[int]]
    pads: list[int]
    refs: list[int]
    free: list[int]
    seen: int = 0
    has_padding: bool = False

    @classmethod
    def empty(cls, batch_size, kv_heads, head_dim, *, page_size, capacity=0, device=None, dtype=None) -> PagedKV:
        """A pool of room for ``capacity`` tokens per row (grown by half when full)."""
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"PagedKV: page_size={page_size!r} must be an integer >= 1")
        pages = batch_size * math.ceil(capacity / page_size)
        shape = (kv_heads, pages, page_size, head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(batch_size, dtype=torch.long, device=device), page_size,
                   tables=[[] for _ in range(batch_size)], pads=[0] * batch_size, refs=[0] * pages,
                   free=list(range(pages - 1, -1, -1)))

    # --- sizes --------------------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of keys and values."""
        heads, _, size, dim = self.keys.shape
        return 2 * heads * size * dim * self.keys.element_size()

    def pages_in_use(self) -> int:
        return sum(1 for count in self.refs if count)

    def nbytes(self) -> int:
        return self.pages_in_use() * self.page_nbytes + self._table_nbytes() + _tensor_nbytes(self.padding)

    def reserved_nbytes(self) -> int:
        """The whole pool (free pages included), the block tables and the padding counters."""
        return LayerState.nbytes(self) + self._table_nbytes()

    def _table_nbytes(self) -> int:
        return TABLE_ENTRY_BYTES * sum(map(len, self.tables))

    def predicted_nbytes(self, tokens: int) -> int:
        """Every row holding ``tokens`` real tokens in pages of its own (no padding, no sharing)."""
        pages = math.ceil(tokens / self.page_size)
        return self.batch_size * (pages * (self.page_nbytes + TABLE_ENTRY_BYTES) + self.padding.element_size())

    # --- writing ------------------------------------------------------------------------------------------

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        first, (batch, _, time, _) = self.seen, keys.shape
        if rotate is not None:
            keys = rotate(keys, positions)
        new_pads = [0] * batch if mask is None else (~mask).sum(-1).tolist()  # left padding (model-checked)
        self._count_padding(mask)
        self._append(keys, values, new_pads)
        self.pads = [old + new for old, new in zip(self.pads, new_pads)]
        self.seen += time
        slots = torch.arange(self.seen, device=keys.device)
        view = dict(slots=slots, valid=self._validity(slots), query_slots=slots[first:], query_positions=positions,
                    in_order=True)
        if time == 1 and min(self.seen - p for p in self.pads) > 0 and self._kernel_decodes(keys.device):
            return KVView(None, None, attend=self._decode, **view)
        held_keys, held_values = self._gather(self.seen)
        return KVView(held_keys, held_values, **view)

    def _append(self, keys: torch.Tensor, values: torch.Tensor, new_pads: list[int]) -> None:
        """Write each row's new real tokens (those after its ``new_pads[b]`` padding slots) into its pages."""
        time, size = keys.shape[2], self.page_size
        copies: list[tuple[int, int]] = []  # (shared page, its private copy)
        rows, steps, pages, offsets = [], [], [], []
        for b, table in enumerate(self.tables):
            stored, count = self.seen - self.pads[b], time - new_pads[b]
            if not count:
                continue
            if stored % size and self.refs[table[-1]] > 1:  # copy-on-write of a shared page with room left
                copy = self._allocate()
                self.refs[table[-1]] -= 1
                copies.append((table[-1], copy))
                table[-1] = copy
            while len(table) * size < stored + count:
                table.append(self._allocate())
            local = torch.arange(stored, stored + count)
            rows.append(torch.full((count,), b))
            steps.append(torch.arange(new_pads[b], time))
            pages.append(torch.tensor(table)[local // size])
            offsets.append(local % size)
        device = keys.device
        if copies:
            source, target = (torch.tensor(side, device=device) for side in zip(*copies))
            self.keys[:, target], self.values[:, target] = self.keys[:, source], self.values[:, source]
        if rows:
            row, step, page, offset = (torch.cat(parts).to(device) for parts in (rows, steps, pages, offsets))
            self.keys[:, page, offset] = keys[row, :, step].transpose(0, 1)  # [kv_heads, tokens, head_dim]
            self.values[:, page, offset] = values[row, :, step].transpose(0, 1)

    def _allocate(self) -> int:
        if not self.free:
            self._grow()
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def _grow(self) -> None:
        """Half as many pages again (at least one page per row), in a new pool."""
        old = self.keys.shape[1]
        new = max(old + self.batch_size, old * 3 // 2)
        heads, _, size, dim = self.keys.shape
        self.keys, self.values = (torch.cat([t, t.new_zeros(heads, new - old, size, dim)], 1) for t in (self.keys,
                                                                                                          self.values))
        self.refs += [0] * (new - old)
        self.free += range(new - 1, old - 1, -1)

    # --- reading ------------------------------------------------------------------------------------------

    def block_table(self, device=None) -> torch.Tensor:
        """``[batch, max pages]`` int32: each row's pages, then zeros (never read: past the row's length)."""
        widest = max(map(len, self.tables), default=0) or 1
        rows = [table + [0] * (widest - len(table)) for table in self.tables]
        return torch.tensor(rows, dtype=torch.int32, device=device)

    def _gather(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, kv_heads, slots, head_dim]`` by slot, as the contiguous layout holds them:
        whole pages gathered in row order, then, for rows with padding (not stored), shifted right by it (the
        padding slots read the row's first key, which the mask hides)."""
        batch, (heads, _, size, dim), device = self.batch_size, self.keys.shape, self.keys.device
        if not self.keys.shape[1]:
            shape = (batch, heads, slots, dim)
            return self.keys.new_zeros(shape), self.values.new_zeros(shape)
        table = self.block_table(device).long()  # [b, pages]
        pages = table.shape[1]
        held = [t.index_select(1, table.flatten()).view(heads, batch, pages * size, dim).transpose(0, 1)
                for t in (self.keys, self.values)]  # [b, h, pages * size, d]
        if not any(self.pads):  # every row holds all its slots
            return held[0][:, :, :slots], held[1][:, :, :slots]
        local = (torch.arange(slots)[None, :] - torch.tensor(self.pads)[:, None]).clamp(min=0)  # [b, slots]
        index = local.to(device)[:, None, :, None].expand(batch, heads, slots, dim)
        return held[0].gather(2, index), held[1].gather(2, index)

    @staticmethod
    def _kernel_decodes(device: torch.device) -> bool:
        """Whether decode steps go to a paged attention kernel (else attention reads the gathered pages)."""
        return backends.chosen("paged_attention", device.type)[0] != "torch"

    def _decode(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """``q [batch, q_heads, 1, head_dim]`` over each row's pages, read in place by the paged kernel."""
        lengths = torch.tensor([self.seen - p for p in self.pads], device=q.device)
        return ops.paged_attention(q, self.keys.transpose(0, 1), self.values.transpose(0, 1),
                                   self.block_table(q.device), lengths, scale=scale)

    # --- rollback (HybridCache.crop) ----------------------------------------------------------------------

    croppable = True

    def rewind_blocker(self, tokens: int) -> str | None:
        return None if tokens <= self.seen else f"it has seen only {self.seen} slots"

    def rewind(self, tokens: int) -> None:
        """Forget the last ``tokens`` slots: each row gives back the pages it no longer needs (a page still
        shared stays with its other rows); padding that reached into them shrinks to what is left."""
        self.seen -= tokens
        self.pads = [min(pad, self.seen) for pad in self.pads]
        if self.has_padding:
            self.padding = self.padding.clamp(max=self.seen)
        for table, pad in zip(self.tables, self.pads):
            keep = math.ceil((self.seen - pad) / self.page_size)
            for page in table[keep:]:
                self.refs[page] -= 1
                if not self.refs[page]:
                    self.free.append(page)
            del table[keep:]

    # --- rows, copies, devices ----------------------------------------------------------------------------

    def select(self, index: torch.Tensor) -> PagedKV:
        """Rows ``index`` (repeats allowed) in a new pool holding each page they use once; repeated rows share
        their pages (copy-on-write). Reads ``index`` back to the host."""
        chosen = [int(i) for i in index.tolist()]
        tables = [self.tables[i] for i in chosen]
        uses = collections.Counter(page for table in tables for page in table)
        order = sorted(uses)
        renumber = {page: new for new, page in enumerate(order)}
        kept = torch.tensor(order, dtype=torch.long, device=self.keys.device)
        return dataclasses.replace(
            self, keys=self.keys[:, kept], values=self.values[:, kept],
            padding=self.padding.index_select(0, index.to(self.padding.device)),
            tables=[[renumber[page] for page in table] for table in tables], pads=[self.pads[i] for i in chosen],
            refs=[uses[page] for page in order], free=[])

    def _replace(self, fn) -> PagedKV:
        """``fn`` on every tensor (clone, device move), with host lists of its own."""
        return dataclasses.replace(self, keys=fn(self.keys), values=fn(self.values), padding=fn(self.padding),
                                   tables=[list(t) for t in self.tables], pads=list(self.pads),
                                   refs=list(self.refs), free=list(self.free))
