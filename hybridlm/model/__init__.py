"""The model: blocks, the hybrid stack and the causal LM head as transformers classes (:mod:`~.modeling`), with
what they are made of and checked by (:mod:`~.inputs`, :mod:`~.packing`, :mod:`~.shared_blocks`,
:mod:`~.cache_construction`), their fit to transformers (:mod:`~.hf_compat`), whole checkpoints in and out in
every format (:mod:`~.checkpoint_io`, :func:`load`), the memory they need (:mod:`~.memory`) and int8 weights
for inference (:func:`quantize_weights`).

May import the config, :mod:`hybridlm.formats`, the cache, the mixers, the layers and the ops; nothing here
imports decoding, training or the command line.
"""

from hybridlm.model.loading import load
from hybridlm.model.modeling import (
    HybridBlock,
    HybridCausalLMOutput,
    HybridForCausalLM,
    HybridModel,
    HybridModelOutput,
    HybridPreTrainedModel,
)
from hybridlm.model.weight_quantization import quantize_weights

__all__ = ["HybridBlock", "HybridCausalLMOutput", "HybridForCausalLM", "HybridModel", "HybridModelOutput",
           "HybridPreTrainedModel", "load", "quantize_weights"]
