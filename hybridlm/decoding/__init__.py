"""Decoding: the incremental decoder (chunked prefill, then one token at a time from the cache), its decode step
(eager or compiled), sampling, speculative decoding with exact rollback, and the prefix cache with its files; plus
what a cache policy costs in quality (:mod:`~.policy_quality`).

Named for what it does to a model (``generate()`` is transformers' and still works on hybridlm's models through
:mod:`hybridlm.model.hf_compat`). May import the model, the cache and below; nothing below imports it.
"""

from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.decoding.prefix_cache import PrefixCache
from hybridlm.decoding.sampling import SamplingSettings
from hybridlm.decoding.speculative import SpeculativeDecoding

__all__ = ["IncrementalDecoder", "PrefixCache", "SamplingSettings", "SpeculativeDecoding"]
