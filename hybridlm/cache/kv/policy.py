"""CachePolicy: which KV layout each attention layer's state uses.

A policy selects one layout class per attention state (it adds no flags to a layout):

================================  ==================================================
policy                            layout
================================  ==================================================
default (``CachePolicy()``)       :class:`~hybridlm.cache.KVState` (contiguous, full precision)
``kv_bits`` 8, 4 or 2             :class:`~hybridlm.cache.kv.quantize.QuantizedKV` (KIVI)
``window`` (``sink_tokens``)      :class:`~hybridlm.cache.kv.layouts.SinkWindowKV` (StreamingLLM; no sinks: window only)
``kv_bits`` + ``window``          :class:`~hybridlm.cache.kv.quantized_window.QuantizedSinkWindowKV` (both; sinks
optional)
``heavy_hitters`` + ``window``    :class:`~hybridlm.cache.kv.layouts.HeavyHitterKV` (H2O)
``page_size``                     :class:`~hybridlm.cache.kv.paged.PagedKV` (pages from a shared pool, copy-on-write)
================================  ==================================================

Which layouts a policy may replace is each layout class's own answer (:attr:`KVLayout.policy_features`): the
contiguous layout takes every feature. A layer with its own ``sliding_window`` keeps its ring
(:class:`~hybridlm.cache.kv.layouts.RingKV`, with a warning): it is bounded already, and a policy must not let it see
beyond its window. MLA's latent cache (:class:`~hybridlm.cache.kv.latent.LatentKV`) takes none: a policy reaching it
is refused, naming it (give such layers no policy: ``{layer: CachePolicy}`` for the others). Quantization
combines with sinks + window (or a window alone) but not with heavy hitters, and paging with neither: asking for
those is an error. A policy is fixed for the life of a cache.

``state_bits`` (8 or ``"fp8"``, with ``state_rounding`` and ``state_seed``) quantizes the recurrent states instead
(:mod:`~hybridlm.cache.quantized_state`); it leaves attention layers alone, as the KV fields leave recurrent ones,
so one policy for every layer scopes each by layer kind, and ``{state index: CachePolicy}`` by index.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

from hybridlm.cache.kv.base import KVLayout, KVState
from hybridlm.cache.kv.layouts import HeavyHitterKV, SinkWindowKV
from hybridlm.cache.kv.paged import PagedKV
from hybridlm.cache.kv.quantize import BITS, QuantizedKV
from hybridlm.cache.kv.quantized_window import QuantizedSinkWindowKV
from hybridlm.cache.quantized_state import ROUNDINGS, STATE_BITS, fp8_dtype, quantized
from hybridlm.cache.states import LayerState, RecurrentState, StateGroup


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """How attention layers keep their keys and values (see the module docstring for the layout chosen).

    * ``kv_bits``: 16 (the model dtype, unquantized), 8, 4 or 2 (KIVI);
    * ``kv_group_size``: tokens per key scale, channels per value scale (must divide head_dim);
    * ``kv_residual``: recent tokens kept in full precision;
    * ``sink_tokens`` + ``window``: StreamingLLM's attention sinks and recent window;
    * ``heavy_hitters`` + ``window``: H2O's heavy hitters and recent window;
    * ``page_size``: tokens per page of a paged cache (rows share a pool; samples share their prompt's pages);
    * ``state_bits``: None (fp32 recurrent states), 8 (int8) or ``"fp8"`` (float8 e4m3), with per-head fp32 scales;
    * ``state_rounding``: ``"nearest"`` (the default with ``state_bits``), ``"stochastic"`` or ``"feedback"``;
    * ``state_seed``: the seed of stochastic rounding;
    * ``state_windows``: with ``state_bits``, whether the windows of recent inputs (conv windows, Mamba-3's
      previous input) are quantized too (True, the default) or kept as they are (only what accumulates is).
    """

    kv_bits: int = 16
    kv_group_size: int = 32
    kv_residual: int = 128
    sink_tokens: int = 0
    window: int | None = None
    heavy_hitters: int | None = None
    page_size: int | None = None
    state_bits: int | str | None = None
    state_rounding: str | None = None
    state_seed: int = 0
    state_windows: bool = True

    def __post_init__(self):
        def positive(name, value, allow_zero=False):
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
                raise ValueError(f"CachePolicy.{name}={value!r} must be an integer >= {0 if allow_zero else 1}")

        if not isinstance(self.kv_bits, int) or isinstance(self.kv_bits, bool) or self.kv_bits not in (*BITS, 16):
            raise ValueError(f"CachePolicy.kv_bits={self.kv_bits!r} must be one of 2, 4, 8 or 16")
        positive("kv_group_size", self.kv_group_size)
        positive("kv_residual", self.kv_residual, allow_zero=True)
        positive("sink_tokens", self.sink_tokens, allow_zero=True)
        if self.window is not None:
            positive("window", self.window)
        if self.heavy_hitters is not None:
            positive("heavy_hitters", self.heavy_hitters)
        if (self.sink_tokens or self.heavy_hitters) and self.window is None:
            raise ValueError("CachePolicy: sink_tokens and heavy_hitters need window= (the recent tokens kept)")
        if self.window is not None and self.window < self.sink_tokens:
            raise ValueError(f"CachePolicy.window={self.window} is smaller than sink_tokens={self.sink_tokens}")
        if self.heavy_hitters and self.sink_tokens:
            raise ValueError("CachePolicy: choose sink_tokens (StreamingLLM) or heavy_hitters (H2O), not both")
        if self.kv_bits != 16 and self.heavy_hitters:
            raise ValueError(f"CachePolicy: kv_bits={self.kv_bits} with heavy_hitters is not supported; quantize a "
                             "full cache or a sinks + window one (sink_tokens=, window=)")
        if self.page_size is not None:
            positive("page_size", self.page_size)
            if self.kv_bits != 16 or self.window is not None:
                raise ValueError(f"CachePolicy: page_size={self.page_size} with kv_bits / window / sink_tokens / "
                                 "heavy_hitters is not supported; a paged cache holds every token in full precision")
        if isinstance(self.state_bits, bool) or self.state_bits not in (*STATE_BITS, None):
            raise ValueError(f'CachePolicy.state_bits={self.state_bits!r} must be 8, "fp8" or None')
        if self.state_rounding is not None and self.state_bits is None:
            raise ValueError(f"CachePolicy.state_rounding={self.state_rounding!r} needs state_bits= (8 or \"fp8\"): "
                             "unquantized states are not rounded")
        if self.state_rounding is not None and self.state_rounding not in ROUNDINGS:
            raise ValueError(f"CachePolicy.state_rounding={self.state_rounding!r} must be one of "
                             f"{', '.join(map(repr, ROUNDINGS))}")
        positive("state_seed", self.state_seed, allow_zero=True)
        if not isinstance(self.state_windows, bool):
            raise ValueError(f"CachePolicy.state_windows={self.state_windows!r} must be True or False")
        if not self.state_windows and self.state_bits is None:
            raise ValueError("CachePolicy.state_windows=False needs state_bits= (8 or \"fp8\"): unquantized states "
                             "keep every field as it is")
        if self.state_bits == "fp8":
            fp8_dtype()

    @property
    def features(self) -> frozenset[str]:
        """The :data:`~hybridlm.cache.kv.base.POLICY_FEATURES` this policy asks of a layout (none: the default)."""
        asked = {"kv_bits": self.kv_bits != 16, "window": self.window is not None,
                 "heavy_hitters": self.heavy_hitters is not None, "page_size": self.page_size is not None}
        return frozenset(name for name, on in asked.items() if on)

    @property
    def is_default(self) -> bool:
        return not self.features and self.state_bits is None

    def quantize_state(self, state: RecurrentState, where: str) -> RecurrentState:
        """``state`` (a recurrent state) quantized under ``state_bits``; itself when the policy has none or its
        class quantizes no field (warned)."""
        if self.state_bits is None:
            return state
        if self.state_bits == "fp8":
            fp8_dtype(next(iter(state._tensors().values())).device)
        new = quantized(state, self.state_bits, self.state_rounding or "nearest", self.state_seed, self.state_windows)
        if new is None:
            _say_once(f"cache_policy: state_bits is not applied to {type(state).__name__} states ({where}), which "
                      "stay in full precision (no field of theirs is quantized under this policy: "
                      "RecurrentState.quantized_fields, state_windows)")
            return state
        return new

    def layout(self, template: KVState, capacity: int | None = None) -> KVLayout:
        """The empty state this policy gives an attention layer whose default state is ``template``; a paged
        pool starts with room for ``capacity`` tokens per row (default: the template's preallocated slots)."""
        batch, heads, _, dim = template.keys.shape
        where = dict(device=template.keys.device, dtype=template.keys.dtype)
        if self.page_size is not None:
            capacity = template.keys.shape[2] if capacity is None else capacity
            return PagedKV.empty(batch, heads, dim, page_size=self.page_size, capacity=capacity, **where)
        if self.heavy_hitters:
            return HeavyHitterKV.empty(batch, heads, dim, heavy=self.heavy_hitters, window=self.window, **where)
        if self.window is not None and self.kv_bits == 16:
            return SinkWindowKV.empty(batch, heads, dim, sinks=self.sink_tokens, window=self.window, **where)
        if self.kv_bits == 16:
            return template
        if dim % self.kv_group_size:
            raise ValueError(f"CachePolicy.kv_group_size={self.kv_group_size} does not divide the attention "
                             f"head_dim={dim}")
        if dim * self.kv_bits % 8:
            raise ValueError(f"CachePolicy.kv_bits={self.kv_bits}: head_dim={dim} codes do not fill whole bytes")
        quantized = dict(bits=self.kv_bits, group=self.kv_group_size, residual=self.kv_residual, **where)
        if self.window is not None:
            return QuantizedSinkWindowKV.empty(batch, heads, dim, sinks=self.sink_tokens, window=self.window,
                                               **quantized)
        return QuantizedKV.empty(batch, heads, dim, **quantized)


def apply_policy(states: list[LayerState], policy: CachePolicy | Mapping[int, CachePolicy],
                 capacity: int | None = None) -> list[LayerState]:
    """``states`` (one per cache entry, as ``new_cache`` makes them) with each default attention state replaced
    by the policy's layout; a state the policy leaves as it was is returned itself. ``policy`` is one policy for
    every layer or ``{state index: policy}``; ``capacity``: see :meth:`CachePolicy.layout`."""
    if not isinstance(policy, (CachePolicy, Mapping)):
        raise TypeError(f"cache_policy must be a hybridlm CachePolicy or {{layer: CachePolicy}}, got "
                        f"{type(policy).__name__}")
    per_layer = policy if isinstance(policy, Mapping) else dict.fromkeys(range(len(states)), policy)
    for index, layer_policy in per_layer.items():
        if not isinstance(index, int) or not 0 <= index < len(states) or not isinstance(layer_policy, CachePolicy):
            raise ValueError(f"cache_policy: {{layer: CachePolicy}} needs layers in [0, {len(states)}), got "
                             f"{index!r}: {type(layer_policy).__name__}")
    replaced = [_apply(state, per_layer.get(i), capacity, f"state {i}") for i, state in enumerate(states)]
    idle = [i for i, layer_policy in per_layer.items()
            if layer_policy.features and layer_policy.state_bits is None and not _has_attention(states[i])]
    if isinstance(policy, Mapping) and idle:
        _say_once(f"cache_policy: states {idle} hold no attention keys and values; their policies change nothing")
    elif idle and not any(_has_attention(state) for state in states):
        _say_once("cache_policy: this model has no attention layers; the policy changes nothing")
    return replaced


def _apply(state: LayerState, policy: CachePolicy | None, capacity: int | None, where: str) -> LayerState:
    """``state`` under ``policy``: the policy's layout where the state's class takes every feature asked; else the
    state itself (warned) where its class says why it may stay, and a ValueError naming it otherwise."""
    if policy is None or policy.is_default:
        return state
    if isinstance(state, StateGroup):
        parts = {name: _apply(part, policy, capacity, f"{where} ({name})") for name, part in state.parts.items()}
        return state if all(parts[name] is part for name, part in state.parts.items()) else StateGroup(parts)
    if isinstance(state, RecurrentState):
        return policy.quantize_state(state, where)
    if not isinstance(state, KVLayout) or not policy.features:
        return state
    missing = sorted(policy.features - state.policy_features)
    if not missing:
        return policy.layout(state, capacity)
    layout, asked = type(state).__name__, " + ".join(missing)
    if state.kept_under_policy is None:
        takes = ", ".join(sorted(state.policy_features)) or "no policy"
        raise ValueError(f"cache_policy: {asked} cannot apply to {where}, a {layout} (it takes {takes}); give that "
                         "layer no policy ({layer: CachePolicy} for the others)")
    _say_once(f"cache_policy: {asked} is not applied to {layout} layers, which stay as they are: "
              f"{state.kept_under_policy}")
    return state


def _has_attention(state: LayerState) -> bool:
    if isinstance(state, StateGroup):
        return any(_has_attention(part) for part in state.parts.values())
    return isinstance(state, KVLayout)


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, stacklevel=3)
