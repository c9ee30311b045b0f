"""Quantized attention sinks + window: StreamingLLM's bounded cache with KIVI's quantized history.

:class:`QuantizedSinkWindowKV` keeps

* the first ``sinks`` token slots in full precision (a handful of tokens that every query attends to heavily:
  not worth their quantization error);
* after them, the tokens still in the window as :class:`~hybridlm.cache.kv.quantize.QuantizedKV` keeps its tokens:
  the most recent ``residual`` (to ``residual + group - 1``) in full precision, older ones quantized in groups
  of ``group`` tokens (keys per channel, values per token, packed codes plus scales and zero points);
* tokens leave a whole quantized group at a time, once no later query can see any token of the group.

``residual`` is capped at ``window - 1``: no later query sees older tokens, so keeping them in full precision
would only cost memory. Quantization saves memory only when ``window`` clearly exceeds ``residual + group``:
with the defaults ``kv_residual=128, kv_group_size=32`` and ``window=64`` nothing visible is quantized, and the
held tail (63 to 94 tokens) is larger than SinkWindowKV's 63.

Attention sees exactly what :class:`~hybridlm.cache.kv.layouts.SinkWindowKV` gives it (the sinks and the last
``window`` slots, masked by slot; keys rotated by their position inside the cache), so with ``residual >=
window - 1`` the output equals SinkWindowKV's. Once the window is full it holds, after the sinks, the last
``window - 1`` slots plus at most ``group - 1`` older ones (of a partly visible group, or of the full-precision
tail): between ``window - 1`` and ``window + group - 2`` slots, never exactly ``window`` (eviction is by group).

Keys are stored before the rotary embedding (their position changes as the window slides), so they are
quantized before it too, and every read dequantizes then rotates: the fused decode path of
:mod:`.quantized_attention`, which reads rotated codes, does not apply.

Rollback (``crop``) is exact as QuantizedKV's; in addition a verification block (or ``keep_checkpoints(n)``)
keeps the quantized groups it pushes out of the window, masked out, until they can no longer be needed (they
count in ``reserved_nbytes``, not ``nbytes``), so that a crop can bring them back.

Bytes per batch row with ``n`` token slots seen (``H`` key/value heads, ``D`` head_dim, ``e`` element size,
``b`` bits, ``g`` group, ``residual`` the capped one, ``s = min(n, sinks)``, ``m = n - s``)::

    quantized so far   Q = g * floor(max(0, m - residual) / g)
    evicted            E = g * min(Q / g, floor(max(0, n - window + 1 - sinks) / g))
    bytes              H * (Q - E) * (2 * D * b / 8 + 4 * D * e / g) + 2 * H * (s + m - Q) * D * e + 8
"""

from __future__ import annotations

import dataclasses

import torch

from hybridlm.cache import rollback
from hybridlm.cache.kv.base import KVView
from hybridlm.cache.kv.layouts import sink_step_rotation, sink_window_view
from hybridlm.cache.kv.quantize import QuantizedKV
from hybridlm.cache.kv.stepwise import NEVER, is_verification_block, stepwise_view
from hybridlm.cache.states import _tensor_nbytes


