"""The cache: one state per layer (:mod:`~hybridlm.cache.states`, the KV layouts and :class:`CachePolicy` in
:mod:`~hybridlm.cache.kv`), what rolling back needs of each (:mod:`~hybridlm.cache.rollback`), and the
:class:`HybridCache` that holds them (:mod:`~hybridlm.cache.container`).

The state tier: modules here import only :mod:`hybridlm.ops` and each other, and a state never imports the
container that holds it (``rollback`` <- ``states`` <- ``kv`` <- ``container``). The mixers build and update these
states; the model builds the cache (:mod:`hybridlm.model.cache_construction`).
"""

from hybridlm.cache.container import HybridCache
from hybridlm.cache.kv.base import DenseKV, KVLayout, KVState, KVView, Rotate
from hybridlm.cache.kv.policy import CachePolicy
from hybridlm.cache.states import (
    CompressedKVState,
    LayerState,
    LinearAttentionState,
    RecurrentState,
    SSMState,
    StateGroup,
)

__all__ = ["CachePolicy", "CompressedKVState", "DenseKV", "HybridCache", "KVLayout", "KVState", "KVView", "LayerState",
           "LinearAttentionState", "RecurrentState", "Rotate", "SSMState", "StateGroup"]
