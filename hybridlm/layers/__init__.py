"""Building blocks beside the mixers: the projection (``Linear``), norms, rotary embeddings (with RoPE scaling),
MLP / MoE and the short causal conv. Import the modules directly (``hybridlm.layers.norms``, ...); this tier
imports only :mod:`hybridlm.ops`."""
