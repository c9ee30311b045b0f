"""The HybridCache: one state per layer (:mod:`hybridlm.cache.states`, the KV layouts in :mod:`hybridlm.cache.kv`),
plus the
per-row token counts ``generate()`` carries between steps. The state types are importable from here too."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from hybridlm.cache import rollback
from hybridlm.cache.kv.base import DenseKV, KVLayout, KVState, KVView, Rotate
from hybridlm.cache.states import (
    CompressedKVState,
    LayerState,
    LinearAttentionState,
    RecurrentState,
    SSMState,
    StateGroup,
    _tensor_nbytes,
)

__all__ = ["CompressedKVState", "DenseKV", "HybridCache", "KVLayout", "KVState", "KVView", "LayerState",
           "LinearAttentionState", "RecurrentState", "Rotate", "SSMState", "StateGroup"]


class HybridCache:
    """One state per layer, plus per-row token counts: what ``generate()`` carries between steps.

    ``positions[b]`` counts the real (non-padding) tokens row ``b`` has seen, i.e. the position id of its
    next token; ``seen`` counts the token slots of every row, padding included.
    """

    def __init__(self, states: list[LayerState], layer_types: list[str], signature: Any, batch_size: int,
                 device: torch.device | None = None, linear: list[bool] | None = None):
        self.states = states
        # per state: True when it does not grow with context (the mixer's ``grows_with_context``; None: unknown)
        self.linear = list(linear) if linear is not None else [False] * len(states)
        self.layer_types = list(layer_types)
        self.signature = signature
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.seen = 0
        self.policy = None  # the CachePolicy the states were made under (None: the default layouts)
        self.capacity: int | None = None  # static caches (hybridlm.cache.kv.static): the slots preallocated

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def nbytes(self) -> int:
        """Bytes held for the tokens seen so far, all layers (the per-row counters included)."""
        return sum(s.nbytes() for s in self.states) + _tensor_nbytes(self.positions)

    def reserved_nbytes(self) -> int:
        """Bytes allocated, including preallocated room for tokens not yet seen."""
        return sum(s.reserved_nbytes() for s in self.states) + _tensor_nbytes(self.positions)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held, summed per mixer kind (``{"attention": ..., "mamba": ...}``)."""
        totals: dict[str, int] = defaultdict(int)
        for kind, state in zip(self.layer_types, self.states):
            parts = state.parts if isinstance(state, StateGroup) else {kind: state}
            for part_kind, part in parts.items():
                totals[part_kind] += part.nbytes()
        return dict(totals)

    # --- batch rows -----------------------------------------------------------------------------

    def select(self, index: torch.Tensor) -> HybridCache:
        """A new cache of batch rows ``index`` (batch compaction, beam expansion)."""
        new = self._shell([s.select(index) for s in self.states])
        new.positions = self.positions.index_select(0, index.to(self.positions.device))
        return new

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder rows in place to follow the surviving beams (the hook beam search calls)."""
        reordered = self.select(beam_idx)
        self.states, self.positions = reordered.states, reordered.positions

    # --- snapshots and devices ------------------------------------------------------------------

    def snapshot(self) -> HybridCache:
        """An independent copy (prefix caching: a shared prompt's state, restored for each continuation)."""
        new = self._shell([s.clone() for s in self.states])
        new.positions = self.positions.clone()
        return new

    def restore(self, snapshot: HybridCache) -> None:
        """Return to ``snapshot``'s contents; the snapshot stays usable for further restores."""
        if snapshot.signature != self.signature:
            raise ValueError("HybridCache.restore: the snapshot was taken from a cache of a different model")
        copy = snapshot.snapshot()
        self.states, self.positions, self.seen = copy.states, copy.positions, copy.seen

    def to(self, device: torch.device | str) -> HybridCache:
        new = self._shell([s.to(device) for s in self.states])
        new.positions = self.positions.to(device)
        return new

    def _shell(self, states: list[LayerState]) -> HybridCache:
        new = HybridCache.__new__(HybridCache)
        new.states, new.layer_types, new.signature, new.seen = states, self.layer_types, self.signature, self.seen
        new.policy, new.linear, new.capacity = self.policy, self.linear, self.capacity
        return new

    # --- bookkeeping after a forward ------------------------------------------------------------

    def advance(self, mask: torch.Tensor | None, new_tokens: int) -> None:
        """Count ``new_tokens`` slots, of which ``mask`` marks the real ones (all when None)."""
        self.seen += new_tokens
        self.positions += new_tokens if mask is None else mask.sum(-1)
        for state in self.states:
            state.advance(new_tokens)

    def check_room(self, new_tokens: int) -> None:
        """A static cache cannot grow: ValueError before a forward that would overflow it (no device sync)."""
        if self.capacity is not None and self.seen + new_tokens > self.capacity:
            raise ValueError(f"static cache: {self.seen} slots held + {new_tokens} new exceed its "
                             f"max_length={self.capacity}")

    # --- what transformers' generate() asks of a cache (keep these in one place) ----------------

    is_compileable = False

    @property
    def is_linear(self) -> list[bool]:
        """Per state: a fixed size, whatever the context (what transformers calls a linear-attention layer)."""
        return list(self.linear)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def crop(self, length: int) -> None:
        """Roll back to ``length`` token slots in place (``length <= 0``: remove ``-length``, transformers' v5
        convention, so ``crop(0)`` changes nothing); see :mod:`hybridlm.cache.rollback`. ValueError, leaving the cache
        unchanged, past the start, beyond the slots seen, or where a state kept nothing to roll back to."""
        remove = rollback.tokens_to_remove(length, self.seen)
        if remove == 0:
            return
        for index, (kind, state) in enumerate(zip(self.layer_types, self.states)):
            reason = state.rewind_blocker(remove)
            if reason is not None:
                raise ValueError(f"HybridCache.crop({length}): state {index} ({kind}) cannot remove the last "
                                 f"{remove} token slots: {reason}")
        for state in self.states:  # every state can: none is changed before all were asked
            state.rewind(remove)
        self.seen -= remove
        # positions count real tokens; the removed slots are the last ones, and padding only precedes real tokens
        self.positions.sub_(remove).clamp_(min=0)

    def keep_checkpoints(self, tokens: int = rollback.AUTO_CHECKPOINT_TOKENS) -> None:
        """Keep, across forwards (one-token decode steps included), what undoing up to ``tokens`` token slots
        needs: each recurrent state's value after each of its last ``tokens`` tokens, the slots a window
        layout overwrote. Memory shows in :meth:`reserved_nbytes`; 0 turns it off (the default: only a forward
        of 2 to 64 tokens keeps its per-token states, until the next forward)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"HybridCache.keep_checkpoints(tokens={tokens!r}): tokens must be an int >= 0")
        for state in self.states:
            state.keep_checkpoints(tokens)

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """transformers' name for :meth:`keep_checkpoints` (assisted generation calls it): the last 64 tokens, or
        ``recurrent_states_to_keep`` (the draft length transformers 5.25 passes) if more."""
        wanted = recurrent_states_to_keep or 0
        self.keep_checkpoints(max(wanted, rollback.AUTO_CHECKPOINT_TOKENS))

    @property
    def is_croppable(self) -> bool:
        """Whether every state can roll back at all (H2O's heavy hitters cannot); how far is :meth:`crop`'s
        business."""
        return all(state.croppable for state in self.states)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {v:,} B" for k, v in self.nbytes_by_kind().items())
        return f"HybridCache(batch={self.batch_size}, seen={self.seen}, {kinds})"
