"""Qwen3 (dense): Llama's layout with an RMSNorm over each query and key head before RoPE, optional q/k/v/o
biases and an optional sliding window stated by ``layer_types``."""

from __future__ import annotations

from hybridlm.formats.llama import Family

FORMAT = Family("qwen3", "Qwen3ForCausalLM", fixed={"attention_qk_norm": True}, window="layers").register()

__all__ = ["FORMAT"]
