"""KV layouts of fixed size: a ring for sliding windows, attention sinks plus a window (StreamingLLM) and
heavy hitters plus a recent window (H2O). Each holds a bounded number of token slots however long generation
runs. The contiguous layout is :class:`hybridlm.cache.KVState`; the quantized one is in :mod:`.quantize`, the
quantized sinks + window in :mod:`.quantized_window`.

Sizes per batch row (``e`` the element size, ``H`` key/value heads, ``D`` head_dim), ``n`` tokens seen:

* ``RingKV``: ``2 * H * min(n, window - 1) * D * e + 8``;
* ``SinkWindowKV``: ``2 * H * min(n, sinks + window - 1) * D * e + 8``;
* ``HeavyHitterKV``: ``H * min(n, heavy + window) * (2 * D * e + 8 + 4) + 8`` (each key's slot and its
  accumulated attention mass are kept too).

Ring and sinks + window allocate their ring once; the one slot beyond what a later token can see is the slot
the next token is written into, counted by ``reserved_nbytes`` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from hybridlm.cache import rollback
from hybridlm.cache.kv.base import DenseKV, KVView, Rotate
from hybridlm.cache.kv.stepwise import is_verification_block, stepwise_view
from hybridlm.cache.states import LayerState, _tensor_nbytes


def _zeros(batch, heads, slots, dim, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values ``[batch, heads, slots, dim]`` and the padding counter ``[batch]``."""
    shape = (batch, heads, slots, dim)
    return (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(batch, dtype=torch.long, device=device))


class _FixedKV(DenseKV):
    """A dense layout with a fixed number of slots (the layouts below)."""

    def _held_nbytes(self, slots: int) -> int:
        batch, heads, _, dim = self.keys.shape
        return batch * 2 * heads * slots * dim * self.keys.element_size() + _tensor_nbytes(self.padding)


