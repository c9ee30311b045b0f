"""The base of the attention states: what a KV layout hands attention (:class:`KVView`), the layout contract
(:class:`KVLayout`) and the contiguous layout every other one is measured against (:class:`KVState`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

from hybridlm.cache.states import LayerState, _tensor_nbytes


@dataclasses.dataclass
class KVView:
    """What a KV layout hands attention for one forward: the keys and values to attend over and, per key, its
    absolute slot and whether it holds a real token. Attention builds its mask from these (causal by slot,
    ``window`` by slot unless ``pinned``, never an invalid key) and rotates its queries by
    ``query_positions``; it never reads a layout's internals.

    ``keys, values [batch, kv_heads, n, head_dim]``; ``slots``: ``[n]`` or ``[batch, kv_heads, n]``;
    ``valid`` and ``pinned``: None or broadcastable to ``[batch, kv_heads, n]``; ``query_slots [time]``;
    ``query_positions [batch, time]``. ``in_order``: the keys are slots ``0..n-1``, so without padding or a
    window causality alone decides (SDPA's own causal path, or no mask for one query). ``attend(q, scale)``:
    set by a layout that attends itself (the paged and quantized decode kernels, a verification block read as
    decode steps: :mod:`hybridlm.cache.kv.stepwise`); attention calls it instead of reading ``keys`` and ``values``
    (None then, or kept for inspection)."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    slots: torch.Tensor
    valid: torch.Tensor | None
    query_slots: torch.Tensor
    query_positions: torch.Tensor
    window: int | None = None
    pinned: torch.Tensor | None = None
    in_order: bool = False
    attend: Callable[[torch.Tensor, float | None], torch.Tensor] | None = None


#: What a :class:`~hybridlm.CachePolicy` may ask of a layer's layout (:attr:`KVLayout.policy_features`).
POLICY_FEATURES = frozenset({"kv_bits", "window", "heavy_hitters", "page_size"})


class KVLayout(LayerState):
    """Base of the attention states (one subclass per layout: contiguous, ring window, sinks + window,
    quantized, heavy hitters). A layout stores keys and values its own way and answers :meth:`update`.

    Every layout has ``padding [batch]`` (leading padding slots per row; padding only ever precedes a row's
    first real token, so slot ``s`` of row ``b`` is real iff ``s >= padding[b]``), ``has_padding`` (a Python
    flag, so that decode needs no device sync) and ``seen`` (token slots seen, padding included)."""

    #: a layout that needs the attention probabilities of each forward (passed to :meth:`observe`)
    needs_attention_probs: ClassVar[bool] = False
    #: False for a layout whose :meth:`update` takes one latent per token as ``keys`` and ``values=None`` (MLA)
    takes_values: ClassVar[bool] = True
    #: the :data:`POLICY_FEATURES` a policy may replace this layout with, when it is a layer's default state
    policy_features: ClassVar[frozenset[str]] = frozenset()
    #: why the layout may stay as it is under a policy asking for other features (the policy then applies to the
    #: other layers, with a warning); None: such a policy is refused
    kept_under_policy: ClassVar[str | None] = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               rotate: Rotate | None, mask: torch.Tensor | None) -> KVView:
        """Take the new ``keys, values [batch, kv_heads, time, head_dim]`` (not yet rotated) at ``positions
        [batch, time]``; return what the new queries attend over. ``rotate(x, positions)`` applies the rotary
        embedding (None without one); ``mask [batch, time]`` marks the new real tokens."""
        raise NotImplementedError

    def observe(self, probs: torch.Tensor) -> None:
        """The attention probabilities ``[batch, q_heads, time, n]`` over the last view's keys."""

    def rewind_blocker(self, tokens: int) -> str | None:
        return f"the {type(self).__name__} layout cannot roll back"

    @property
    def fixed_step(self) -> bool:
        return False

    def predicted_nbytes(self, tokens: int) -> int:
        """``nbytes()`` once ``tokens`` token slots have been seen (the formula the tests check)."""
        raise NotImplementedError

    @property
    def end(self) -> int:
        """Absolute slot after the last one seen."""
        return self.seen

    def describe(self) -> tuple:
        """The same for every layout (``kv_heads``, ``head_dim`` and ``dtype`` are properties of each): a
        cache made under any policy serves the same model."""
        return (("kv", self.kv_heads, self.head_dim, self.dtype),)

    def _count_padding(self, mask: torch.Tensor | None) -> None:
        if mask is not None:
            self.padding = self.padding + (~mask).sum(-1)
            self.has_padding = True

    def _validity(self, slots: torch.Tensor) -> torch.Tensor | None:
        """``slots >= padding`` per row (None when no row has padding); ``slots [n]`` or ``[batch, heads, n]``."""
        if not self.has_padding:
            return None
        return slots >= self.padding.view(-1, 1, 1)  # [batch, 1 or heads, n]


Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DenseKV(KVLayout):
    """A layout holding full-precision ``keys``/``values`` ``[batch, kv_heads, slots, head_dim]``: the shape
    and dtype properties the contiguous, ring, sink and heavy-hitter layouts share."""

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype


