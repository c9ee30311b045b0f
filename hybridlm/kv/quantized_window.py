"""Quantized attention sinks + window: StreamingLLM's bounded cache with KIVI's quantized history.

:class:`QuantizedSinkWindowKV` keeps

* the first ``sinks`` token slots in full precision (a handful of tokens that every query attends to heavily:
  not worth their quantization error);
* after them, the tokens still in the window as :class:`~hybridlm.kv.quantize.QuantizedKV` keeps its tokens:
  the most recent ``residual`` (to ``residual + group - 1``) in full precision, older ones quantized in groups
  of ``group`` tokens (keys per channel, values per token, packed codes plus scales and zero points);
* tokens leave a whole quantized group at a time, once no later query can see any token of the group.

``residual`` is capped at ``window - 1``: no later query sees older tokens, so keeping them in full precision
would only cost memory. Quantization saves memory only when ``window`` clearly exceeds ``residual + group``:
with the defaults ``kv_residual=128, kv_group_size=32`` and ``window=64`` nothing visible is quantized, and the
held tail (63 to 94 tokens) is larger than SinkWindowKV's 63.

Attention sees exactly what :class:`~hybridlm.kv.layouts.SinkWindowKV` gives it (the sinks and the last
``window`` slots, masked by slot; keys rotated by their position inside the cache), so with ``residual >=
window - 1`` the output equals SinkWindowKV's. Once the window is full it holds, after the sinks, the last
``window - 1`` slots plus at most ``group - 1`` older ones (of a partly visible group, or of the full-precision
tail): between ``window - 1`` and ``window + group - 2`` slots, never exactly ``window`` (eviction is by group).

Keys are stored before the rotary embedding (their position changes as the window slides), so they are
quantized before it too, and every read dequantizes then rotates: the fused decode path of
:mod:`.quantized_attention`, which reads rotated codes, does not apply.

Bytes per batch row with ``n`` token slots seen (``H`` key/value heads, ``D`` head_dim, ``e`` element size,
``b`` bits, ``g`` group, ``residual`` the capped one, ``s = min(n, sinks)``, ``m = n - s``)::

    quantized so far   Q = g * floor(max(0, m - residual) / g)
    evicted            E = g * min(Q / g, floor(max(0, n - window + 1 - sinks) / g))
    bytes              H * (Q - E) * (2 * D * b / 8 + 4 * D * e / g) + 2 * H * (s + m - Q) * D * e + 8
"""

from __future__ import annotations

import dataclasses

import torch

from ..states import _tensor_nbytes
from .base import KVView
from .layouts import sink_window_view
from .quantize import QuantizedKV


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
        sinks = [self.sink_keys[:, :, : self.held_sinks], self.sink_values[:, :, : self.held_sinks]]
        return super().nbytes() + sum(_tensor_nbytes(t) for t in sinks)

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
        view = sink_window_view(self, torch.cat(parts_k, 2), torch.cat(parts_v, 2), slots, first,
                                torch.arange(first, first + time, device=device), rotate)
        self._quantize_aged()  # after the view is taken: this forward reads its own tokens in full precision
        self._evict()
        return view

    def _quantize_aged(self) -> None:
        """QuantizedKV's ageing, except that aged groups of the tail that no later query sees leave without being
        quantized (when no quantized group is older; with ``residual`` near ``window`` every aged group does)."""
        if not self.quantized:
            aged = max(0, self.recent - self.residual) // self.group
            unseen = max(0, self.seen - self.window + 1 - self.sinks - self.evicted) // self.group
            drop = self.group * min(aged, unseen)
            if drop:  # the view handed out is a copy (torch.cat), so the tail may change under it
                self.recent_keys, self.recent_values = self.recent_keys[:, :, drop:], self.recent_values[:, :, drop:]
                self.recent -= drop
                self.evicted += drop
        super()._quantize_aged()

    def _evict(self) -> None:
        """Drop the oldest quantized groups that no later query sees."""
        tokens = self._evicted_after(self.seen, self.evicted + self.quantized) - self.evicted
        if not tokens:
            return
        blocks = tokens // self.group
        for name in ("key_codes", "value_codes", "value_scale", "value_zero"):
            setattr(self, name, getattr(self, name)[:, :, tokens:])
        self.key_scale, self.key_zero = self.key_scale[:, :, blocks:], self.key_zero[:, :, blocks:]
        self.quantized -= tokens
        self.evicted += tokens

    def rewind_blocker(self, tokens: int) -> str | None:
        """As QuantizedKV: only full-precision tokens beyond the ``residual`` kept once any were quantized; and
        no group evicted that a query after the rollback would see (so the state is what a forward that stopped
        there leaves)."""
        aged = self.quantized or self.evicted
        removable = self.recent - self.residual if aged else self.recent + self.held_sinks
        if tokens > removable:
            return (f"that is before its earliest kept checkpoint: only the last {removable} token slots are "
                    f"beyond the {self.residual} (kv_residual) kept in full precision after "
                    f"{self.quantized + self.evicted} quantized ones")
        if self._evicted_after(self.seen - tokens, self.quantized + self.evicted) < self.evicted:
            return (f"a query after it would see token slots that already left the window (window={self.window}, "
                    f"evicted in groups of {self.group})")
        return None

    def rewind(self, tokens: int) -> None:
        from_tail = min(tokens, self.recent)
        self.recent -= from_tail
        self.held_sinks -= tokens - from_tail
        if self.has_padding:
            self.padding = self.padding.clamp(max=self.seen)
