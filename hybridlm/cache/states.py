"""Per-layer state types (the KV layouts' base classes are in :mod:`hybridlm.cache.kv.base`).

Every state keeps its batch rows on dim 0 of each tensor, so selecting rows (beam search, dropping finished
sequences), cloning and moving devices are the same operation for every kind. Sizes, per batch row:

* ``KVState`` (attention, the contiguous layout): keys and values ``[kv_heads, length, head_dim]`` plus an
  int64 padding count: ``2 * kv_heads * length * head_dim * e + 8``. The other KV layouts (ring window,
  sinks + window, quantized, heavy hitters: :mod:`hybridlm.cache.kv`) each state their own formula in
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
from typing import ClassVar, NamedTuple

import torch

from hybridlm.cache import rollback


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layout_of(value) -> object:
    """A hashable description of what compiled code specialises on in ``value`` (see
    :meth:`LayerState.compile_layout`)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.dtype, value.device
    if isinstance(value, LayerState):
        return value.compile_layout()
    if isinstance(value, dict):
        return tuple((key, layout_of(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(layout_of(item) for item in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else type(value)


@dataclasses.dataclass
class LayerState:
    """Base of all states: tensor fields have the batch on dim 0; other fields are plain metadata."""

    #: plain fields that every step advances outside a compiled step (in :meth:`advance`); the step never reads them
    step_counters: ClassVar[tuple[str, ...]] = ()
    #: whether outputs depend, beyond rounding, on how a prefill is cut into forwards (H2O evicts after each one,
    #: KIVI reads a forward's own tokens in full precision, sinks + window positions a chunk at its first token)
    chunk_dependent: ClassVar[bool] = False

    def compile_layout(self) -> tuple:
        """What a compiled decode step specialises on in this state
        (:class:`~hybridlm.decoding.decode_step.DecodeStep`): each
        tensor field's shape, strides, dtype and device, each plain field's value except :attr:`step_counters`,
        the type of anything else.

        A decode step asks for it every token, so it is kept until a field is assigned (:meth:`__setattr__`),
        unless a field holds a dict or list (which changes without an assignment). In-place changes to a state
        tensor's shape or strides (``resize_``, ``set_``, ``transpose_``) would go unseen: no state makes them."""
        layout = self.__dict__.get("_compile_layout")
        if layout is None:
            values = [getattr(self, field.name) for field in dataclasses.fields(self)
                      if field.name not in self.step_counters]
            layout = (type(self), *map(layout_of, values))
            if not any(isinstance(value, (dict, list)) for value in values):
                object.__setattr__(self, "_compile_layout", layout)
        return layout

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name not in self.step_counters:  # a counter (advanced every step) is not part of the layout
            self.__dict__.pop("_compile_layout", None)  # what it described may have changed

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
        needs; see :mod:`hybridlm.cache.kv.static`)."""
        return True

    def advance(self, tokens: int) -> None:
        """Called by :meth:`HybridCache.advance` after each forward, outside any compiled step: Python counters
        that the update itself must not touch move here."""

    def one_token_at_a_time(self, time: int) -> bool:
        """Whether a forward of ``time`` tokens must reach this state as ``time`` one-token forwards (which
        :func:`hybridlm.mixers.segments.mix` then makes), because a multi-token one would compute otherwise than
        the decode steps it stands for."""
        return False

    # --- rollback (hybridlm.cache.rollback) -----------------------------------------------------------

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

class Quantizable(NamedTuple):
    """How ``CachePolicy(state_bits=...)`` quantizes one tensor field of a recurrent state
    (:mod:`hybridlm.cache.quantized_state`)."""

    #: the dims (after the batch, dim 0) that keep a scale of their own: ``(1,)`` one per head
    scale_dims: tuple[int, ...] = (1,)
    #: whether every token adds to the field (an SSM state, a running sum), so that its rounding errors
    #: accumulate; a field written whole and read for a few tokens (a conv window, a previous input) is not
    accumulates: bool = True


#: a conv window ``[batch, channels, width - 1]``: one scale per held token (each column is written once)
WINDOW = Quantizable(scale_dims=(2,), accumulates=False)


@dataclasses.dataclass
class RecurrentState(LayerState):
    """A fixed-size state that every token updates (an SSM, a conv window, linear-attention sums). It rolls back
    to kept checkpoints (:class:`~hybridlm.cache.rollback.StateHistory`): its mixer calls :meth:`checkpointing` before
    a forward updates it and, when that says so, :meth:`keep_states` after."""

    #: the tensor fields a quantized state policy stores as codes and scales (the others stay as they are)
    quantized_fields: ClassVar[dict[str, Quantizable]] = {}

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
        """Whether a forward of ``time`` tokens keeps the state after each token (see
        :mod:`hybridlm.cache.rollback`)."""
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

    quantized_fields = {"ssm": Quantizable(), "conv": WINDOW}

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclasses.dataclass
class LinearAttentionState(RecurrentState):
    """Performer: the running sum ``kv [batch, heads, head_dim + 1, features]`` (fp32) of ``[v, 1] (outer)
    phi(k)`` (the last row is the normaliser), kept scaled by ``exp(-max)``, where ``max [batch, heads]`` is
    the largest key log-feature seen so far (-inf before the first real key), so that it cannot overflow."""

    quantized_fields = {"kv": Quantizable()}

    kv: torch.Tensor
    max: torch.Tensor


@dataclasses.dataclass
class CompressedKVState(RecurrentState):
    """Causal Linformer: the compressed ``keys, values [batch, heads, rank, head_dim]`` (fp32 sums), ``tokens
    [batch]`` (int64: the real tokens summed into them, what the mean form divides by), and the number of token
    slots seen (the default position of the next token)."""

    quantized_fields = {"keys": Quantizable(), "values": Quantizable()}

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

    @property
    def chunk_dependent(self) -> bool:
        return any(part.chunk_dependent for part in self.parts.values())

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
