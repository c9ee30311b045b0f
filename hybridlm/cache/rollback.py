"""What rolling a :class:`~hybridlm.cache.HybridCache` back to an earlier token (``cache.crop(length)``) needs of
each state: the kept checkpoints of the recurrent states. The states import this module; it imports none of
them, nor the container.

A KV state rolls back by dropping slots. A recurrent state (an SSM, a linear-attention sum, a conv window)
cannot be un-updated, so it rolls back to a kept *checkpoint*: the state after one of the last tokens. Every
state answers :meth:`~hybridlm.cache.LayerState.rewind_blocker` (why it cannot undo the last ``n`` token
slots, or None) and :meth:`~hybridlm.cache.LayerState.rewind`; :meth:`~hybridlm.cache.HybridCache.crop` asks
every state first and changes nothing unless all of them can, so a refused crop leaves the cache as it was.
"""

from __future__ import annotations

import contextlib

import torch


def tokens_to_remove(length: int, seen: int) -> int:
    """How many trailing token slots ``crop(length)`` removes from a cache that has seen ``seen``.

    ``length >= 1`` keeps ``length`` slots; ``length <= 0`` removes ``-length`` (transformers' convention since
    v5, so ``crop(0)`` removes nothing)."""
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"HybridCache.crop(length): length must be an int, got {type(length).__name__}")
    remove = seen - length if length > 0 else -length
    if remove < 0:
        raise ValueError(f"HybridCache.crop({length}): beyond the {seen} token slots seen (crop can only go back)")
    if remove > seen:
        raise ValueError(f"HybridCache.crop({length}): past the start: removes {remove} token slots but only "
                         f"{seen} were seen")
    return remove


#: A forward of up to this many tokens keeps its per-token states without being asked (what transformers'
#: verification step sends); ``HybridCache.keep_checkpoints(n)`` keeps them across forwards instead.
AUTO_CHECKPOINT_TOKENS = 64


