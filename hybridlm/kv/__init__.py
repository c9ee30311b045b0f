"""KV cache layouts and the policy that picks one per attention layer (see :mod:`.policy`)."""

from hybridlm.kv.base import KVLayout, KVState, KVView
from hybridlm.kv.layouts import HeavyHitterKV, RingKV, SinkWindowKV
from hybridlm.kv.paged import PagedKV
from hybridlm.kv.policy import CachePolicy, apply_policy
from hybridlm.kv.quantize import QuantizedKV
from hybridlm.kv.quantized_window import QuantizedSinkWindowKV

__all__ = ["CachePolicy", "HeavyHitterKV", "KVLayout", "KVState", "KVView", "PagedKV", "QuantizedKV",
           "QuantizedSinkWindowKV", "RingKV", "SinkWindowKV", "apply_policy"]