@dataclasses.dataclass
class _WindowKV(_FixedKV):
    """A ring of the last ``window`` slots after ``pinned`` slots that never leave (attention sinks; none for a
    plain ring): slot ``s >= pinned`` lives at :meth:`_index` until ``window`` later slots push it out.

    Rolling back ``n`` slots needs the ``n - 1`` slots that the last ``n`` pushed out (the ring holds one slot
    more than a token sees). They are kept in ``spilled_keys, spilled_values [batch, heads, kept, head_dim]``
    (the slots just before the ring's oldest, as the buffer holds them) for the forward that pushed them out
    when it had 2 to 64 tokens on a warm cache, or for the last ``spill_limit`` slots across forwards once
    :meth:`keep_checkpoints` asked; ``reserved_nbytes`` counts them."""

    spilled_keys: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)
    spilled_values: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)
    spill_limit: int = dataclasses.field(default=0, kw_only=True)
    croppable = True

    @property
    def pinned(self) -> int:
        return 0

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        """Buffer index of each absolute slot: pinned slots first, then the ring."""
        pinned = self.pinned
        return torch.where(slots < pinned, slots, pinned + (slots - pinned) % self.window)

    def _pushed_out(self, seen: int) -> int:
        """The slots before this one have left the ring once ``seen`` slots were seen (pinned ones excepted)."""
        return max(self.pinned, seen - self.window)

    def keep_checkpoints(self, tokens: int) -> None:
        self.spill_limit, self.spilled_keys, self.spilled_values = tokens, None, None

    def _spill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Before new ``keys, values [batch, heads, time, head_dim]`` (as the buffer stores them) are written:
        keep the slots this forward pushes out of the ring, when rollback needs them."""
        first, time = self.seen, keys.shape[2]
        limit = self.spill_limit or (time if first and 1 < time <= rollback.AUTO_CHECKPOINT_TOKENS else 0)
        if not limit:
            self.spilled_keys = self.spilled_values = None
            return
        start, stop = self._pushed_out(first), self._pushed_out(first + time)
        held = self.spilled_keys is not None and self.spill_limit
        parts_k = [self.spilled_keys] if held else []
        parts_v = [self.spilled_values] if held else []
        if start < min(stop, first):  # pushed out of the buffer
            index = self._index(torch.arange(start, min(stop, first), device=keys.device))
            parts_k.append(self.keys.index_select(2, index))
            parts_v.append(self.values.index_select(2, index))
        if max(start, first) < stop:  # new slots that never enter the ring
            parts_k.append(keys[:, :, max(start, first) - first : stop - first])
            parts_v.append(values[:, :, max(start, first) - first : stop - first])
        empty = keys[:, :, :0]
        self.spilled_keys = torch.cat([empty, *parts_k], 2)[:, :, -limit:]
        self.spilled_values = torch.cat([values[:, :, :0], *parts_v], 2)[:, :, -limit:]

    def rewind_blocker(self, tokens: int) -> str | None:
        end, oldest = self._pushed_out(self.seen), max(self.pinned, self.seen - tokens - self.window + 1)
        # the spill (the slots just before ``end``) must reach back to the oldest slot a later query sees, unless
        # the crop goes back before every pushed-out slot
        needed = end - oldest if oldest < min(end, self.seen - tokens) else 0
        kept = 0 if self.spilled_keys is None else self.spilled_keys.shape[2]
        if needed <= kept:
            return None
        return (f"that is before its earliest kept checkpoint: it needs {needed} slots that left the window, "
                f"{kept} kept (HybridCache.keep_checkpoints(n) keeps them across forwards)")

    def rewind(self, tokens: int) -> None:
        """Put the slots that left the ring since back from the spill; forget the last ``tokens`` slots."""
        end, kept = self._pushed_out(self.seen), 0 if self.spilled_keys is None else self.spilled_keys.shape[2]
        self.seen -= tokens
        new_end = self._pushed_out(self.seen)
        first, last = max(new_end, end - kept), min(end, self.seen)  # slots back in the ring: [first, last)
        if first < end:
            if first < last:  # (none when the crop reaches back before them: they are forgotten too)
                index = self._index(torch.arange(first, last, device=self.keys.device))
                self.keys.index_copy_(2, index, self.spilled_keys[:, :, first - end + kept : last - end + kept])
                self.values.index_copy_(2, index, self.spilled_values[:, :, first - end + kept : last - end + kept])
            self.spilled_keys = self.spilled_keys[:, :, : first - end + kept]
            self.spilled_values = self.spilled_values[:, :, : first - end + kept]
        if self.has_padding:
            self.padding = self.padding.clamp(max=self.seen)


@dataclasses.dataclass
class RingKV(_WindowKV):
    """A sliding window of ``window`` slots (each token sees itself and the ``window - 1`` before it), written
    in place into a ring: slot ``s`` lives at index ``s % window``. Decoding allocates and copies nothing; a
    multi-token chunk attends over the held window followed by its own keys, then writes its last ``window``
    keys into the ring. Keys are stored rotated."""

    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor
    window: int
    seen: int = 0
    has_padding: bool = False

    kept_under_policy = "a layer's own sliding window is bounded already, and no policy may let it see beyond it"

    @classmethod
    def empty(cls, batch_size, kv_heads, head_dim, *, window, device=None, dtype=None) -> RingKV:
        return cls(*_zeros(batch_size, kv_heads, window, head_dim, device, dtype), window=window)

    @property
    def length(self) -> int:
        """Slots a later token can see: the last ``window - 1``."""
        return min(self.seen, self.window - 1)

    @property
    def start(self) -> int:
        """Absolute slot of the oldest slot a later token can see."""
        return self.seen - self.length

    def nbytes(self) -> int:
        return self._held_nbytes(self.length)

    def reserved_nbytes(self) -> int:
        return LayerState.nbytes(self)

    def predicted_nbytes(self, tokens: int) -> int:
        return self._held_nbytes(min(tokens, self.window - 1))

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        first, time, window = self.seen, keys.shape[2], self.window
        if rotate is not None:
            keys = rotate(keys, positions)
        self._count_padding(mask)
        self._spill(keys, values)
        if time == 1:  # in place: the new slot replaces the one that just left the window
            self.keys[:, :, first % window] = keys[:, :, 0]
            self.values[:, :, first % window] = values[:, :, 0]
            self.seen += 1
            held = min(self.seen, window)
            index = torch.arange(held, device=keys.device)
            slots = self.seen - 1 - (self.seen - 1 - index) % window  # [held]: the newest slot at each index
            view_keys, view_values = self.keys[:, :, :held], self.values[:, :, :held]
        else:
            held = min(first, window - 1)
            slots = torch.arange(first - held, first + time, device=keys.device)
            order = slots[:held] % window
            view_keys = torch.cat([self.keys.index_select(2, order), keys], dim=2)  # [b, h, held + t, d]
            view_values = torch.cat([self.values.index_select(2, order), values], dim=2)
            kept = min(time, window)
            index = slots[-kept:] % window
            self.keys.index_copy_(2, index, keys[:, :, -kept:])
            self.values.index_copy_(2, index, values[:, :, -kept:])
            self.seen += time
        return KVView(view_keys, view_values, slots, self._validity(slots),
                      query_slots=torch.arange(first, first + time, device=keys.device), query_positions=positions,
                      window=window)


@dataclasses.dataclass
class SinkWindowKV(_WindowKV):
    """StreamingLLM: the first ``sinks`` slots (attention sinks) and a ring of the last ``window``.

    Keys are stored before the rotary embedding and rotated on every read by their position *inside the
    cache*: sinks at ``0..sinks-1``, the window after them without a gap. So positions never exceed
    ``sinks + window - 1`` however long generation runs. While at most ``sinks + window`` tokens have been seen
    nothing is dropped and the positions are the model's own, so the output equals full attention. In a
    multi-token chunk past the window, the chunk's later tokens see positions up to ``sinks + window + chunk``
    (decode one token at a time to stay within ``sinks + window``). With left padding, padding slots count
    among the sinks."""

    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor
    sinks: int
    window: int
    seen: int = 0
    has_padding: bool = False

    chunk_dependent = True

    @classmethod
    def empty(cls, batch_size, kv_heads, head_dim, *, sinks, window, device=None, dtype=None) -> SinkWindowKV:
        return cls(*_zeros(batch_size, kv_heads, sinks + window, head_dim, device, dtype), sinks=sinks,
                   window=window)

    @property
    def length(self) -> int:
        return min(self.seen, self.sinks + self.window - 1)

    def nbytes(self) -> int:
        return self._held_nbytes(self.length)

    def reserved_nbytes(self) -> int:
        return LayerState.nbytes(self)

    def predicted_nbytes(self, tokens: int) -> int:
        return self._held_nbytes(min(tokens, self.sinks + self.window - 1))

    @property
    def pinned(self) -> int:
        return self.sinks

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        first, time, sinks, window = self.seen, keys.shape[2], self.sinks, self.window
        self._count_padding(mask)
        self._spill(keys, values)
        new_slots = torch.arange(first, first + time, device=keys.device)
        if time == 1:  # in place, as in RingKV
            index = first if first < sinks else sinks + (first - sinks) % window
            self.keys[:, :, index], self.values[:, :, index] = keys[:, :, 0], values[:, :, 0]
            self.seen += 1
            ring = min(max(self.seen - sinks, 0), window)
            index = torch.arange(sinks, sinks + ring, device=keys.device)
            ring_slots = self.seen - 1 - (self.seen - 1 - index) % window  # [ring]
            slots = torch.cat([torch.arange(min(self.seen, sinks), device=keys.device), ring_slots])
            raw_keys, view_values = self.keys[:, :, : slots.shape[0]], self.values[:, :, : slots.shape[0]]
        else:
            oldest = max(sinks, first - window + 1)  # of the ring's held slots
            held_slots = torch.cat([torch.arange(min(first, sinks), device=keys.device),
                                    torch.arange(oldest, max(oldest, first), device=keys.device)])
            slots = torch.cat([held_slots, new_slots])
            order = self._index(held_slots)
            raw_keys = torch.cat([self.keys.index_select(2, order), keys], dim=2)  # [b, h, held + t, d]
            view_values = torch.cat([self.values.index_select(2, order), values], dim=2)
            kept = (new_slots < sinks) | (new_slots >= first + time - window)
            self.keys.index_copy_(2, self._index(new_slots[kept]), keys[:, :, kept])
            self.values.index_copy_(2, self._index(new_slots[kept]), values[:, :, kept])
            self.seen += time
        view = sink_window_view(self, raw_keys, view_values, slots, first, new_slots, rotate)
        requery = sink_step_rotation(self, first, new_slots, rotate) if is_verification_block(first, time) else None
        return view if requery is None else stepwise_view(view, sink_query=requery)  # see hybridlm.cache.kv.stepwise


def sink_window_view(state, raw_keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, first: int,
                     new_slots: torch.Tensor, rotate) -> KVView:
    """The view of a sinks + window layout (``state.sinks``, ``state.window``, ``state.padding``): the held
    ``raw_keys`` (not rotated) and ``values [batch, heads, n, head_dim]`` at absolute ``slots [n]``, the new
    tokens at ``new_slots [time]`` from slot ``first``. Keys and queries are rotated by their position inside
    the cache: slots after the sinks move down past the slots dropped before this forward's first token, and
    each row counts from its first real token. Shared by SinkWindowKV and QuantizedSinkWindowKV."""
    sinks, window = state.sinks, state.window
    shift = max(0, first - (window - 1) - sinks)  # slots dropped between the sinks and the window
    key_positions = in_cache_positions(state, torch.where(slots < sinks, slots, slots - shift), shift)
    keys = rotate(raw_keys, key_positions) if rotate is not None else raw_keys
    return KVView(keys, values, slots, state._validity(slots), query_slots=new_slots,
                  query_positions=in_cache_positions(state, new_slots - shift, shift), window=window,
                  pinned=(slots < sinks).view(1, 1, -1))


def in_cache_positions(state, positions: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
    """``positions [n]`` (slots, those after the sinks moved down by ``shift``: an int or one per position) ->
    ``[batch, n]`` counted from each row's first real token: less the padding slots still held (the padding
    beyond the sinks leaves with the slots dropped; padding positions themselves clamp to 0)."""
    padding = state.padding[:, None]  # [batch, 1]
    shift = torch.as_tensor(shift, device=positions.device)
    held_padding = padding - torch.minimum(shift, (padding - state.sinks).clamp(min=0))  # [batch, 1 or n]
    return (positions[None, :] - held_padding).clamp(min=0)


Rotation = Callable[[torch.Tensor], torch.Tensor]


def sink_step_rotation(state, first: int, new_slots: torch.Tensor, rotate: Rotate | None) -> Rotation | None:
    """For a sinks + window layout (``state.sinks``, ``state.window``, ``state.padding``) and a block of queries
    at ``new_slots [time]`` from slot ``first``: the function that rotates the block's queries (at the positions
    :func:`sink_window_view` gave them) on to the positions their own decode steps give them, or None
    where these agree (no sinks, no rotary embedding, or nothing dropped yet)."""
    if rotate is None or not state.sinks:
        return None
    step_shift = (new_slots - (state.window - 1) - state.sinks).clamp(min=0)  # each query's own decode step
    block_shift = max(0, first - (state.window - 1) - state.sinks)
    delta = in_cache_positions(state, new_slots - step_shift, step_shift) - \
        in_cache_positions(state, new_slots - block_shift, block_shift)  # [batch, time]
    if not bool(delta.any()):
        return None
    return lambda q: rotate(q, delta)  # rotations compose: R(a) R(b) = R(a + b)


@dataclasses.dataclass
class HeavyHitterKV(_FixedKV):
    """H2O: the ``heavy`` keys with the largest accumulated attention mass plus the ``window`` most recent,
    per row and key/value head. Each forward attends over the held keys and the new ones, adds the attention
    probabilities it gets to each key's mass (:meth:`observe`; summed over the query heads of the group and the
    new queries), then drops the lightest keys beyond ``heavy + window``. While at most ``heavy + window``
    tokens have been seen nothing is dropped, so the output equals full attention. Keys are stored rotated.

    ``keys, values [batch, heads, held, head_dim]``, ``slots [batch, heads, held]`` (absolute slot of each
    key), ``mass [batch, heads, held]`` (fp32)."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    mass: torch.Tensor
    padding: torch.Tensor
    heavy: int
    window: int
    seen: int = 0
    has_padding: bool = False

    needs_attention_probs = True
    chunk_dependent = True

    def rewind_blocker(self, tokens: int) -> str | None:
        return ("H2O (heavy hitters) cannot roll back: the dropped queries' attention mass is summed into every "
                "kept key and evicted keys are gone")

    @classmethod
    def empty(cls, batch_size, kv_heads, head_dim, *, heavy, window, device=None, dtype=None) -> HeavyHitterKV:
        keys, values, padding = _zeros(batch_size, kv_heads, 0, head_dim, device, dtype)
        return cls(keys, values, torch.zeros(batch_size, kv_heads, 0, dtype=torch.long, device=device),
                   torch.zeros(batch_size, kv_heads, 0, device=device), padding, heavy=heavy, window=window)

    @property
    def capacity(self) -> int:
        return self.heavy + self.window

    def predicted_nbytes(self, tokens: int) -> int:
        batch, heads, _, dim = self.keys.shape
        held = min(tokens, self.capacity)
        per_slot = 2 * dim * self.keys.element_size() + self.slots.element_size() + self.mass.element_size()
        return batch * (heads * held * per_slot + self.padding.element_size())

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        first, (batch, heads, time, _) = self.seen, keys.shape
        if rotate is not None:
            keys = rotate(keys, positions)
        self._count_padding(mask)
        new_slots = torch.arange(first, first + time, device=keys.device)
        self.keys = torch.cat([self.keys, keys], dim=2)  # [b, h, held + t, d]
        self.values = torch.cat([self.values, values], dim=2)
        self.slots = torch.cat([self.slots, new_slots.expand(batch, heads, time)], dim=2)
        self.mass = torch.cat([self.mass, self.mass.new_zeros(batch, heads, time)], dim=2)
        self.seen += time
        return KVView(self.keys, self.values, self.slots, self._validity(self.slots), query_slots=new_slots,
                      query_positions=positions)

    def observe(self, probs: torch.Tensor) -> None:
        batch, q_heads, time, held = probs.shape
        heads = self.keys.shape[1]
        self.mass = self.mass + probs.view(batch, heads, q_heads // heads, time, held).sum((2, 3))
        if held > self.capacity:
            self._evict()

    def _evict(self) -> None:
        """Keep the recent window and the heaviest of the rest (padding ranks below every real key)."""
        recent = self.slots >= self.seen - self.window
        valid = self._validity(self.slots)
        rank = self.mass if valid is None else self.mass.masked_fill(~valid, -1.0)
        rank = rank.masked_fill(recent, torch.inf)
        keep = rank.topk(self.capacity, dim=-1).indices.sort(dim=-1).values  # [b, h, capacity]
        wide = keep[..., None].expand(-1, -1, -1, self.keys.shape[3])
        self.keys, self.values = self.keys.gather(2, wide), self.values.gather(2, wide)
        self.slots, self.mass = self.slots.gather(2, keep), self.mass.gather(2, keep)
