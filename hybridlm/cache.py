"""Per-layer state types and the HybridCache that holds one state per layer.

Every state keeps its batch rows on dim 0 of each tensor, so selecting rows (beam search, dropping finished
sequences), cloning and moving devices are the same operation for every kind. Sizes, per batch row:

* ``KVState`` (attention, the contiguous layout): keys and values ``[kv_heads, length, head_dim]`` plus an
  int64 padding count: ``2 * kv_heads * length * head_dim * e + 8``. The other KV layouts (ring window,
  sinks + window, quantized, heavy hitters: :mod:`hybridlm.kv`) each state their own formula in
  ``predicted_nbytes``.
* ``SSMState`` (Mamba, Mamba-2): conv window ``[conv_channels, width - 1]`` in the model dtype and the fp32
  recurrent state: ``conv_channels * (width - 1) * e + 4 * state_elements``.
* ``LinearAttentionState`` (Performer) and ``CompressedKVState`` (causal Linformer): fixed-shape fp32 running
  sums, ``4 * elements`` (the Linformer's also an int64 token count: ``+ 8``).

``e`` is the element size of the model dtype; ``length`` the number of token slots held (every token seen
for full attention, at most ``window - 1`` for a sliding window's ring). Recurrent states are kept in fp32 whatever
the model dtype, as mamba-ssm does for the scan.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from . import rollback


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass
class LayerState:
    """Base of all states: tensor fields have the batch on dim 0; other fields are plain metadata."""

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def _replace(self, fn) -> LayerState:
        return dataclasses.replace(self, **{name: fn(t) for name, t in self._tensors().items()})

    @property
    def batch_size(self) -> int:
        return next(iter(self._tensors().values())).shape[0]

    def nbytes(self) -> int:
        """Bytes held for the tokens seen so far."""
        return sum(_tensor_nbytes(t) for t in self._tensors().values())

    def reserved_nbytes(self) -> int:
        """Bytes allocated, including room reserved for tokens not yet seen."""
        return self.nbytes()

    def select(self, index: torch.Tensor) -> LayerState:
        """A new state made of batch rows ``index`` (rows may repeat, as in beam search)."""
        return self._replace(lambda t: t.index_select(0, index.to(t.device)))

    def clone(self) -> LayerState:
        return self._replace(torch.clone)

    def to(self, device: torch.device | str) -> LayerState:
        return self._replace(lambda t: t.to(device))

    def describe(self) -> tuple:
        """Shapes and dtypes without the batch: what a model checks to recognise its own states."""
        return tuple((name, tuple(t.shape[1:]), t.dtype) for name, t in self._tensors().items()
                     if name not in self._growing())

    def _growing(self) -> tuple[str, ...]:
        return ()

    @property
    def fixed_step(self) -> bool:
        """Whether a one-token update keeps every shape and reads no Python counter (what a compiled decode step
        needs; see :mod:`hybridlm.kv.static`)."""
        return True

    def advance(self, tokens: int) -> None:
        """Called by :meth:`HybridCache.advance` after each forward, outside any compiled step: Python counters
        that the update itself must not touch move here."""

    # --- rollback (hybridlm.rollback) -----------------------------------------------------------

    #: whether the kind can roll back at all (how far it can is :meth:`rewind_blocker`'s answer)
    croppable: ClassVar[bool] = False

    def rewind_blocker(self, tokens: int) -> str | None:
        """Why this state cannot undo its last ``tokens`` token slots (None: it can)."""
        return f"{type(self).__name__} cannot roll back"

    def keep_checkpoints(self, tokens: int) -> None:
        """Keep what undoing up to ``tokens`` token slots needs, across forwards (0: only what a forward of up to
        ``AUTO_CHECKPOINT_TOKENS`` tokens keeps on its own); see :meth:`HybridCache.keep_checkpoints`."""

    def rewind(self, tokens: int) -> None:
        """Undo the last ``tokens`` token slots in place (only after :meth:`rewind_blocker` returned None)."""
        raise NotImplementedError


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
    set by a layout that attends in place (the paged decode kernel); attention calls it instead of reading
    ``keys`` and ``values`` (None then)."""

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


@dataclasses.dataclass
class RecurrentState(LayerState):
    """A fixed-size state that every token updates (an SSM, a conv window, linear-attention sums). It rolls back
    to kept checkpoints (:class:`~hybridlm.rollback.StateHistory`): its mixer calls :meth:`checkpointing` before
    a forward updates it and, when that says so, :meth:`keep_states` after."""

    history: rollback.StateHistory | None = dataclasses.field(default=None, kw_only=True, repr=False)
    checkpoint_limit: int = dataclasses.field(default=0, kw_only=True)  # tokens kept across forwards (0: none)
    warm: bool = dataclasses.field(default=False, kw_only=True)  # a forward has run through it
    paused: bool = dataclasses.field(default=False, kw_only=True)  # keep nothing (rollback.unkept_head)
    croppable = True

    def _replace(self, fn) -> RecurrentState:
        new = super()._replace(fn)
        new.history = self.history.map(fn) if self.history is not None else None
        return new

    def reserved_nbytes(self) -> int:
        return self.nbytes() + (self.history.nbytes() if self.history is not None else 0)

    def checkpointing(self, time: int) -> bool:
        """Whether a forward of ``time`` tokens keeps the state after each token (see :mod:`hybridlm.rollback`)."""
        return rollback.start_forward(self, time)

    def keep_states(self, **per_token: torch.Tensor) -> None:
        """The states after each token of the forward, ``[batch, time, ...]`` per tensor field (the last entry is
        taken from the state itself, so a crop to the end of a forward gives exactly its final state; a
        one-token forward passes none)."""
        rollback.keep_states(self, per_token)

    def keep_checkpoints(self, tokens: int) -> None:
        self.checkpoint_limit, self.history = tokens, None

    def rewind_blocker(self, tokens: int) -> str | None:
        return rollback.recurrent_blocker(self, tokens)

    def rewind(self, tokens: int) -> None:
        for name, value in self.history.rewind(tokens).items():
            getattr(self, name).copy_(value)