@dataclasses.dataclass
class QuantizedSinkWindowKV(QuantizedKV):
    """Sinks in full precision, then QuantizedKV's storage for the held window (see the module docstring).

    ``sink_keys, sink_values [batch, heads, sinks, head_dim]`` (``held_sinks`` of them filled; keys not
    rotated); the inherited code and tail buffers hold slots ``sinks + evicted`` onwards (keys not rotated)."""

    sink_keys: torch.Tensor = dataclasses.field(kw_only=True)
    sink_values: torch.Tensor = dataclasses.field(kw_only=True)
    sinks: int = dataclasses.field(kw_only=True)
    window: int = dataclasses.field(kw_only=True)
    held_sinks: int = dataclasses.field(default=0, kw_only=True)
    evicted: int = dataclasses.field(default=0, kw_only=True)

    @classmethod
    def empty(cls, batch_size, kv_heads, head_dim, *, sinks, window, bits, group, residual, device=None,
              dtype=None) -> QuantizedSinkWindowKV:
        def zeros():
            return torch.zeros(batch_size, kv_heads, sinks, head_dim, device=device, dtype=dtype)

        return super().empty(batch_size, kv_heads, head_dim, bits=bits, group=group, residual=min(residual, window - 1),
                             device=device, dtype=dtype, sink_keys=zeros(), sink_values=zeros(), sinks=sinks,
                             window=window)

    @property
    def seen(self) -> int:
        return self.held_sinks + self.evicted + self.quantized + self.recent

    def nbytes(self) -> int:
        """Bytes of what a cache that stopped here holds (groups kept past the window only for a rollback, see
        :meth:`_evict`, count in ``reserved_nbytes``)."""
        sinks = [self.sink_keys[:, :, : self.held_sinks], self.sink_values[:, :, : self.held_sinks]]
        return super().nbytes() + sum(_tensor_nbytes(t) for t in sinks) - self._codes_nbytes(self._pending())

    def _pending(self) -> int:
        """Quantized tokens no later query sees, held until a rollback can no longer need them."""
        return self._evicted_after(self.seen, self._left()) - self.evicted

    def predicted_nbytes(self, tokens: int) -> int:
        sinks = min(tokens, self.sinks)
        quantized = self.group * (max(0, tokens - sinks - self.residual) // self.group)
        return self._formula_nbytes(quantized - self._evicted_after(tokens, quantized), tokens - quantized)

    def _evicted_after(self, seen: int, quantized: int) -> int:
        """Tokens of whole groups no later query sees, once ``seen`` slots were seen, ``quantized`` of them
        quantized in all: a group goes when its last slot is before ``seen - window + 1``."""
        visible_from = seen - self.window + 1
        return self.group * min(quantized // self.group, max(0, visible_from - self.sinks) // self.group)

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        first, time, device = self.seen, keys.shape[2], keys.device
        self._count_padding(mask)
        limit = self._begin_spill(time)
        to_sinks = min(time, self.sinks - self.held_sinks)
        if to_sinks:
            self.sink_keys[:, :, self.held_sinks : self.held_sinks + to_sinks] = keys[:, :, :to_sinks]
            self.sink_values[:, :, self.held_sinks : self.held_sinks + to_sinks] = values[:, :, :to_sinks]
            self.held_sinks += to_sinks
        if time > to_sinks:
            self._append_recent(keys[:, :, to_sinks:], values[:, :, to_sinks:])
        parts_k = [self.sink_keys[:, :, : self.held_sinks]]
        parts_v = [self.sink_values[:, :, : self.held_sinks]]
        if self.quantized:
            old_keys, old_values = self.dequantized()
            parts_k.append(old_keys)
            parts_v.append(old_values)
        parts_k.append(self.recent_keys[:, :, : self.recent])
        parts_v.append(self.recent_values[:, :, : self.recent])
        slots = torch.cat([torch.arange(self.held_sinks, device=device),
                           torch.arange(self.sinks + self.evicted, max(self.seen, self.sinks), device=device)])
        copies, tail_start = self._step_copies(first, time), self._tail_start()
        held = slots
        if copies is not None:  # a verification block: see QuantizedKV.update
            parts_k.append(copies[0])
            parts_v.append(copies[1])
            slots = torch.cat([slots, copies[2]])
        new_slots = torch.arange(first, first + time, device=device)
        view = sink_window_view(self, torch.cat(parts_k, 2), torch.cat(parts_v, 2), slots, first, new_slots, rotate)
        self._age(limit)  # after the view is taken: this forward reads its own tokens in full precision
        if not is_verification_block(first, time):
            return view
        requery = sink_step_rotation(self, first, new_slots, rotate)
        if copies is None and requery is None:
            return view
        visible_from, visible_until = slots, torch.full_like(slots, NEVER)
        if copies is not None:
            tail = held >= tail_start
            visible_from = torch.cat([held, self._quantized_from(copies[2])])
            visible_until[: held.shape[0]][tail] = self._quantized_from(held[tail])
        return stepwise_view(view, visible_from, visible_until, requery)

    def _offset(self) -> int:
        return self.sinks

    def _left(self) -> int:
        return self.evicted + self.quantized

    def _offset_after(self, seen: int) -> int:
        return min(seen, self.sinks)

    def _rewind_offset(self, seen: int) -> None:
        self.held_sinks = min(self.held_sinks, seen)

    def _age(self, limit: int) -> None:
        """QuantizedKV's ageing, then eviction; both leave what undoing ``limit`` slots needs (groups a query
        after such a rollback would see again stay, masked out by the window until then)."""
        horizon = max(0, self.seen - limit)
        self._drop_unseen(horizon)
        self._quantize_aged()
        self._evict(horizon)
        self._trim_spill(limit)

    def _drop_unseen(self, horizon: int) -> None:
        """Before QuantizedKV's ageing: aged groups of the tail that no query from slot ``horizon`` on sees leave
        without being quantized (when no quantized group is older; with ``residual`` near ``window`` every aged
        group does)."""
        if not self.quantized:
            visible_from = horizon - self.window + 1
            aged = max(0, self.recent - self.residual) // self.group
            unseen = max(0, visible_from - self.sinks - self.evicted) // self.group
            drop = self.group * min(aged, unseen)
            if drop:  # the view handed out is a copy (torch.cat), so the tail may change under it
                self._spill(self.recent_keys[:, :, :drop], self.recent_values[:, :, :drop])
                self.recent_keys, self.recent_values = (t[:, :, drop:].clone() for t in (self.recent_keys,
                                                                                         self.recent_values))
                self.recent -= drop
                self.evicted += drop

    def _evict(self, horizon: int) -> None:
        """Drop the oldest quantized groups that no query from slot ``horizon`` on sees. The buffers kept are
        copies, not views: a later forward writes into them in place, perhaps in another grad mode."""
        tokens = self._evicted_after(horizon, self._left()) - self.evicted
        if tokens <= 0:
            return
        blocks = tokens // self.group
        for name in ("key_codes", "value_codes", "value_scale", "value_zero"):
            setattr(self, name, getattr(self, name)[:, :, tokens:].clone())
        self.key_scale, self.key_zero = self.key_scale[:, :, blocks:].clone(), self.key_zero[:, :, blocks:].clone()
        self.quantized -= tokens
        self.evicted += tokens

    def rewind_blocker(self, tokens: int) -> str | None:
        """As QuantizedKV (groups quantized since the crop point go back to full precision from the spill), and
        no group evicted that a query after the rollback would see (so the state is what a forward that stopped
        there leaves)."""
        if self._evicted_after(self.seen - tokens, self._left()) < self.evicted:
            return (f"a query after it would see token slots that already left the window (window={self.window}, "
                    f"evicted in groups of {self.group}; a forward of 2 to {rollback.AUTO_CHECKPOINT_TOKENS} tokens "
                    "on a warm cache keeps them until the next forward, HybridCache.keep_checkpoints(n) across "
                    "forwards)")
        return super().rewind_blocker(tokens)
