"""Gemma 2 and Gemma 3 (text): recognised and refused, naming what hybridlm lacks. The (1 + w) norms, the
embedding scale and ``query_pre_attn_scalar`` would map onto existing options (an offset on load,
``embedding_multiplier``, ``attention_scale``); the rest has no option yet."""

from __future__ import annotations

from hybridlm.formats.base import refuse

COMMON = [
    "sandwich norms (post_attention_layernorm and post_feedforward_layernorm on the mixer and MLP outputs beside "
    "the input norms)",
    "per-layer sliding windows (sliding and global attention layers alternate; hybridlm has one sliding_window)",
    "the gelu_pytorch_tanh MLP activation",
]
refuse("gemma2", COMMON + ["attention logit soft-capping (attn_logit_softcapping)",
                           "final logit soft-capping (final_logit_softcapping)"])
for model_type in ("gemma3", "gemma3_text"):
    refuse(model_type, COMMON + ["a second RoPE base for the sliding layers (rope_local_base_freq)"])
