"""The static KV layout: a decode step of fixed shapes that reads no Python counter (what ``torch.compile`` and
CUDA graphs need).

``model.new_cache(batch, max_length=N, static=True)`` gives every full-attention layer a :class:`StaticKV`:
the contiguous layout with its capacity fixed at ``N`` slots and a device copy of its fill level, ``filled``.
A forward writes its keys at slots ``filled .. filled + time`` (``index_copy_`` with a tensor index) and bumps
``filled`` in place. A one-token step then attends over the whole capacity, with causality by slot hiding the
empty slots, so its shapes never change; a longer (prefill) forward, run eagerly, attends over the filled slots
only. The Python ``length`` (what sizes and rollback read) advances in :meth:`StaticKV.advance`, which
``HybridCache.advance`` calls after the forward, outside any compiled step.

Sizes per batch row are the contiguous layout's plus the 8-byte ``filled`` counter. Other layouts (a sliding
window's ring, the policies' layouts, the Linformer's compressed keys) keep Python counters inside their update,
so a cache holding them cannot be static: :func:`make_static` says which.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridlm.cache.kv.base import KVState, KVView
from hybridlm.cache.states import LayerState, StateGroup, _tensor_nbytes


@dataclasses.dataclass
class StaticKV(KVState):
    """:class:`~hybridlm.cache.KVState` with a fixed capacity and ``filled [batch]`` (int64, equal in every row:
    the slots written so far, padding included) on the device."""

    filled: torch.Tensor | None = None
    step_counters = ("length",)  # the step reads ``filled`` on the device instead

    @classmethod
    def from_state(cls, state: KVState) -> StaticKV:
        batch = state.keys.shape[0]
        filled = torch.full((batch,), state.length, dtype=torch.long, device=state.keys.device)
        return cls(state.keys, state.values, state.padding, state.length, state.has_padding, filled)

    @property
    def fixed_step(self) -> bool:
        return True

    def nbytes(self) -> int:
        return super().nbytes() + _tensor_nbytes(self.filled)

    def predicted_nbytes(self, tokens: int) -> int:
        return super().predicted_nbytes(tokens) + _tensor_nbytes(self.filled)

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        time = keys.shape[2]
        if rotate is not None:
            keys = rotate(keys, positions)
        self._count_padding(mask)
        new_slots = self.filled[:1] + torch.arange(time, device=keys.device)  # [time]
        self.keys.index_copy_(2, new_slots, keys)
        self.values.index_copy_(2, new_slots, values)
        self.filled.add_(time)
        if time == 1:  # decode: every slot, the empty ones hidden by causality (their slots lie after the query)
            slots = torch.arange(self.keys.shape[2], device=keys.device)  # [capacity]
            return KVView(self.keys, self.values, slots, self._validity(slots), query_slots=new_slots,
                          query_positions=positions)
        end = self.length + time  # prefill (eager): the filled slots only
        slots = torch.arange(end, device=keys.device)
        return KVView(self.keys[:, :, :end], self.values[:, :, :end], slots, self._validity(slots),
                      query_slots=slots[self.length:], query_positions=positions, in_order=True)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("StaticKV: keys are written by update() at the device-side fill level, not appended")

    def advance(self, tokens: int) -> None:
        self.length += tokens

    def rewind(self, tokens: int) -> None:
        super().rewind(tokens)
        self.filled.sub_(tokens)


def make_static(state: LayerState, kind: str) -> LayerState:
    """``state`` with each contiguous KV part replaced by a :class:`StaticKV` over the same buffers; a ValueError
    naming ``kind`` for a state whose one-token update is not of fixed shape (see :attr:`LayerState.fixed_step`)."""
    if isinstance(state, StateGroup):
        return StateGroup({name: make_static(part, f"{kind}/{name}") for name, part in state.parts.items()})
    if type(state) is KVState:
        if state.keys.shape[2] == 0:
            raise ValueError("new_cache: static=True needs max_length (the slots every attention layer preallocates)")
        return StaticKV.from_state(state)
    if not state.fixed_step:
        raise ValueError(f"new_cache: static=True is not possible with a {kind} layer's {type(state).__name__} "
                         "(its update keeps Python counters or changes shape); use static=False")
    return state
