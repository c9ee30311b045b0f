"""Llama and the plain decoder families built like it: every layer softmax attention (GQA, RoPE with the
``linear``, ``dynamic``, ``llama3`` and ``yarn`` scalings) and a SwiGLU MLP, in transformers'
``model.layers.{i}.self_attn`` / ``mlp`` layout, so a checkpoint is an all-attention :class:`HybridConfig`.
Read and written. A :class:`Family` says what sets one family apart; ``mistral.py``, ``qwen2.py`` and
``qwen3.py`` each declare theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridlm.config import HybridConfig
from hybridlm.formats.base import CheckpointFormat, register
from hybridlm.formats.mapping import (
    ATTENTION_FIELDS,
    COMMON_FIELDS,
    FieldMap,
    RenameRules,
    check_expressible,
    differences,
    head_dim_of,
    other_positions,
    outer_rules,
    renaming,
    require_settings,
    rope_parameters,
    rope_settings,
    same_names,
    unsupported_kinds,
    with_transformers_defaults,
)

FIELDS = FieldMap({**COMMON_FIELDS, **ATTENTION_FIELDS,
                   **same_names("intermediate_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings")})


@dataclass(frozen=True)
class Family:
    """What one plain decoder family fixes, and how it states its options.

    * ``fixed``: HybridConfig fields the family's modeling code hard-wires (Qwen3's q/k norms);
    * ``bias_field``: the config field that switches the q/k/v/o biases on, or None when ``fixed`` says;
    * ``window``: how a sliding window is stated: ``None`` (no window, Llama), ``"global"`` (one
      ``sliding_window`` for every layer, Mistral) or ``"layers"`` (``layer_types`` of ``full_attention`` /
      ``sliding_attention``, Qwen2 and Qwen3).
    """

    model_type: str
    architecture: str
    fixed: dict = field(default_factory=dict)
    bias_field: str | None = "attention_bias"
    window: str | None = None

    def sliding_window(self, fc: dict) -> int | None:
        """The window every layer uses; a mix of windowed and full layers is refused (one window per model)."""
        if self.window == "global":
            return fc.get("sliding_window")
        if self.window is None:
            return None
        kinds = set(fc.get("layer_types") or ["full_attention"])
        if kinds - {"full_attention", "sliding_attention"}:
            raise ValueError(f"{self.model_type} config: layer_types {sorted(kinds)} are not supported (hybridlm "
                             "reads full_attention and sliding_attention)")
        if kinds == {"full_attention", "sliding_attention"}:
            raise ValueError(f"{self.model_type} config: layer_types mixes sliding_attention and full_attention "
                             "layers; hybridlm has one sliding_window for all attention layers")
        return fc["sliding_window"] if kinds == {"sliding_attention"} else None

    def window_fields(self, config: HybridConfig) -> dict:
        """The foreign fields that state ``config.sliding_window``."""
        if self.window == "global":
            return {"sliding_window": config.sliding_window}
        window = config.sliding_window
        kind = "full_attention" if window is None else "sliding_attention"
        return {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0,
                "layer_types": [kind] * config.num_hidden_layers}

    def to_config(self, foreign_config: dict) -> HybridConfig:
        fc = with_transformers_defaults(foreign_config)
        require_settings(fc, {"hidden_act": ("silu",), "mlp_bias": (False,)}, self.model_type)
        n = fc["num_hidden_layers"]
        biases = {"attention_bias": fc[self.bias_field]} if self.bias_field else {}
        fields, rope = FIELDS.to_ours(fc), rope_settings(fc, scaling=True)
        if rope.get("rope_scaling", {}).get("rope_type") == "dynamic":
            fields["max_position_embeddings"] = None  # dynamic NTK exists to run past it: no length limit
        return HybridConfig(
            **fields,
            **rope,
            **biases,
            **self.fixed,
            layer_types=["attention"] * n,
            mlp_types=["dense"] * n,
            head_dim=head_dim_of(fc),
            sliding_window=self.sliding_window(fc),
        )

    def from_config(self, config: HybridConfig) -> dict:
        problems = unsupported_kinds(config, ["attention"], self.model_type)
        if set(config.mlp_types) != {"dense"}:
            problems.append(f"every {self.model_type} layer has a dense MLP; layers "
                            f"{other_positions(config.mlp_types, 'dense')} do not")
        required = {"mlp_activation": "silu", "partial_rotary_factor": 1.0, **self.fixed}
        if self.bias_field is None and "attention_bias" not in self.fixed:
            required["attention_bias"] = False  # the family has no biases (Mistral)
        if "attention_output_bias" not in self.fixed:
            required["attention_output_bias"] = None  # the o_proj bias follows the q/k/v ones
        if self.window is None:
            required["sliding_window"] = None
        problems += differences(config, required)
        check_expressible(self.model_type, problems)
        theirs = FIELDS.to_theirs(config)
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic":  # transformers scales relative to max_position_embeddings
            theirs["max_position_embeddings"] = scaling["original_max_position_embeddings"]
        return {
            "model_type": self.model_type,
            "architectures": [self.architecture],
            **theirs,
            **({self.bias_field: config.attention_bias} if self.bias_field else {}),
            **(self.window_fields(config) if self.window else {}),
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "rope_parameters": rope_parameters(config, partial=False),
        }

    def register(self) -> CheckpointFormat:
        options = frozenset({"rope_scaling", "attention_output_bias"} | set(self.fixed))
        return register(CheckpointFormat(self.model_type, self.to_config, import_weights, self.from_config,
                                         export_weights, options=options))


def decoder_rules(config: HybridConfig) -> RenameRules:
    """transformers' Llama layout against ours."""
    layer = "model.layers.{i}"
    return RenameRules([
        *outer_rules(),
        (f"{layer}.input_layernorm.weight", f"{layer}.input_layernorm.weight"),
        (f"{layer}.post_attention_layernorm.weight", f"{layer}.pre_mlp_layernorm.weight"),
        (f"{layer}.mlp.{{rest}}", f"{layer}.mlp.{{rest}}"),
        (f"{layer}.self_attn.{{rest}}", f"{layer}.mixer.{{rest}}"),
    ])


import_weights, export_weights = renaming(decoder_rules)

FORMAT = Family("llama", "LlamaForCausalLM").register()

__all__ = ["FORMAT", "Family"]
