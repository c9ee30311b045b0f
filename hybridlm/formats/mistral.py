"""Mistral: Llama's layout without biases, with one ``sliding_window`` (or none) for every layer."""

from __future__ import annotations

from hybridlm.formats.llama import Family

FORMAT = Family("mistral", "MistralForCausalLM", bias_field=None, window="global").register()

__all__ = ["FORMAT"]
