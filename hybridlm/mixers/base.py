"""The mixer contract and the registry of mixer kinds: the single source of truth about each kind.

Every mixer mixes information along the sequence and owns one state type:

* ``init_state(batch_size, max_length=None, device=None, dtype=None)`` returns an empty state;
* ``forward(x [batch, time, hidden], state=None, *, mask=None, positions=None)`` returns ``[batch, time,
  hidden]``. Without a state it is the parallel (training) form; with one it continues from the state over
  ``time >= 1`` new tokens and updates it in place, so prefill, chunked prefill and decode are one call.
  ``mask [batch, time]`` (bool, True = real token) marks padding; a padded token leaves the state exactly as
  it was. With a state, padding may only precede a row's first real token (left padding).
  ``positions [batch, time]`` are the tokens' position ids (for RoPE and position-indexed projections).

A new kind is one module that subclasses :class:`Mixer`, declares its properties as class attributes (see
:class:`Mixer`) and is decorated with :func:`register`. The config, the model, the cache and the docs read
those properties from :data:`MIXERS`; nothing else names a kind.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hybridlm.cache import LayerState

MIXERS: dict[str, type[Mixer]] = {}


def invalid_config(field: str, value, allowed: str) -> ValueError:
    """The error for an invalid ``HybridConfig`` field (raised by the config and by mixers' checks)."""
    return ValueError(f"HybridConfig.{field}={value!r} is invalid: {allowed}")


def register(name: str):
    """Class decorator adding a mixer kind under ``name`` (the name used in ``HybridConfig.layer_types``).

    Refuses a name that a ``layer_types`` entry could not hold, a name or ``pattern_letter`` already taken by
    another class, and malformed declarations."""

    def add(cls: type[Mixer]) -> type[Mixer]:
        if not name.isidentifier() or name == "none":
            raise ValueError(f"mixer kind {name!r}: a name must be an identifier other than 'none' (no '+')")
        _check_declarations(name, cls)
        for other_name, other in MIXERS.items():
            if _same_class(other, cls):
                continue
            if other_name == name:
                raise ValueError(f"mixer kind {name!r} is already registered by {_qualname(other)}")
            if cls.pattern_letter is not None and other.pattern_letter == cls.pattern_letter:
                raise ValueError(f"mixer kind {name!r}: pattern_letter {cls.pattern_letter!r} is already "
                                 f"{other_name!r}'s")
        cls.kind = name
        MIXERS[name] = cls
        return cls

    return add


def pattern_letters() -> dict[str, str]:
    """``layer_pattern`` letters of the registered kinds (``Mixer.pattern_letter``): ``{"A": "attention", ...}``."""
    return {cls.pattern_letter: kind for kind, cls in MIXERS.items() if cls.pattern_letter is not None}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _same_class(a: type, b: type) -> bool:
    """The same class, or the same definition imported again (a reloaded module)."""
    return a is b or _qualname(a) == _qualname(b)


def _check_declarations(name: str, cls: type[Mixer]) -> None:
    letter = cls.pattern_letter
    if letter is not None and not (isinstance(letter, str) and len(letter) == 1 and letter.isupper()):
        raise ValueError(f"mixer kind {name!r}: pattern_letter must be one capital letter or None, got {letter!r}")
    for attribute in ("config_fields", "state_fields"):
        value = getattr(cls, attribute)
        if not isinstance(value, tuple) or not all(isinstance(f, str) for f in value):
            raise ValueError(f"mixer kind {name!r}: {attribute} must be a tuple of HybridConfig field names")
    for attribute in ("causal", "grows_with_context"):
        if not isinstance(getattr(cls, attribute), bool):
            raise ValueError(f"mixer kind {name!r}: {attribute} must be True or False")
    for attribute in ("causal_field", "max_positions_field"):
        field = getattr(cls, attribute)
        if field is not None and field not in cls.config_fields:
            raise ValueError(f"mixer kind {name!r}: {attribute} {field!r} must be one of its config_fields")


class Mixer(nn.Module):
    """Base class of all sequence mixers; see the module docstring for the contract.

    What a kind declares (class attributes; the defaults are those of a causal, fixed-state mixer):

    * ``pattern_letter``: its letter in ``HybridConfig.layer_pattern`` (None: none);
    * ``config_fields``: the ``HybridConfig`` fields it reads besides the stack's own (``hidden_size``,
      ``rms_norm_eps``...); they are validated only when some layer uses the kind;
    * ``state_fields``: the fields whose values change what its state means beyond the state's shapes (a
      cache is refused by a model that differs in one of them);
    * ``causal``: each output depends on its own and earlier tokens only; ``causal_field`` (optional): a
      boolean config field that decides it instead;
    * ``grows_with_context``: its state holds something per token seen (a KV cache), not a fixed size;
    * ``max_positions_field`` (optional): the config field that bounds the positions it accepts;
    * ``weights_read_directly``: the projections whose weight it reads itself, not through the module (which
      quantized or adapted weights cannot serve there: :mod:`hybridlm.model.weight_quantization`);

    and may override the class method ``check_config(config)`` (raise :func:`invalid_config` naming the field
    for settings that do not fit together). ``is_causal`` and ``max_positions`` read the declarations; a kind
    whose causality or limit needs more than one field may override them instead.
    """

    kind: ClassVar[str]
    pattern_letter: ClassVar[str | None] = None
    config_fields: ClassVar[tuple[str, ...]] = ()
    state_fields: ClassVar[tuple[str, ...]] = ()
    causal: ClassVar[bool] = True
    causal_field: ClassVar[str | None] = None
    grows_with_context: ClassVar[bool] = False
    max_positions_field: ClassVar[str | None] = None
    weights_read_directly: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def is_causal(cls, config) -> bool:
        """Whether this kind is causal under ``config``."""
        return bool(getattr(config, cls.causal_field)) if cls.causal_field is not None else cls.causal

    @classmethod
    def max_positions(cls, config) -> int | None:
        """The number of positions this kind accepts under ``config`` (None: unlimited)."""
        return getattr(config, cls.max_positions_field) if cls.max_positions_field is not None else None

    @classmethod
    def check_config(cls, config) -> None:
        """Raise :func:`invalid_config` for settings of ``config`` this kind cannot use (the fields' types and
        ranges are already checked)."""

    @classmethod
    def state_settings(cls, config) -> tuple:
        """``(field, value)`` of each of :attr:`state_fields`: part of the cache signature."""
        return tuple((field, getattr(config, field)) for field in cls.state_fields)

    def init_state(self, batch_size: int, max_length: int | None = None, device=None, dtype=None) -> LayerState:
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        state: LayerState | None = None,
        *,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError


#: The settings of the head layout that Attention, Performer and Linformer share.
HEAD_LAYOUT_FIELDS = ("num_attention_heads", "head_dim", "attention_bias")


def check_head_layout(config) -> None:
    """``head_dim`` must be given when ``num_attention_heads`` does not divide ``hidden_size``."""
    if config.head_dim is None:
        heads, hidden = config.num_attention_heads, config.hidden_size
        raise invalid_config(
            "num_attention_heads", heads,
            f"it does not divide hidden_size={hidden}, so the per-head width is ambiguous: set head_dim "
            f"explicitly (attention is then heads * head_dim wide, not necessarily hidden_size)")


def check_dt_range(config, low: str, high: str) -> None:
    """The time-step initialisation range ``[config.<low>, config.<high>]`` must not be empty."""
    if getattr(config, low) > getattr(config, high):
        raise invalid_config(low, getattr(config, low), f"must be <= {high}={getattr(config, high)}")


def zero_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the padded tokens of ``x [batch, time, ...]``."""
    if mask is None:
        return x
    return x * mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(x.dtype)
