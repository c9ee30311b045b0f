"""The memory-tax report: cache bytes per request and per token, by layer kind, at given contexts and KV bit
widths, with the weights' bytes beside them. Nothing is allocated: the model and its cache are built on the
meta device and every KV layout states the bytes it would hold (``predicted_nbytes``, the formula its tests
check against ``nbytes()``).

Reads hybridlm's own configs, every foreign hybrid format (:mod:`hybridlm.formats`) and the plain
transformers people compare against (``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``qwen3``), which become
all-attention hybridlm configs. Sizes are for 16-bit weights and caches; recurrent states stay fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridlm.cache.kv.base import KVLayout
from hybridlm.cache.kv.policy import CachePolicy
from hybridlm.cache.states import StateGroup
from hybridlm.config import HybridConfig

PLAIN_TRANSFORMERS = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
#: settings hybridlm does not implement that change no byte of the weights or the cache, read as the one it does
#: for accounting: NoPE attention (Granite-4.0-H) holds the same keys and values as RoPE attention, and hybridlm's
#: rotary tables are recomputed per call, not stored
MEMORY_NEUTRAL = {"position_embedding_type": ("nope", "rope")}


def plain_transformer_config(raw: dict) -> HybridConfig:
    """An all-attention HybridConfig from a llama / mistral / mixtral / qwen2 / qwen3 ``config.json``. (Qwen3's
    q/k norms and Qwen2's o_proj without bias shift the weight count by a few thousand parameters.)"""
    model_type = raw.get("model_type")
    if model_type not in PLAIN_TRANSFORMERS:
        raise ValueError(f"model_type={model_type!r} is not one of {', '.join(PLAIN_TRANSFORMERS)}")
    layers, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    windowed = model_type in ("mistral", "mixtral") or raw.get("use_sliding_window", False)
    fields = dict(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=layers,
        layer_types=["attention"] * layers, num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, intermediate_size=raw["intermediate_size"],
        rope_theta=raw.get("rope_theta", 10000.0), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        sliding_window=raw.get("sliding_window") if windowed else None,
        attention_bias=model_type == "qwen2" or raw.get("attention_bias", False),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        max_position_embeddings=raw.get("max_position_embeddings"),
    )
    if model_type == "mixtral":
        fields.update(mlp_types=["moe"] * layers, num_experts=raw["num_local_experts"],
                      num_experts_per_tok=raw["num_experts_per_tok"], moe_intermediate_size=raw["intermediate_size"])
    return HybridConfig(**fields)


def read_any_config(source: str | Path | dict) -> HybridConfig:
    """A HybridConfig from a ``config.json`` (a dict, a file or a checkpoint directory) of any kind hybridlm reads."""
    raw = source
    if not isinstance(source, dict):
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"--model: no config file at {path}")
        raw = json.loads(path.read_text())
    raw = {key: MEMORY_NEUTRAL[key][1] if key in MEMORY_NEUTRAL and MEMORY_NEUTRAL[key][0] == value else value
           for key, value in raw.items()}
    if raw.get("model_type") in PLAIN_TRANSFORMERS:
        return plain_transformer_config(raw)
    from hybridlm.formats.base import to_hybrid_config

    return to_hybrid_config(raw)  # hybridlm's own, or a foreign format (by model_type, or mamba-ssm's by its keys)


def _kv_layouts(cache) -> list[tuple[str, KVLayout]]:
    """``(mixer kind, layout)`` of every growing state of ``cache``."""
    found = []
    for kind, state in zip(cache.layer_types, cache.states):
        parts = state.parts.items() if isinstance(state, StateGroup) else [(kind, state)]
        found += [(part_kind, part) for part_kind, part in parts if isinstance(part, KVLayout)]
    return found


def _quantizable(state) -> bool:
    """Whether ``state`` holds KV layouts and every one of them takes ``kv_bits``."""
    parts = state.parts.values() if isinstance(state, StateGroup) else [state]
    layouts = [part for part in parts if isinstance(part, KVLayout)]
    return bool(layouts) and all("kv_bits" in part.policy_features for part in layouts)


def memory_rows(config: HybridConfig, contexts: list[int], batch: int = 1, kv_bits: list[int] = (16,),
                name: str = "model") -> list[dict]:
    """One row per (kv_bits, context): ``bytes_per_token`` (attention KV growth per token, averaged up to the
    context), ``bytes_per_request`` (everything the cache holds at that context), ``kv_bytes``, ``fixed_bytes``
    (states that do not grow), ``by_kind`` (bytes held per layer kind), ``bytes_per_token_by_kind`` (the
    growth per token of each growing kind: attention, mla, shared attention) and ``weight_bytes``. ``kv_bits``
    quantizes the layouts that take it (``KVLayout.policy_features``); the others (MLA latents, sliding-window
    rings) are counted as they are."""
    from hybridlm.model import HybridForCausalLM

    for value, field in [(batch, "batch"), *((c, "context") for c in contexts)]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive integer")
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    weight_bytes = sum(p.numel() for p in model.parameters()) * 2
    rows = []
    default = model.new_cache(batch, device="meta", dtype=torch.bfloat16)
    for bits in kv_bits:
        policy = None if bits == 16 else {index: CachePolicy(kv_bits=bits) for index, state in
                                          enumerate(default.states) if _quantizable(state)}
        cache = model.new_cache(batch, device="meta", dtype=torch.bfloat16, policy=policy)
        layouts = _kv_layouts(cache)
        empty_kv = sum(layout.predicted_nbytes(0) for _, layout in layouts)
        fixed = cache.nbytes() - empty_kv
        empty_by_kind = cache.nbytes_by_kind()
        for context in contexts:
            kv = sum(layout.predicted_nbytes(context) for _, layout in layouts)
            by_kind, growth = dict(empty_by_kind), {}
            for kind, layout in layouts:  # each growing kind (attention, mla) by its own layouts
                grown = layout.predicted_nbytes(context) - layout.predicted_nbytes(0)
                by_kind[kind] += grown
                growth[kind] = growth.get(kind, 0) + grown
            rows.append(dict(model=name, context=context, kv_bits=bits, batch=batch,
                             bytes_per_token=(kv - empty_kv) / context, bytes_per_request=fixed + kv, kv_bytes=kv,
                             fixed_bytes=fixed, by_kind=by_kind, weight_bytes=weight_bytes,
                             bytes_per_token_by_kind={kind: grown / context for kind, grown in growth.items()}))
    return rows


def by_kind_text(row: dict) -> str:
    """A row's bytes per layer kind at its context, with the growth per token of the kinds that grow, e.g.
    ``mamba 15.3 MiB; attention 4.00 GiB (16,384 B/token)``."""
    parts = []
    for kind, held in row["by_kind"].items():
        growth = row["bytes_per_token_by_kind"].get(kind)
        parts.append(f"{kind} {_size(held)}" + (f" ({growth:,.0f} B/token)" if growth else ""))
    return "; ".join(parts)


def _size(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, three significant digits."""
    for unit, power in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 2**power:
            value = n / 2**power
            return f"{value:,.{2 if value < 10 else 1 if value < 100 else 0}f} {unit}"
    return f"{n:,} B"
