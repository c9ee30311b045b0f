"""KV cache layouts and the policy that picks one per attention layer (see :mod:`.policy`)."""

from .base import KVLayout, KVState, KVView
from .layouts import HeavyHitterKV, RingKV, SinkWindowKV
from .paged import PagedKV
from .policy import CachePolicy, apply_policy
from .quantize import QuantizedKV
from .quantized_window import QuantizedSinkWindowKV

__all__ = ["CachePolicy", "HeavyHitterKV", "KVLayout", "KVState", "KVView", "PagedKV", "QuantizedKV",
           "QuantizedSinkWindowKV", "RingKV", "SinkWindowKV", "apply_policy"]
