"""Rolling a :class:`~hybridlm.cache.HybridCache` back to an earlier token: ``cache.crop(length)``.

A KV state rolls back by dropping slots. A recurrent state (an SSM, a linear-attention sum, a conv window)
cannot be un-updated, so it rolls back to a kept *checkpoint*: the state after one of the last tokens. Every
state answers :meth:`~hybridlm.cache.LayerState.rewind_blocker` (why it cannot undo the last ``n`` token
slots, or None) and :meth:`~hybridlm.cache.LayerState.rewind`; :func:`crop` asks every state first and
changes nothing unless all of them can, so a refused crop leaves the cache as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import HybridCache


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


def crop(cache: HybridCache, length: int) -> None:
    """Roll ``cache`` back to ``length`` token slots (see :func:`tokens_to_remove`), or raise ValueError naming
    the first layer that cannot, leaving the cache unchanged."""
    remove = tokens_to_remove(length, cache.seen)
    if remove == 0:
        return
    for index, (kind, state) in enumerate(zip(cache.layer_types, cache.states)):
        reason = state.rewind_blocker(remove)
        if reason is not None:
            raise ValueError(f"HybridCache.crop({length}): state {index} ({kind}) cannot remove the last {remove} "
                             f"token slots: {reason}")
    for state in cache.states:
        state.rewind(remove)
    cache.seen -= remove
    # positions count real tokens; the removed slots are the last ones, and padding only precedes real tokens
    cache.positions.sub_(remove).clamp_(min=0)
