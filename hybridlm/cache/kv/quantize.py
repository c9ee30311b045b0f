"""Quantized KV (KIVI): keys per channel, values per token, asymmetric, in groups, packed into bytes.

Keys vary most across channels (a few outlier channels), values across tokens, hence KIVI's two directions:

* keys: one scale and zero point per channel and per block of ``group`` tokens;
* values: one scale and zero point per token and per group of ``group`` channels.

The most recent tokens stay in full precision (at least ``residual``, fewer than ``residual + group``); once
``group`` tokens beyond ``residual`` have accumulated, the oldest ``group`` are quantized together. Codes are
packed along the channels: one int8, two int4 or four int2 per byte. Multi-token reads dequantize (the reference
path); one-token decode steps attend from the codes directly (:mod:`.quantized_attention`).

Which tokens are codes depends only on how many were seen (groups are aligned to slot 0 and quantized once
``residual`` newer tokens follow), never on how the forwards were split; so a crop can return exactly to what a
cache that stopped there holds: the groups quantized since go (their scales came from tokens being dropped, or
from tokens the shorter cache has not quantized yet) and their tokens come back to the full-precision tail from
copies kept as they were quantized (:meth:`QuantizedKV.rewind`). A verification block reads each of its tokens as
its own decode step would (:mod:`.stepwise`).

Bytes per batch row with ``n`` tokens seen, ``q = group * floor(max(0, n - residual) / group)`` of them
quantized (``H`` key/value heads, ``D`` head_dim, ``e`` element size of the model dtype, ``b`` bits)::

    H * q * (2 * D * b / 8 + 4 * D * e / group) + 2 * H * (n - q) * D * e + 8
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from hybridlm.cache import rollback
from hybridlm.cache.kv.base import KVLayout, KVView
from hybridlm.cache.kv.quantized_attention import QuantizedHistory
from hybridlm.cache.kv.stepwise import NEVER, is_verification_block, stepwise_view
from hybridlm.cache.states import _tensor_nbytes

BITS = (2, 4, 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., n]`` (uint8, each < 2**bits) -> ``[..., m]`` uint8 with ``m = n * bits / 8``, in planes:
    bits ``i * bits .. (i + 1) * bits - 1`` of byte ``j`` hold element ``i * m + j``, so that each plane is a
    contiguous range of channels (what decode reads without interleaving, see :mod:`.quantized_attention`)."""
    if bits == 8:
        return codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)[:, None]  # [per_byte, 1]
    planes = codes.view(*codes.shape[:-1], 8 // bits, -1)  # [..., per_byte, m]
    return (planes << shifts).sum(-2, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., m]`` uint8 -> ``[..., m * 8 / bits]`` codes."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)[:, None]
    return ((packed[..., None, :] >> shifts) & (2**bits - 1)).flatten(-2)  # [..., per_byte, m] -> [..., n]


def quantize(x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of ``x`` with one scale and zero point per slice along ``dim``: codes (uint8,
    same shape), and ``scale, zero`` with ``dim`` kept as size 1. ``x ~= codes * scale + zero``, off by at most
    ``scale / 2`` (plus rounding of the arithmetic). ``valid`` (None, or bool broadcastable to ``x``): only these
    entries set a slice's range (padding must not change a row's codes); a slice with none gets scale and zero 0,
    and the codes of the others are clamped into the range."""
    if valid is None:
        low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    else:
        some = valid.any(dim, keepdim=True)
        low = x.masked_fill(~valid, torch.inf).amin(dim, keepdim=True).where(some, 0.0)
        high = x.masked_fill(~valid, -torch.inf).amax(dim, keepdim=True).where(some, 0.0)
    scale = (high - low) / (2**bits - 1)
    codes = ((x - low) / scale.clamp_min(torch.finfo(x.dtype).tiny)).round().clamp_(0, 2**bits - 1)
    return codes.to(torch.uint8), scale, low


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.to(scale.dtype) * scale + zero


def quantize_groups(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int,
                    valid: torch.Tensor | None = None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """KIVI's two directions over ``keys, values [batch, heads, n, head_dim]`` (``n`` whole groups of tokens):
    ``(codes [b, h, n / group, group, d], scale, zero [b, h, n / group, 1, d])`` of the keys per channel over
    blocks of tokens, ``(codes [b, h, n, d / group, group], scale, zero [b, h, n, d / group, 1])`` of the values
    per token over groups of channels. ``valid [batch, 1, n]`` (None: all): the tokens that set a key block's
    range; a value group is one token's own."""
    batch, heads, n, dim = keys.shape
    blocks = (batch, heads, n // group, group, dim)
    key_valid = None if valid is None else valid.reshape(batch, 1, n // group, group, 1)
    return (quantize(keys.reshape(blocks), bits, 3, key_valid),
            quantize(values.reshape(batch, heads, n, dim // group, group), bits, 4))


def roundtrip(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int,
              valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys, values [batch, heads, n, head_dim]`` (``n`` whole groups of tokens) quantized as KIVI quantizes
    them (``valid``: see :func:`quantize_groups`) and dequantized: what reading them from codes gives."""
    key_parts, value_parts = quantize_groups(keys, values, bits, group, valid)
    return dequantize(*key_parts).view(keys.shape), dequantize(*value_parts).view(values.shape)


def _grown(buffer: torch.Tensor, used: int, needed: int) -> torch.Tensor:
    """``buffer`` (dim 2 the token dim) with room for ``needed``, growing by half at least."""
    if needed <= buffer.shape[2]:
        return buffer
    capacity = max(needed, buffer.shape[2] * 3 // 2)
    grown = buffer.new_zeros(*buffer.shape[:2], capacity, *buffer.shape[3:])
    grown[:, :, :used] = buffer[:, :, :used]
    return grown


@dataclasses.dataclass
class QuantizedKV(KVLayout):
    """KIVI storage (see the module docstring). Keys are stored rotated, quantized after the rotation.

    ``key_codes, value_codes [batch, heads, capacity, head_dim * bits / 8]`` (uint8); ``key_scale, key_zero
    [batch, heads, capacity / group, head_dim]``; ``value_scale, value_zero [batch, heads, capacity,
    head_dim / group]``; ``recent_keys, recent_values [batch, heads, room, head_dim]`` the full-precision tail,
    of which ``recent`` slots are used; ``quantized`` tokens are held as codes."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    padding: torch.Tensor
    bits: int
    group: int
    residual: int
    quantized: int = 0
    recent: int = 0
    has_padding: bool = False
    #: full-precision copies ``[batch, heads, kept, head_dim]`` of the last ``kept`` tokens that left the tail (the
    #: tokens just before it), what :meth:`rewind` restores; kept as the window layouts keep their pushed-out slots
    spilled_keys: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)
    spilled_values: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)
    spill_limit: int = dataclasses.field(default=0, kw_only=True)
    #: one-token decode steps attend straight from the codes (:mod:`.quantized_attention`); False: the
    #: reference path (dequantize the history, then attention), for tests and benchmarks
    fused_decode: ClassVar[bool] = True
    chunk_dependent = True

    @classmethod
    def empty(cls, batch_size, kv_heads, head_dim, *, bits, group, residual, device=None, dtype=None, **fields):
        """An empty state; ``fields``: a subclass's own fields."""
        def zeros(*shape, dtype=dtype):
            return torch.zeros(batch_size, kv_heads, *shape, device=device, dtype=dtype)

        packed = head_dim * bits // 8
        return cls(zeros(0, packed, dtype=torch.uint8), zeros(0, head_dim), zeros(0, head_dim),
                   zeros(0, packed, dtype=torch.uint8), zeros(0, head_dim // group), zeros(0, head_dim // group),
                   zeros(residual + group, head_dim), zeros(residual + group, head_dim),
                   torch.zeros(batch_size, dtype=torch.long, device=device), bits=bits, group=group,
                   residual=residual, **fields)

    @property
    def kv_heads(self) -> int:
        return self.recent_keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.recent_keys.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.recent_keys.dtype

    @property
    def seen(self) -> int:
        return self.quantized + self.recent

    def nbytes(self) -> int:
        q, blocks, r = self.quantized, self.quantized // self.group, self.recent
        used = [self.key_codes[:, :, :q], self.value_codes[:, :, :q], self.key_scale[:, :, :blocks],
                self.key_zero[:, :, :blocks], self.value_scale[:, :, :q], self.value_zero[:, :, :q],
                self.recent_keys[:, :, :r], self.recent_values[:, :, :r], self.padding]
        return sum(_tensor_nbytes(t) for t in used)

    def predicted_nbytes(self, tokens: int) -> int:
        quantized = self.group * (max(0, tokens - self.residual) // self.group)
        return self._formula_nbytes(quantized, tokens - quantized)

    def _formula_nbytes(self, quantized: int, dense: int) -> int:
        """The module docstring's bytes for ``quantized`` tokens held as codes and ``dense`` in full precision."""
        batch, heads, _, dim = self.recent_keys.shape
        e = self.recent_keys.element_size()
        per_quantized = 2 * dim * self.bits // 8 + 4 * dim * e // self.group
        return batch * (heads * quantized * per_quantized + 2 * heads * dense * dim * e + self.padding.element_size())

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        first, time = self.seen, keys.shape[2]
        if rotate is not None:
            keys = rotate(keys, positions)
        self._count_padding(mask)
        limit = self._begin_spill(time)
        self._append_recent(keys, values)
        slots = torch.arange(self.seen, device=keys.device)
        view = dict(slots=slots, valid=self._validity(slots), query_slots=slots[first:], query_positions=positions,
                    in_order=True)
        if time == 1 and self.quantized and self.fused_decode:
            history = self.history(view["valid"])
            self._age(limit)  # after the history is taken: this step reads its own token in full precision
            return KVView(None, None, attend=history.attend, **view)
        view_keys, view_values = self.recent_keys[:, :, : self.recent], self.recent_values[:, :, : self.recent]
        if self.quantized:
            old_keys, old_values = self.dequantized()
            view_keys, view_values = torch.cat([old_keys, view_keys], 2), torch.cat([old_values, view_values], 2)
        copies, tail_start = self._step_copies(first, time), self._tail_start()
        self._age(limit)  # after the view is taken: this forward reads its own tokens in full precision ...
        if copies is None:
            return KVView(view_keys, view_values, **view)
        # ... unless it is a verification block: then each token reads what its own decode step would
        copy_keys, copy_values, copy_slots = copies
        all_slots = torch.cat([slots, copy_slots])
        until = torch.where(slots < tail_start, NEVER, self._quantized_from(slots))
        visible_from = torch.cat([slots, self._quantized_from(copy_slots)])
        visible_until = torch.cat([until, torch.full_like(copy_slots, NEVER)])
        view.update(slots=all_slots, valid=self._validity(all_slots), in_order=False)
        return stepwise_view(KVView(torch.cat([view_keys, copy_keys], 2), torch.cat([view_values, copy_values], 2),
                                    **view), visible_from, visible_until)

    def _append_recent(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys, values [batch, heads, time, head_dim]`` after the full-precision tail."""
        time = keys.shape[2]
        self.recent_keys = _grown(self.recent_keys, self.recent, self.recent + time)
        self.recent_values = _grown(self.recent_values, self.recent, self.recent + time)
        self.recent_keys[:, :, self.recent : self.recent + time] = keys
        self.recent_values[:, :, self.recent : self.recent + time] = values
        self.recent += time

    def history(self, valid: torch.Tensor | None = None) -> QuantizedHistory:
        """The tokens held now, as views for :class:`~.quantized_attention.QuantizedHistory` (decode attention
        read from the codes); ``valid [batch, 1, seen]`` or None."""
        q, blocks, r = self.quantized, self.quantized // self.group, self.recent
        return QuantizedHistory(self.key_codes[:, :, :q], self.key_scale[:, :, :blocks], self.key_zero[:, :, :blocks],
                                self.value_codes[:, :, :q], self.value_scale[:, :, :q], self.value_zero[:, :, :q],
                                self.recent_keys[:, :, :r], self.recent_values[:, :, :r], valid, bits=self.bits,
                                group=self.group)

    # --- rollback: the tokens that left the full-precision tail, kept in full precision to be put back ----------

    def _offset(self) -> int:
        """Slots before the quantized storage (the sinks of a subclass)."""
        return 0

    def _left(self) -> int:
        """Tokens (after the offset) that have left the full-precision tail."""
        return self.quantized

    def _tail_start(self) -> int:
        """Absolute slot of the first full-precision tail token."""
        return self._offset() + self._left()

    def _canonical_left(self, seen: int) -> int:
        """:meth:`_left` of a cache that has seen ``seen`` slots, however its forwards were split."""
        return self.group * (max(0, seen - min(seen, self._offset()) - self.residual) // self.group)

    def _quantized_from(self, slots: torch.Tensor) -> torch.Tensor:
        """The first slot count at which each token ``slots [n]`` is held as codes (the query slot from which a
        decode step reads it dequantized)."""
        offset = self._offset()
        return offset + self.residual + self.group * ((slots - offset) // self.group + 1)

    def _step_copies(self, first: int, time: int):
        """For a verification block: the dequantized copies ``(keys, values, slots)`` of the tail tokens that a
        decode step inside the block would read as codes (they are quantized by then); None when none are."""
        if not is_verification_block(first, time):
            return None
        count = self._canonical_left(first + time - 1) - self._left()
        if count <= 0:
            return None
        start = self._tail_start()
        slots = torch.arange(start, start + count, device=self.recent_keys.device)
        keys, values = roundtrip(self.recent_keys[:, :, :count], self.recent_values[:, :, :count], self.bits,
                                 self.group, self._validity(slots))
        return keys, values, slots

    def keep_checkpoints(self, tokens: int) -> None:
        self.spill_limit, self.spilled_keys, self.spilled_values = tokens, None, None

    def _begin_spill(self, time: int) -> int:
        """Before a forward of ``time`` tokens: how many token slots it must stay able to undo (the
        ``keep_checkpoints`` limit, or a verification block's own length, or 0), and an empty spill if the
        last forward's is not kept."""
        limit = self.spill_limit or (time if is_verification_block(self.seen, time) else 0)
        if not limit:
            if self.spilled_keys is not None:  # (plain decoding writes nothing here)
                self.spilled_keys = self.spilled_values = None
        elif self.spilled_keys is None or not self.spill_limit:
            self.spilled_keys = self.recent_keys[:, :, :0]
            self.spilled_values = self.recent_values[:, :, :0]
        return limit

    def _spill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep ``keys, values [batch, heads, n, head_dim]``, the tokens now leaving the tail (while spilling)."""
        if self.spilled_keys is not None:
            self.spilled_keys = torch.cat([self.spilled_keys, keys], 2)
            self.spilled_values = torch.cat([self.spilled_values, values], 2)

    def _age(self, limit: int) -> None:
        """After a forward's view is taken: quantize what aged, keep what undoing ``limit`` slots needs."""
        self._quantize_aged()
        self._trim_spill(limit)

    def _trim_spill(self, limit: int) -> None:
        if self.spilled_keys is not None:
            drop = max(0, self._kept() - (self._left() - self._canonical_left(max(0, self.seen - limit))))
            self.spilled_keys, self.spilled_values = self.spilled_keys[:, :, drop:], self.spilled_values[:, :, drop:]

    def _kept(self) -> int:
        return 0 if self.spilled_keys is None else self.spilled_keys.shape[2]

    def _codes_nbytes(self, tokens: int) -> int:
        """Bytes of the codes, scales and zero points of the oldest ``tokens`` quantized tokens (whole groups)."""
        blocks = tokens // self.group
        held = [self.key_codes[:, :, :tokens], self.value_codes[:, :, :tokens], self.key_scale[:, :, :blocks],
                self.key_zero[:, :, :blocks], self.value_scale[:, :, :tokens], self.value_zero[:, :, :tokens]]
        return sum(_tensor_nbytes(t) for t in held)

    def reserved_nbytes(self) -> int:
        """The storage the buffers occupy (room grown into, the tail's room, kept copies), once per storage."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._tensors().values()}
        return sum(storages.values())

    croppable = True

    def rewind_blocker(self, tokens: int) -> str | None:
        """Dropping full-precision tail tokens is exact; groups quantized since the crop point are dropped too and
        their tokens put back in full precision from the spill (a group quantized from tokens that are then
        dropped must not stay), so the spill must reach back that far."""
        needed = self._left() - self._canonical_left(self.seen - tokens)
        if needed <= self._kept():
            return None
        return (f"that is before its earliest kept checkpoint: undoing {tokens} token slots puts {needed} quantized "
                f"tokens back in full precision, and {self._kept()} were kept (a forward of 2 to "
                f"{rollback.AUTO_CHECKPOINT_TOKENS} tokens on a warm cache keeps those it quantizes until the next "
                "forward; HybridCache.keep_checkpoints(n) keeps them across forwards)")

    def rewind(self, tokens: int) -> None:
        """Forget the last ``tokens`` slots: the codes of every group a cache that stopped there would not have
        quantized yet go, their tokens come back from the spill to the front of the tail."""
        seen = self.seen - tokens
        left = self._canonical_left(seen)
        back = self._left() - left  # tokens (whole groups) put back into the tail
        tail = seen - self._offset_after(seen) - left
        kept = self._kept()
        if back:  # the tail becomes tokens [left, seen): the put-back ones, then what is left of the old tail
            self.recent_keys = torch.cat([self.spilled_keys[:, :, kept - back:],
                                          self.recent_keys[:, :, : self.recent]], 2)[:, :, :tail]
            self.recent_values = torch.cat([self.spilled_values[:, :, kept - back:],
                                            self.recent_values[:, :, : self.recent]], 2)[:, :, :tail]
            self.spilled_keys = self.spilled_keys[:, :, : kept - back]
            self.spilled_values = self.spilled_values[:, :, : kept - back]
            self.quantized -= back
        self.recent = tail
        self._rewind_offset(seen)
        if self.has_padding:
            self.padding = self.padding.clamp(max=self.seen)

    def _offset_after(self, seen: int) -> int:
        """Slots before the quantized storage once ``seen`` slots are held."""
        return 0

    def _rewind_offset(self, seen: int) -> None:
        """Forget the slots before the quantized storage beyond ``seen``."""

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, heads, quantized, head_dim]`` of the quantized tokens."""
        q, group, bits = self.quantized, self.group, self.bits
        batch, heads, _, dim = self.recent_keys.shape
        key_codes = unpack(self.key_codes[:, :, :q], bits).view(batch, heads, q // group, group, dim)
        keys = dequantize(key_codes, self.key_scale[:, :, : q // group, None], self.key_zero[:, :, : q // group, None])
        value_codes = unpack(self.value_codes[:, :, :q], bits).view(batch, heads, q, dim // group, group)
        values = dequantize(value_codes, self.value_scale[:, :, :q, :, None], self.value_zero[:, :, :q, :, None])
        return keys.view(batch, heads, q, dim), values.view(batch, heads, q, dim)

    def _quantize_aged(self) -> None:
        """Quantize the oldest whole groups of the full-precision tail beyond ``residual`` tokens."""
        aged = self.group * (max(0, self.recent - self.residual) // self.group)
        if not aged:
            return
        batch, heads, _, dim = self.recent_keys.shape
        q, blocks, group = self.quantized, self.quantized // self.group, self.group
        keys, values = self.recent_keys[:, :, :aged], self.recent_values[:, :, :aged]
        self._spill(keys, values)
        start = self._tail_start()
        valid = self._validity(torch.arange(start, start + aged, device=keys.device))
        (key_codes, key_scale, key_zero), (value_codes, value_scale, value_zero) = quantize_groups(
            keys, values, self.bits, group, valid)
        for name, used, rows, data in [
            ("key_codes", q, aged, pack(key_codes.view(batch, heads, aged, dim), self.bits)),
            ("value_codes", q, aged, pack(value_codes.view(batch, heads, aged, dim), self.bits)),
            ("key_scale", blocks, aged // group, key_scale.squeeze(3)),
            ("key_zero", blocks, aged // group, key_zero.squeeze(3)),
            ("value_scale", q, aged, value_scale.squeeze(4)),
            ("value_zero", q, aged, value_zero.squeeze(4)),
        ]:
            buffer = _grown(getattr(self, name), used, used + rows)
            buffer[:, :, used : used + rows] = data
            setattr(self, name, buffer)
        # a fresh tail: the view handed out may still read the old one
        rest = self.recent - aged
        tail_keys, tail_values = torch.zeros_like(self.recent_keys), torch.zeros_like(self.recent_values)
        tail_keys[:, :, :rest], tail_values[:, :, :rest] = self.recent_keys[:, :, aged:self.recent], \
            self.recent_values[:, :, aged:self.recent]
        self.recent_keys, self.recent_values = tail_keys, tail_values
        self.quantized += aged
        self.recent = rest
