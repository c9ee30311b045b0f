"""How a :class:`~hybridlm.HybridModel` builds its cache and checks a cache it is given.

A cache holds one state per layer, then one per shared-block application; its signature (per state: the kind,
the fixed shapes and the settings that change what the state means) ties it to the model that built it, so that
a cache from another model is an error rather than a silent misreading.
"""

from __future__ import annotations

import torch

from hybridlm.cache import HybridCache, LayerState
from hybridlm.mixers import Mixer
from hybridlm.model.inputs import check_cache_device


class CacheConstruction:
    """Mixed into :class:`~hybridlm.HybridModel`; reads its ``config``, ``layers``, ``shared`` (None without
    shared blocks), ``embed_tokens`` and the per-dtype signature memo ``_signatures``."""

    def new_cache(self, batch_size: int, max_length: int | None = None, device=None, dtype=None,
                  policy=None, static: bool = False) -> HybridCache:
        """An empty cache for ``batch_size`` rows; attention layers preallocate ``max_length`` slots if given.
        ``policy`` (a :class:`~hybridlm.CachePolicy`, or ``{state index: CachePolicy}``) picks the KV layout of
        attention layers (quantized, sinks + window, heavy hitters); it stays with the cache. ``static=True``
        fixes the capacity at ``max_length`` so that a decode step has fixed shapes
        (:mod:`hybridlm.cache.kv.static`)."""
        for name, value, low in (("batch_size", batch_size, 1), ("max_length", max_length, 0)):
            if not (value is None and name == "max_length") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"new_cache: {name} must be an integer >= {low}, got {value!r}")
        device = device if device is not None else self.embed_tokens.weight.device
        dtype = dtype if dtype is not None else self.embed_tokens.weight.dtype
        # under a policy, states are first made without preallocation: a layout the policy swaps in must not cost
        # a transient full-length buffer; the states it leaves as they were are then made with ``max_length``
        kinds, states = self._init_states(batch_size, max_length if policy is None else None, device, dtype)
        if policy is not None:
            from hybridlm.cache.kv.policy import apply_policy

            lean, states = states, apply_policy(states, policy, capacity=max_length)
            if max_length:
                states = [self._init_state(index, batch_size, max_length, device, dtype) if state is lean[index]
                          else state for index, state in enumerate(states)]
        if static:
            from hybridlm.cache.kv.static import make_static

            states = [make_static(state, kind) for state, kind in zip(states, kinds)]
        fixed = [mixer is None or not mixer.grows_with_context for mixer in self._state_mixers()]
        cache = HybridCache(states, kinds, self._signature(dtype), batch_size, device, linear=fixed)
        cache.policy, cache.capacity = policy, max_length if static else None
        return cache

    def _init_states(self, batch_size, max_length, device, dtype) -> tuple[list[str], list[LayerState]]:
        """Kinds and empty states: one per layer, then one per shared-block application."""
        kinds = list(self.config.layer_types)
        states = [block.init_state(batch_size, max_length, device, dtype) for block in self.layers]
        if self.shared is not None:
            kinds += ["shared_attention"] * len(self.shared.layers)
            states += self.shared.init_states(batch_size, max_length, device, dtype)
        return kinds, states

    def _init_state(self, index: int, batch_size, max_length, device, dtype) -> LayerState:
        """The empty state of entry ``index`` (as :meth:`_init_states` orders them)."""
        if index < len(self.layers):
            return self.layers[index].init_state(batch_size, max_length, device, dtype)
        return self.shared.block_of(index - len(self.layers)).attention.init_state(batch_size, max_length, device,
                                                                                     dtype)

    def _signature(self, dtype: torch.dtype) -> tuple:
        """What identifies the states this model reads: per state, its kind, its fixed shapes and the settings
        that change what it means (``Mixer.state_fields``: a sliding window, RoPE)."""
        if dtype not in self._signatures:
            kinds, probe = self._init_states(1, None, "meta", dtype)
            settings = [mixer.state_settings(self.config) if mixer is not None else () for mixer in
                        self._state_mixers()]
            self._signatures[dtype] = tuple(zip(kinds, (s.describe() for s in probe), settings))
        return self._signatures[dtype]

    def _state_mixers(self) -> list[Mixer | None]:
        """The mixer that owns each state (as in :meth:`_init_states`); None for an MLP-only layer."""
        mixers = [block.mixer for block in self.layers]
        if self.shared is not None:
            mixers += [self.shared.block_of(k).attention for k in range(len(self.shared.layers))]
        return mixers

    def _check_cache(self, cache, batch: int, dtype: torch.dtype) -> None:
        """A cache passed to ``forward`` must be a HybridCache on the model's device, built by this model (same
        signature) for ``batch`` rows."""
        if not isinstance(cache, HybridCache):
            raise TypeError(f"cache must be a hybridlm HybridCache (from model.new_cache), got {type(cache).__name__}")
        check_cache_device(cache, self.embed_tokens.weight.device)
        if cache.signature != self._signature(dtype):
            raise ValueError("cache was built for a different model (its layer kinds or state shapes differ "
                             f"from this model's {self.config.layer_types})")
        if cache.batch_size != batch:
            raise ValueError(f"cache holds {cache.batch_size} rows but the input has batch size {batch}")
