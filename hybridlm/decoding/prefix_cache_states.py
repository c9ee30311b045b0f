"""What a prefix-cache snapshot is made of, and how it goes back into a live cache.

A snapshot is an independent copy of one batch row of a :class:`~hybridlm.HybridCache` after a block boundary.
Most states (SSM, conv windows, running sums, rings, quantized and paged KV) are copied whole. The contiguous KV
layout (:class:`~hybridlm.cache.KVState` and its subclasses) holds only the slots of the snapshot's own block:
the earlier ones are in the snapshots of the earlier blocks of its chain, so a prompt's keys and values are
stored once, not once per block; :func:`assemble` concatenates them again for a restore.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from hybridlm.cache import HybridCache, KVState, LayerState, StateGroup


def parts(state: LayerState) -> list[LayerState]:
    return list(state.parts.values()) if isinstance(state, StateGroup) else [state]


_SCALARS = (bool, int, float, str, type(None))


def _is_plain(value) -> bool:
    """A tensor, a scalar, or a list of scalars or of such lists (a paged layout's host-side block tables)."""
    if isinstance(value, list):
        return all(isinstance(item, (list, *_SCALARS)) and _is_plain(item) for item in value)
    return isinstance(value, (torch.Tensor, *_SCALARS))


def check_snapshottable(state: LayerState) -> None:
    """A snapshot copies tensors and plain values (scalars, lists of them) and resets any other field that has a
    default (a rollback history: a snapshot is a point to continue from, not to roll back from). Refuse a state
    with any other field, which a snapshot could not copy faithfully."""
    for part in parts(state):
        if not dataclasses.is_dataclass(part):
            raise ValueError(f"prefix_cache: the state type {type(part).__name__} cannot be snapshotted")
        for field in dataclasses.fields(part):
            value = getattr(part, field.name)
            if not _is_plain(value) and field.default is dataclasses.MISSING:
                raise ValueError(f"prefix_cache: the state type {type(part).__name__} cannot be snapshotted (its "
                                 f"field {field.name!r} holds a {type(value).__name__})")


def has_host_tables(state: LayerState) -> bool:
    """Whether a part keeps lists (per-cache host-side tables): rows of its snapshots cannot be concatenated."""
    return any(isinstance(getattr(part, field.name), list) for part in parts(state)
               for field in dataclasses.fields(part))


def _without_transients(state: LayerState) -> LayerState:
    """``state`` with every field that holds neither a tensor nor a plain value reset to its default."""
    resets = {field.name: field.default for field in dataclasses.fields(state)
              if not _is_plain(getattr(state, field.name))}
    return dataclasses.replace(state, **resets) if resets else state


def block_snapshot(cache: HybridCache, first_slot: int) -> HybridCache:
    """An independent copy of ``cache`` whose contiguous KV states hold only slots ``first_slot ..`` (the last
    block's; their ``length`` still counts every slot)."""
    snapshot = copy.copy(cache)
    snapshot.states = [_block_copy(state, first_slot) for state in cache.states]
    snapshot.positions = cache.positions.clone()
    return snapshot


def _block_copy(state: LayerState, first_slot: int) -> LayerState:
    if isinstance(state, StateGroup):
        return StateGroup({name: _block_copy(part, first_slot) for name, part in state.parts.items()})
    state = _without_transients(state)
    if isinstance(state, KVState):
        state = dataclasses.replace(state, keys=state.keys[:, :, first_slot:state.length],
                                    values=state.values[:, :, first_slot:state.length])
    return state.select(torch.arange(state.batch_size))  # a copy (a paged pool: of the pages in use only)


def assemble(chain: list[HybridCache]) -> HybridCache:
    """The full snapshot at the end of ``chain`` (the snapshots of blocks 1, 2, ..., k of one row): its own
    states, with the KV slots of every block concatenated."""
    if len(chain) == 1:
        return chain[0]
    full = copy.copy(chain[-1])
    full.states = [_assembled([snapshot.states[i] for snapshot in chain]) for i in range(len(full.states))]
    return full


def _assembled(states: list[LayerState]) -> LayerState:
    last = states[-1]
    if isinstance(last, StateGroup):
        return StateGroup({name: _assembled([s.parts[name] for s in states]) for name in last.parts})
    if not isinstance(last, KVState):
        return last
    return dataclasses.replace(last, keys=torch.cat([s.keys for s in states], dim=2),
                               values=torch.cat([s.values for s in states], dim=2))


def into_buffers(state: LayerState, empty: LayerState) -> LayerState:
    """A copy of ``state`` (a snapshot's) written into the tensors of ``empty`` (the fresh cache's) where they
    fit: the same shape, or a contiguous KV buffer with more room. Keeps the preallocated KV room and the tensors
    a static decode step may hold on to; a tensor that fits nowhere is cloned."""
    if isinstance(state, StateGroup):
        return StateGroup({name: into_buffers(part, empty.parts[name]) for name, part in state.parts.items()})
    room = isinstance(state, KVState) and empty.keys.shape[2] >= state.length
    changes = {}
    for field in dataclasses.fields(state):
        value, buffer = getattr(state, field.name), getattr(empty, field.name)
        if isinstance(value, list):  # host-side tables: the live cache changes them in place
            changes[field.name] = copy.deepcopy(value)
            continue
        if not isinstance(value, torch.Tensor):
            continue
        fits = isinstance(buffer, torch.Tensor) and buffer.dtype == value.dtype
        if fits and buffer.shape == value.shape:
            changes[field.name] = buffer.copy_(value)
        elif fits and room and field.name in ("keys", "values"):
            buffer[:, :, :state.length] = value[:, :, :state.length]
            changes[field.name] = buffer
        else:
            changes[field.name] = value.clone()
    return dataclasses.replace(state, **changes)


def concat_rows(rows: list[HybridCache]) -> HybridCache:
    """One cache of the rows of one-row snapshots ``rows`` (all after the same number of tokens)."""
    combined = copy.copy(rows[0])
    combined.states = [_concat_states([row.states[i] for row in rows]) for i in range(len(rows[0].states))]
    combined.positions = torch.cat([row.positions for row in rows])
    return combined


def _concat_states(states: list[LayerState]) -> LayerState:
    first = states[0]
    if isinstance(first, StateGroup):
        return StateGroup({name: _concat_states([s.parts[name] for s in states]) for name in first.parts})
    tensors = {field.name: torch.cat([getattr(s, field.name) for s in states]) for field in dataclasses.fields(first)
               if isinstance(getattr(first, field.name), torch.Tensor)}
    return dataclasses.replace(first, **tensors)