class StateHistory:
    """A recurrent state's values at its last token boundaries: a ring of ``capacity`` entries per tensor field,
    ``buffers[name] [batch, capacity, ...]``. The newest entry is the state as it is now; ``count - 1`` tokens
    can be undone. Writing ``n`` entries copies ``n`` states (never the whole ring)."""

    def __init__(self, buffers: dict[str, torch.Tensor], count: int = 0, newest: int = -1):
        self.buffers, self.count, self.newest = buffers, count, newest

    @classmethod
    def starting_at(cls, tensors: dict[str, torch.Tensor], capacity: int) -> StateHistory:
        """A history of ``capacity`` entries whose first entry is ``tensors`` (a copy of the state now)."""
        history = cls({name: t.new_empty(t.shape[0], capacity, *t.shape[1:]) for name, t in tensors.items()})
        history.restart(tensors)
        return history

    def restart(self, tensors: dict[str, torch.Tensor]) -> None:
        """Forget every entry; ``tensors`` (a copy of the state now) is the first one."""
        self.count, self.newest = 0, -1
        self.push({name: t.unsqueeze(1) for name, t in tensors.items()})

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values())).shape[1]

    def push(self, entries: dict[str, torch.Tensor]) -> None:
        """Append ``entries[name] [batch, n, ...]`` (oldest first); only the last ``capacity`` stay."""
        n = next(iter(entries.values())).shape[1]
        if n == 0:
            return
        kept = min(n, self.capacity)
        start = (self.newest + 1 + n - kept) % self.capacity
        for name, buffer in self.buffers.items():
            source = entries[name][:, n - kept:]
            if start + kept <= self.capacity:  # one run of slots (no index tensor)
                buffer[:, start : start + kept].copy_(source)
            else:  # wrapping around the ring
                head = self.capacity - start
                buffer[:, start:].copy_(source[:, :head])
                buffer[:, : kept - head].copy_(source[:, head:])
        self.newest = (self.newest + n) % self.capacity
        self.count = min(self.count + n, self.capacity)

    def rewind(self, tokens: int) -> dict[str, torch.Tensor]:
        """Drop the last ``tokens`` entries (``tokens < count``); returns the entry that is newest now."""
        self.newest = (self.newest - tokens) % self.capacity
        self.count -= tokens
        return {name: buffer[:, self.newest] for name, buffer in self.buffers.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def map(self, fn) -> StateHistory:
        """The same history with ``fn`` applied to every buffer (row selection, clone, device move)."""
        return StateHistory({name: fn(t) for name, t in self.buffers.items()}, self.count, self.newest)


def start_forward(state, time: int) -> bool:
    """Before a forward of ``time`` tokens updates a recurrent ``state``: whether it keeps the state after each
    token. Asked (``checkpoint_limit > 0``): always, into a ring of ``checkpoint_limit + 1`` entries kept across
    forwards. Otherwise only a forward of 2 to :data:`AUTO_CHECKPOINT_TOKENS` tokens on a warm state (one that a
    forward ran through before: not a prefill), into a history of its own (the state before it and after each
    of its tokens) that the next forward replaces; a one-token forward keeps nothing and costs nothing."""
    warm = state.warm
    if not warm:
        state.warm = True
    if state.paused:
        state.history = None
        return False
    if state.checkpoint_limit:
        if state.history is None:
            state.history = StateHistory.starting_at(state._tensors(), state.checkpoint_limit + 1)
        return True
    if warm and 1 < time <= AUTO_CHECKPOINT_TOKENS:
        if state.history is not None and state.history.capacity == time + 1:  # the last block's size: reuse
            state.history.restart(state._tensors())
        else:
            state.history = StateHistory.starting_at(state._tensors(), time + 1)
        return True
    if state.history is not None:  # (plain decoding mutates nothing here: nothing for a compiled step to trace)
        state.history = None
    return False


def unkept_head(state, time: int) -> int:
    """How many leading tokens of a forward of ``time`` through ``state`` no kept checkpoint needs (asked to
    keep the last ``n``, a longer forward needs the states of its last ``n`` tokens only)."""
    limit = getattr(state, "checkpoint_limit", 0)
    return max(0, time - limit) if limit else 0


@contextlib.contextmanager
def paused(state):
    """Forwards through ``state`` inside keep no checkpoints; the next one after starts a new history."""
    state.paused = True
    try:
        yield
    finally:
        state.paused = False


@contextlib.contextmanager
def kept_per_token(state, time: int):
    """One-token forwards inside keep the state after each (as one forward of ``time`` tokens would, in a history
    of ``time + 1`` entries that the next forward replaces), unless the state already keeps checkpoints."""
    if state.checkpoint_limit:
        yield
        return
    state.checkpoint_limit, state.history = time, None
    try:
        yield
    finally:
        state.checkpoint_limit = 0  # the history stays: a crop right after may use it


def keep_states(state, per_token: dict[str, torch.Tensor]) -> None:
    """Append the states after each token (``[batch, time, ...]`` per field) to ``state.history``, the last one
    taken from the state itself (so a one-token forward passes none: None or nothing)."""
    current, given = state._tensors(), {name: t for name, t in per_token.items() if t is not None}
    if given and current.keys() != given.keys():
        raise ValueError(f"keep_states: {type(state).__name__} has fields {sorted(current)}, got {sorted(given)}")
    if given:
        state.history.push({name: t[:, :-1] for name, t in given.items()})
    state.history.push({name: t.unsqueeze(1) for name, t in current.items()})


def recurrent_blocker(state, tokens: int) -> str | None:
    held = 0 if state.history is None else state.history.count - 1
    if tokens <= held:
        return None
    return (f"that is before its earliest kept checkpoint ({held} token slots back; a forward of 2 to "
            f"{AUTO_CHECKPOINT_TOKENS} tokens on a warm cache keeps one per token until the next forward, "
            "HybridCache.keep_checkpoints(n) keeps the last n across forwards)")