@dataclasses.dataclass
class SSMState(RecurrentState):
    """Mamba / Mamba-2: the causal-conv window ``conv [batch, channels, width - 1]`` (model dtype) and the
    recurrent state ``ssm`` (fp32): ``[batch, d_inner, dstate]`` (Mamba-1) or ``[batch, heads, head_dim,
    dstate]`` (Mamba-2)."""

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclasses.dataclass
class LinearAttentionState(RecurrentState):
    """Performer: the running sum ``kv [batch, heads, head_dim + 1, features]`` (fp32) of ``[v, 1] (outer)
    phi(k)`` (the last row is the normaliser), kept scaled by ``exp(-max)``, where ``max [batch, heads]`` is
    the largest key log-feature seen so far (-inf before the first real key), so that it cannot overflow."""

    kv: torch.Tensor
    max: torch.Tensor


@dataclasses.dataclass
class CompressedKVState(RecurrentState):
    """Causal Linformer: the compressed ``keys, values [batch, heads, rank, head_dim]`` (fp32 sums), ``tokens
    [batch]`` (int64: the real tokens summed into them, what the mean form divides by), and the number of token
    slots seen (the default position of the next token)."""

    keys: torch.Tensor
    values: torch.Tensor
    tokens: torch.Tensor
    seen: int = 0

    def rewind(self, tokens: int) -> None:
        super().rewind(tokens)
        self.seen -= tokens

    @property
    def fixed_step(self) -> bool:
        return False


@dataclasses.dataclass
class StateGroup(LayerState):
    """The states of a layer with several stateful parts, by name (a parallel ``"attention+mamba2"`` layer:
    ``{"attention": KVState, "mamba2": SSMState}``); empty for a layer without state (an MLP-only layer).
    Row selection, cloning, device moves and sizes apply to every part."""

    parts: dict[str, LayerState] = dataclasses.field(default_factory=dict)

    def _replace(self, fn) -> StateGroup:
        return StateGroup({name: part._replace(fn) for name, part in self.parts.items()})

    @property
    def batch_size(self) -> int:
        return next(iter(self.parts.values())).batch_size

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts.values())

    def reserved_nbytes(self) -> int:
        return sum(part.reserved_nbytes() for part in self.parts.values())

    def select(self, index: torch.Tensor) -> StateGroup:
        return StateGroup({name: part.select(index) for name, part in self.parts.items()})  # a part's own select

    def describe(self) -> tuple:
        return tuple((name, part.describe()) for name, part in self.parts.items())

    @property
    def fixed_step(self) -> bool:
        return all(part.fixed_step for part in self.parts.values())

    def advance(self, tokens: int) -> None:
        for part in self.parts.values():
            part.advance(tokens)

    @property
    def croppable(self) -> bool:
        return all(part.croppable for part in self.parts.values())

    def rewind_blocker(self, tokens: int) -> str | None:
        reasons = [f"{name}: {reason}" for name, part in self.parts.items()
                   if (reason := part.rewind_blocker(tokens)) is not None]
        return "; ".join(reasons) or None

    def rewind(self, tokens: int) -> None:
        for part in self.parts.values():
            part.rewind(tokens)

    def keep_checkpoints(self, tokens: int) -> None:
        for part in self.parts.values():
            part.keep_checkpoints(tokens)


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
        self.capacity: int | None = None  # static caches (hybridlm.kv.static): the slots preallocated

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
        convention, so ``crop(0)`` changes nothing); see :mod:`hybridlm.rollback`. ValueError, leaving the cache
        unchanged, past the start, beyond the slots seen, or where a state kept nothing to roll back to."""
        rollback.crop(self, length)

    def keep_checkpoints(self, tokens: int = rollback.AUTO_CHECKPOINT_TOKENS) -> None:
        """Keep, across forwards (one-token decode steps included), what undoing up to ``tokens`` token slots
        needs: each recurrent state's value after each of its last ``tokens`` tokens, the slots a window
        layout overwrote. Memory shows in :meth:`reserved_nbytes`; 0 turns it off (the default: only a forward
        of 2 to 64 tokens keeps its per-token states, until the next forward)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"HybridCache.keep_checkpoints(tokens={tokens!r}): tokens must be an int >= 0")
        for state in self.states:
            state.keep_checkpoints(tokens)

    def activate_past_recording(self) -> None:
        """transformers' name for :meth:`keep_checkpoints` (assisted generation calls it): the last 64 tokens."""
        self.keep_checkpoints()

    @property
    def is_croppable(self) -> bool:
        """Whether every state can roll back at all (H2O's heavy hitters cannot); how far is :meth:`crop`'s
        business."""
        return all(state.croppable for state in self.states)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {v:,} B" for k, v in self.nbytes_by_kind().items())
        return f"HybridCache(batch={self.batch_size}, seen={self.seen}, {kinds})"