@dataclasses.dataclass
class KVState(DenseKV):
    """The contiguous layout (full attention, no policy): every key and value kept in full precision.

    ``keys``/``values`` are ``[batch, kv_heads, capacity, head_dim]`` buffers of which the first ``length``
    slots are filled (``nbytes`` counts those; ``reserved_nbytes`` the capacity). Capacity is preallocated when
    the maximum length is known, and otherwise grows by half when full. Keys are stored rotated."""

    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor
    length: int = 0
    has_padding: bool = False

    policy_features = POLICY_FEATURES

    @classmethod
    def empty(cls, batch_size, kv_heads, head_dim, *, capacity=0, device=None, dtype=None):
        shape = (batch_size, kv_heads, capacity, head_dim)
        return cls(
            keys=torch.zeros(shape, device=device, dtype=dtype),
            values=torch.zeros(shape, device=device, dtype=dtype),
            padding=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    @property
    def seen(self) -> int:
        return self.length

    def nbytes(self) -> int:
        used = self.keys[:, :, : self.length]
        return 2 * _tensor_nbytes(used) + _tensor_nbytes(self.padding)

    def reserved_nbytes(self) -> int:
        return super().nbytes()

    def predicted_nbytes(self, tokens: int) -> int:
        batch, heads, _, dim = self.keys.shape
        return batch * (2 * heads * tokens * dim * self.keys.element_size() + self.padding.element_size())

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        first, time = self.length, keys.shape[2]
        if rotate is not None:
            keys = rotate(keys, positions)
        self._count_padding(mask)
        held_keys, held_values = self.append(keys, values)
        slots = torch.arange(self.length, device=keys.device)
        return KVView(held_keys, held_values, slots, self._validity(slots),
                      query_slots=slots[first:first + time], query_positions=positions, in_order=True)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``keys, values [batch, kv_heads, new, head_dim]``; returns all held keys and values."""
        new = keys.shape[2]
        needed = self.length + new
        if needed > self.keys.shape[2]:  # grow by half at least, so that decoding copies the cache rarely
            capacity = max(needed, self.keys.shape[2] * 3 // 2)
            self.keys, self.values = (self._with_capacity(t, capacity) for t in (self.keys, self.values))
        self.keys[:, :, self.length : self.length + new] = keys
        self.values[:, :, self.length : self.length + new] = values
        self.length += new
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    croppable = True

    def rewind_blocker(self, tokens: int) -> str | None:
        return None if tokens <= self.length else f"it holds only {self.length} slots"

    def rewind(self, tokens: int) -> None:
        """Forget the last ``tokens`` slots (the next :meth:`append` overwrites them); a row whose padding reached
        into them keeps only the padding that is left."""
        self.length -= tokens
        if self.has_padding:
            self.padding = self.padding.clamp(max=self.length)

    def _with_capacity(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.shape[3])
        grown[:, :, : self.length] = buffer[:, :, : self.length]
        return grown
