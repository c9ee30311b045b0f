"""Named model shapes for the CLI, the demo and the benchmarks (random weights; no download)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridlm.config import HybridConfig

_SMALL = dict(
    vocab_size=4096, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
    mamba_d_state=16, mamba2_d_state=64, mamba2_head_dim=32, mamba2_chunk_size=64, performer_num_features=64,
    linformer_rank=64, linformer_max_length=16384,
)

# The bundled models' shapes (hybridlm.bundled_model_dir): a 1:3 attention:Mamba-2 hybrid and an all-attention
# twin with a wider MLP so both have about the same parameter count (vocab_size comes from the tokenizer).
_TINY = dict(
    vocab_size=4096, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, mamba2_d_state=32,
    mamba2_head_dim=32, mamba2_chunk_size=64, max_position_embeddings=None,
)

PRESETS: dict[str, dict] = {
    # Jamba's stack: one attention layer (without RoPE) in eight, MoE in every other layer, dt/B/C norms.
    "jamba-small": dict(_SMALL, layer_pattern="MMMMAMMM", expert_layer_period=2, expert_layer_offset=1,
                        num_experts=4, num_experts_per_tok=2, mamba_dt_norm=True, partial_rotary_factor=0.0),
    "attention-small": dict(_SMALL, layer_pattern="AAAAAAAA"),
    "mamba-small": dict(_SMALL, layer_pattern="MMMMMMMM"),
    "mamba2-small": dict(_SMALL, layer_pattern="SSSSSSSS"),
    "hybrid2-small": dict(_SMALL, layer_pattern="SSSSASSS"),
    "performer-small": dict(_SMALL, layer_pattern="PPPPAPPP"),
    "linformer-small": dict(_SMALL, layer_pattern="LLLLALLL"),
    # One preset per writable foreign format (FORMAT_PRESETS): each exports with save_pretrained(format=...).
    "bamba-small": dict(_SMALL, layer_pattern="SSSASSSA"),
    "mamba2-lm-small": dict(_SMALL, layer_pattern="SSSSSSSS", mlp_types=["none"] * 8),
    "nemotron-h-small": dict(_SMALL, layer_types=["mamba2", "none", "mamba2", "none", "attention", "none", "mamba2",
                                                  "none"],
                             mlp_types=["none", "dense"] * 4, partial_rotary_factor=0.0, mlp_activation="relu2"),
    "lfm2-small": dict(_SMALL, layer_pattern="CCACCACA", attention_qk_norm=True),
    "qwen3-next-small": dict(_SMALL, layer_pattern="DDDADDDA", attention_qk_norm=True, attention_output_gate=True),
    "hybrid-tiny": dict(_TINY, layer_pattern="SSSASSSA", intermediate_size=384),
    # The plain decoder families (attention-small is a Llama): Mistral's window, Qwen2's biases, Qwen3's q/k norms
    "mistral-small": dict(_SMALL, layer_pattern="AAAAAAAA", sliding_window=1024),
    "qwen2-small": dict(_SMALL, layer_pattern="AAAAAAAA", attention_bias=True, attention_output_bias=False),
    "qwen3-small": dict(_SMALL, layer_pattern="AAAAAAAA", attention_qk_norm=True),
    # Mamba-3 at half Mamba-2's state size (the paper's comparison): all-Mamba-3 in mamba-ssm's layout (its norm eps,
    # so that it exports), a 1:3 attention:Mamba-3 hybrid, and hybrid-tiny's twin (parameters within 1%)
    "mamba3-small": dict(_SMALL, layer_pattern="RRRRRRRR", mamba3_d_state=32, mamba3_head_dim=32, rms_norm_eps=1e-5),
    "hybrid3-small": dict(_SMALL, layer_pattern="RRRARRRA", mamba3_d_state=32, mamba3_head_dim=32),
    # ... and in flash-linear-attention's mamba3 (no MLP, its softplus A)
    "fla-mamba3-small": dict(_SMALL, layer_pattern="RRRRRRRR", mlp_types=["none"] * 8, mamba3_d_state=32,
                             mamba3_head_dim=32, rms_norm_eps=1e-5, mamba3_a_activation="softplus"),
    "hybrid3-tiny": dict(_TINY, layer_pattern="RRRARRRA", intermediate_size=384, mamba3_d_state=16,
                         mamba3_head_dim=32),
    "attention-tiny": dict(_TINY, layer_pattern="AAAAAAAA", intermediate_size=512),
}


#: The preset that each writable foreign format holds (``hybridlm convert --to FORMAT`` accepts it).
FORMAT_PRESETS = {"jamba": "jamba-small", "bamba": "bamba-small", "mamba2": "mamba2-lm-small",
                  "nemotron_h": "nemotron-h-small", "lfm2": "lfm2-small", "qwen3_next": "qwen3-next-small",
                  "mamba_ssm": "mamba3-small", "llama": "attention-small", "mistral": "mistral-small",
                  "qwen2": "qwen2-small", "qwen3": "qwen3-small", "mamba3": "fla-mamba3-small"}


def preset(name: str, **overrides) -> HybridConfig:
    """The :class:`~hybridlm.HybridConfig` of preset ``name``; ``overrides`` replace its fields. (HybridConfig is
    imported here so that listing :data:`PRESETS`, as ``hybridlm --help`` does, needs no torch.)"""
    from hybridlm.config import HybridConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return HybridConfig(**{**PRESETS[name], **overrides})
