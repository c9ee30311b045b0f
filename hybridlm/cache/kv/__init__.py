"""KV cache layouts and the policy that picks one per attention layer (see :mod:`.policy`). Part of the state
tier: imports the ops and the cache's states only."""

from hybridlm.cache.kv.base import KVLayout, KVState, KVView
from hybridlm.cache.kv.layouts import HeavyHitterKV, RingKV, SinkWindowKV
from hybridlm.cache.kv.paged import PagedKV
from hybridlm.cache.kv.policy import CachePolicy, apply_policy
from hybridlm.cache.kv.quantize import QuantizedKV
from hybridlm.cache.kv.quantized_window import QuantizedSinkWindowKV

__all__ = ["CachePolicy", "HeavyHitterKV", "KVLayout", "KVState", "KVView", "PagedKV", "QuantizedKV",
           "QuantizedSinkWindowKV", "RingKV", "SinkWindowKV", "apply_policy"]
