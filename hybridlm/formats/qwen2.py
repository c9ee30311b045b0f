"""Qwen2 (and Qwen2.5): Llama's layout with biases on q, k and v but not on o, and an optional sliding window
stated by ``layer_types``."""

from __future__ import annotations

from hybridlm.formats.llama import Family

FORMAT = Family("qwen2", "Qwen2ForCausalLM", fixed={"attention_bias": True, "attention_output_bias": False},
                bias_field=None, window="layers").register()

__all__ = ["FORMAT"]
