"""HybridConfig: which mixer and which MLP each layer uses, and the settings of every kind.

The stack is described per layer by ``layer_types`` (mixer names) and ``mlp_types``; both can be
given in a short form instead:

* ``layer_pattern``: one letter per layer, see :data:`PATTERN_LETTERS` (``"MMMMAMMM"``);
* Jamba's period/offset form: layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset``,
  otherwise ``ssm_layer_type``; it is MoE when ``i % expert_layer_period == expert_layer_offset``.

The resolved lists are what the model reads and what ``save_pretrained`` writes. A ``layer_types`` entry
may also be ``"none"`` (an MLP-only layer) or several mixers joined by ``+`` (``"attention+mamba2"``: both
read the same normalised input and their outputs are summed, as in Falcon-H1).
"""

from __future__ import annotations

import difflib
import math

from transformers import GenerationConfig, PreTrainedConfig

from hybridlm.config_rules import check_dtype, check_field, check_router, field_hints
from hybridlm.mixers import MIXERS, Mixer, invalid_config, mixer_class, mixer_parts, pattern_letters
from hybridlm.mixers.shared_blocks import SharedBlock
from hybridlm.remote_code import AUTO_MAP

MLP_TYPES = ("dense", "moe", "none")
MLP_ACTIVATIONS = ("silu", "gelu", "relu2")
#: ``mamba2_norm``: "gated" rms_norm(y * silu(z)) (Mamba-2); "norm_before_gate" rms_norm(y) * silu(z);
#: "none" y * silu(z) (the last two: Falcon-H1's ``mamba_norm_before_gate`` / ``mamba_rms_norm=False``).
MAMBA2_NORMS = ("gated", "norm_before_gate", "none")
#: ``moe_router``: "softmax" (softmax, then top-k); "sigmoid" (sigmoid scores, top-k chosen by score plus a
#: per-expert selection bias, optionally within the best ``moe_topk_groups`` of ``moe_num_groups`` groups:
#: DeepSeek-V3 / Nemotron-H).
MOE_ROUTERS = ("softmax", "sigmoid")

# Keys that transformers' own machinery may hand to a config besides its fields.
_TRANSFORMERS_KWARGS = {
    "model_type", "torch_dtype", "name_or_path", "_name_or_path", "_commit_hash", "output_attentions",
    "attn_implementation", "experts_implementation", "per_layer_config", "num_labels",
    "_attn_implementation_internal", "_experts_implementation_internal", "auto_map",
}
# The fields that describe the layer plan: checked before the plan is resolved.
_PLAN_FIELDS = ("layer_types", "layer_pattern", "num_hidden_layers", "attn_layer_period", "attn_layer_offset",
                "ssm_layer_type", "mlp_types", "expert_layer_period", "expert_layer_offset")


def __getattr__(name: str):
    """``MIXER_TYPES`` (the registered kinds) and ``PATTERN_LETTERS`` (letter -> kind) are read from the
    registry when asked for, so that kinds registered later are included."""
    if name == "MIXER_TYPES":
        return tuple(MIXERS)
    if name == "PATTERN_LETTERS":
        return pattern_letters()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fail(field: str, value, allowed: str) -> None:
    raise invalid_config(field, value, allowed)


class HybridConfig(PreTrainedConfig):
    """Configuration of a hybrid stack. Every field is documented in ``docs/config.md``."""

    model_type = "hybridlm"

    # --- the stack -------------------------------------------------------------------------
    vocab_size: int = 32000
    hidden_size: int = 512
    num_hidden_layers: int | None = None
    layer_types: list[str] | None = None
    layer_pattern: str | None = None
    attn_layer_period: int | None = None
    attn_layer_offset: int | None = None
    ssm_layer_type: str = "mamba"
    mlp_types: list[str] | None = None
    expert_layer_period: int | None = None
    expert_layer_offset: int | None = None
    max_position_embeddings: int | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # --- softmax attention (also the head layout of Performer and Linformer) -----------------
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "dynamic" | "llama3" | "yarn", ...}: layers/rotary.py
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    attention_bias: bool = False  # biases on q, k, v and o
    attention_output_bias: bool | None = None  # o_proj's bias alone; None: attention_bias (Qwen2: False, q/k/v: True)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attention_qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (LFM2, Qwen3-Next)
    attention_output_gate: bool = False  # o_proj(attention * sigmoid(gate_proj(x))) (Qwen3-Next)
    attention_qk_norm_whole: bool = False  # the q/k RMSNorms span all heads together, not each head (OLMo)
    post_norm_layers: list[int] | None = None  # layers that norm their mixer and MLP outputs, not inputs (OLMo)

    # --- Mamba-1 (selective scan, the Jamba mixer) ---------------------------------------------
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_norm: bool = False
    mamba_dt_norm_learnable: bool = True  # False: the dt/B/C norms have no weight (Falcon-Mamba)
    mamba_dt_norm_eps: float | None = None  # eps of the dt/B/C norms; None: rms_norm_eps
    mamba_dt_min: float = 0.001
    mamba_dt_max: float = 0.1
    mamba_dt_init_floor: float = 1e-4

    # --- Mamba-2 (SSD) ----------------------------------------------------------------------
    mamba2_d_state: int = 64
    mamba2_d_conv: int = 4
    mamba2_expand: int = 2
    mamba2_head_dim: int = 64
    mamba2_n_groups: int = 1
    mamba2_chunk_size: int = 256
    mamba2_conv_bias: bool = True
    mamba2_proj_bias: bool = False
    mamba2_dt_min: float = 0.001
    mamba2_dt_max: float = 0.1
    mamba2_dt_init_floor: float = 1e-4
    mamba2_dt_limit: list[float] | None = None
    mamba2_inner_size: int | None = None  # SSD channels (heads * head_dim); None: mamba2_expand * hidden_size
    mamba2_norm: str = "gated"  # see MAMBA2_NORMS

    # --- Mamba-3 (trapezoidal, rotary, SISO or MIMO; mamba-ssm's Mamba3) --------------------------
    mamba3_d_state: int = 128
    mamba3_expand: int = 2
    mamba3_head_dim: int = 64
    mamba3_n_groups: int = 1
    mamba3_rope_fraction: float = 0.5  # 0.5 or 1.0: the share of the state's entries the data-dependent angles turn
    mamba3_dt_min: float = 0.001
    mamba3_dt_max: float = 0.1
    mamba3_dt_init_floor: float = 1e-4
    mamba3_a_floor: float = 1e-4  # the data-dependent A is at most -mamba3_a_floor
    mamba3_outproj_norm: bool = False  # a per-head RMSNorm before the SiLU(z) gate (mamba-ssm's is_outproj_norm)
    mamba3_mimo: bool = False
    mamba3_mimo_rank: int = 4  # MIMO only
    mamba3_chunk_size: int = 64
    mamba3_a_activation: str = "heavy_tail"  # A = -f(dd_A): "heavy_tail" (mamba-ssm) or "softplus" (fla's mamba3)

    # --- linear attention -------------------------------------------------------------------
    performer_num_features: int = 64
    performer_redraw_interval: int | None = None
    linformer_rank: int = 64
    linformer_max_length: int = 4096
    linformer_causal: bool = True
    linformer_prefix_reduction: str = "mean"  # causal form: "mean" or "sum" of the compressed prefix

    # --- Gated DeltaNet (Qwen3-Next) and LFM2's gated short convolution -------------------------
    deltanet_num_key_heads: int = 4
    deltanet_num_value_heads: int | None = None  # None: deltanet_num_key_heads; else a multiple of it
    deltanet_key_head_dim: int = 64
    deltanet_value_head_dim: int = 64
    deltanet_conv_size: int = 4
    deltanet_chunk_size: int = 64
    deltanet_beta_scale: float = 1.0  # beta = scale * sigmoid(b); 2.0 allows negative eigenvalues (OLMo-Hybrid)
    deltanet_norm_eps: float | None = None  # eps of the gated output norm; None: rms_norm_eps
    short_conv_size: int = 3
    short_conv_bias: bool = False

    # --- multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi Linear) ------------------------
    mla_kv_lora_rank: int = 512  # width of the cached KV latent
    mla_q_lora_rank: int | None = None  # None: a full-rank q_proj
    mla_qk_nope_head_dim: int = 128
    mla_qk_rope_head_dim: int = 64  # the decoupled part, one key shared by all heads
    mla_v_head_dim: int = 128
    mla_rope: bool = True  # RoPE on the decoupled part (Kimi Linear: none)

    # --- MLP / MoE --------------------------------------------------------------------------
    intermediate_size: int | None = None
    mlp_activation: str = "silu"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    moe_renormalize: bool = False
    moe_router: str = "softmax"  # see MOE_ROUTERS
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scaling: float = 1.0  # the routed experts' weights are multiplied by this
    moe_shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(a linear gate) (Qwen3-Next)
    router_aux_loss_coef: float = 0.001

    # --- scalar multipliers (Granite, Falcon-H1) -------------------------------------------------
    embedding_multiplier: float = 1.0  # scales the token embeddings
    residual_multiplier: float = 1.0  # scales each mixer and MLP output before its residual add
    logits_multiplier: float = 1.0  # scales the logits

    # --- shared transformer blocks (Zamba2), see hybridlm/mixers/shared_blocks.py -------------------------
    shared_block_layers: list[int] | None = None  # layers whose mixer input gets a shared block's output
    num_shared_blocks: int = 1  # application k uses shared block k % num_shared_blocks
    shared_block_adapter_rank: int = 0  # > 0: per-application LoRA adapters on the shared MLP's gate/up
    shared_block_attention_adapters: bool = False  # also on the shared attention's q, k, v

    def __post_init__(self, **kwargs):
        unknown = sorted(set(kwargs) - _TRANSFORMERS_KWARGS - set(GenerationConfig._get_default_generation_params()))
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, [f.name for f in self.__dataclass_fields__.values()], n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"unknown HybridConfig field(s): {', '.join(hints)}")
        if kwargs.get("model_type", self.model_type) != self.model_type:
            raise ValueError(
                f"this config is for model_type={kwargs['model_type']!r}, not {self.model_type!r}; "
                "load foreign checkpoints with hybridlm.load() or HybridForCausalLM.from_pretrained()"
            )
        kwargs.pop("model_type", None)
        check_dtype(self.dtype if self.dtype is not None else kwargs.get("torch_dtype"))
        mixers, mlps = self.layer_types, self.mlp_types
        super().__post_init__(**kwargs)
        # transformers renames legacy layer names ("mamba", "attention") in place; ours are not legacy.
        self.layer_types, self.mlp_types = mixers, mlps
        self._check_fields(_PLAN_FIELDS)
        self._resolve_layers()
        # a saved config encodes infinities as {"__float__": "Infinity"} (transformers' JSON form)
        self.mamba2_dt_limit = self._decode_special_floats(self.mamba2_dt_limit)
        # a field that only mixer kinds absent from the stack read is not checked (``Mixer.config_fields``)
        owned = {field for cls in MIXERS.values() for field in cls.config_fields}
        used = {field for cls in self.used_mixers.values() for field in cls.config_fields}
        self._check_fields([name for name in field_hints(HybridConfig) if name not in _PLAN_FIELDS], skip=owned - used)
        self._resolve_sizes()
        self._check()

    # --- field types and ranges --------------------------------------------------------------

    def _check_fields(self, names, skip=frozenset()) -> None:
        """Type and range of each of ``names`` but those in ``skip``."""
        hints = field_hints(HybridConfig)
        for name in names:
            if name in skip:
                continue
            value = getattr(self, name)
            if name == "mamba_dt_rank" and value == "auto":
                continue
            check_field(name, value, int if name == "mamba_dt_rank" else hints[name],
                        finite=name != "mamba2_dt_limit")

    # --- resolution of the short forms ------------------------------------------------------

    def _resolve_layers(self) -> None:
        plans, jamba_default = self._mixer_plans()
        self.layer_types = self._agree("layer_types", plans, jamba_default)
        if not self.layer_types:
            _fail("layer_types", self.layer_types, "a model needs at least one layer")
        if self.num_hidden_layers is None:
            self.num_hidden_layers = len(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            _fail("num_hidden_layers", self.num_hidden_layers, f"the layer plan has {len(self.layer_types)} layers")
        for i, entry in enumerate(self.layer_types):
            try:
                mixer_class(entry)
            except ValueError as error:
                _fail(f"layer_types[{i}]", entry, str(error))
        self.mlp_types = self._agree("mlp_types", self._mlp_plans(), ["dense"] * self.num_hidden_layers)
        if len(self.mlp_types) != self.num_hidden_layers:
            _fail("mlp_types", self.mlp_types, f"need one entry per layer ({self.num_hidden_layers})")
        for i, kind in enumerate(self.mlp_types):
            if kind not in MLP_TYPES:
                _fail(f"mlp_types[{i}]", kind, f"allowed MLP types are {MLP_TYPES}")
            if kind == "none" and self.layer_types[i] == "none":
                _fail(f"mlp_types[{i}]", kind, "layer_types[i] is 'none' too: a layer needs a mixer or an MLP")

    @staticmethod
    def _agree(field: str, plans: dict[str, list[str] | None], default: list[str]) -> list[str]:
        """The one plan that every given form describes (a saved config carries the list and its short form)."""
        given = {form: plan for form, plan in plans.items() if plan is not None}
        if not given:
            return default
        (first_form, first), *rest = given.items()
        for form, plan in rest:
            if plan != first:
                _fail(field, first, f"{first_form} gives {first} but {form} gives {plan}")
        return list(first)

    def _mixer_plans(self) -> tuple[dict[str, list[str] | None], list[str]]:
        plans: dict[str, list[str] | None] = {"layer_types": self.layer_types, "layer_pattern": None}
        if self.layer_pattern is not None:
            letters = pattern_letters()
            if not self.layer_pattern or set(self.layer_pattern) - set(letters):
                _fail("layer_pattern", self.layer_pattern, f"letters must be from {letters}")
            plans["layer_pattern"] = [letters[c] for c in self.layer_pattern]
        if self.ssm_layer_type not in MIXERS:
            _fail("ssm_layer_type", self.ssm_layer_type, f"allowed mixers are {tuple(MIXERS)}")
        n = self.num_hidden_layers if self.num_hidden_layers is not None else 8
        period = self.attn_layer_period if self.attn_layer_period is not None else 8
        offset = self.attn_layer_offset if self.attn_layer_offset is not None else 4
        if not offset < period:
            _fail("attn_layer_offset", offset, f"need 0 <= offset < attn_layer_period={period}")
        jamba = ["attention" if i % period == offset else self.ssm_layer_type for i in range(n)]
        plans["attn_layer_period"] = jamba if self.attn_layer_period is not None else None
        return plans, jamba

    def _mlp_plans(self) -> dict[str, list[str] | None]:
        n = self.num_hidden_layers
        plans: dict[str, list[str] | None] = {"mlp_types": self.mlp_types, "expert_layer_period": None}
        if self.expert_layer_period is not None:
            period, offset = self.expert_layer_period, self.expert_layer_offset or 0
            if not offset < period:
                _fail("expert_layer_offset", offset, f"need 0 <= offset < expert_layer_period={period}")
            plans["expert_layer_period"] = ["moe" if i % period == offset else "dense" for i in range(n)]
        return plans

    def _resolve_sizes(self) -> None:
        """Defaults computed from other fields (each only from fields already checked or left unused)."""
        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = heads
        # with heads that do not divide hidden_size, head_dim stays None: attention kinds then demand it
        if self.head_dim is None and isinstance(heads, int) and heads > 0 and self.hidden_size % heads == 0:
            self.head_dim = self.hidden_size // heads
        if self.intermediate_size is None:
            self.intermediate_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mamba_dt_rank == "auto":
            self.mamba_dt_rank = math.ceil(self.hidden_size / 16)
        if self.mamba2_dt_limit is None:
            self.mamba2_dt_limit = [0.0, float("inf")]
        if isinstance(self.mamba2_dt_limit, (list, tuple)):
            self.mamba2_dt_limit = [float(v) if isinstance(v, (int, float)) else v for v in self.mamba2_dt_limit]
        if self.mamba_dt_norm_eps is None:
            self.mamba_dt_norm_eps = self.rms_norm_eps
        if self.deltanet_num_value_heads is None:
            self.deltanet_num_value_heads = self.deltanet_num_key_heads

    # --- settings that must agree with each other -------------------------------------------------

    def _check(self) -> None:
        for name, cls in self.used_mixers.items():
            unknown = [field for field in cls.config_fields if field not in self.__dataclass_fields__]
            if unknown:
                raise ValueError(f"mixer kind {name!r} declares config_fields {unknown} that HybridConfig lacks")
            cls.check_config(self)
        for name, allowed in (("mlp_activation", MLP_ACTIVATIONS), ("mamba2_norm", MAMBA2_NORMS),
                              ("moe_router", MOE_ROUTERS)):
            if getattr(self, name) not in allowed:
                _fail(name, getattr(self, name), f"allowed: {allowed}")
        if self.num_experts_per_tok > self.num_experts:
            _fail("num_experts_per_tok", self.num_experts_per_tok, f"must be <= num_experts={self.num_experts}")
        check_router(self)
        self._check_shared_blocks()
        n = self.num_hidden_layers
        if self.post_norm_layers is not None and not all(0 <= i < n for i in self.post_norm_layers):
            _fail("post_norm_layers", self.post_norm_layers, f"must be layer indices in [0, {n})")

    def _check_shared_blocks(self) -> None:
        layers = self.shared_block_layers
        if layers is None:
            return
        if not layers or sorted(set(layers)) != list(layers) or not all(0 <= i < self.num_hidden_layers
                                                                         for i in layers):
            _fail("shared_block_layers", layers,
                  f"must be increasing, distinct layer indices in [0, {self.num_hidden_layers})")
        if self.num_shared_blocks > len(layers):
            _fail("num_shared_blocks", self.num_shared_blocks, f"must be in [1, {len(layers)}] (one per application "
                  "at most)")
        if self.shared_block_attention_adapters and self.shared_block_adapter_rank == 0:
            _fail("shared_block_attention_adapters", True, "needs shared_block_adapter_rank > 0")

    def to_dict(self) -> dict:
        """transformers' form, without ``num_hidden_layers`` (``len(layer_types)``): the base class's validation,
        which ``Trainer.train(resume_from_checkpoint=...)`` runs on ``config.json`` through
        ``PreTrainedConfig.from_json_file``, checks ``layer_types`` against transformers' own layer names only
        when ``num_hidden_layers`` is present, and mixer names are not among them."""
        config = super().to_dict()
        config.pop("num_hidden_layers", None)
        config["auto_map"] = AUTO_MAP  # tools load it with trust_remote_code (hybridlm.remote_code)
        return config

    def validate(self) -> None:
        """transformers' class validators, minus its check of ``layer_types`` against its own layer names
        (ours are mixer names, checked in ``__post_init__``)."""
        for validator in PreTrainedConfig.__class_validators__:
            if validator.__name__ != "validate_layer_type":
                validator(self)

    # --- derived quantities -----------------------------------------------------------------

    @property
    def used_mixers(self) -> dict[str, type[Mixer]]:
        """The class of every mixer kind this model runs: the parts of every layer (parallel layers included)
        and the attention of shared blocks."""
        used = {kind: MIXERS[kind] for entry in self.layer_types for kind in mixer_parts(entry)}
        if self.shared_block_layers:
            used.setdefault(SharedBlock.mixer_class.kind, SharedBlock.mixer_class)
        return used

    @property
    def is_causal(self) -> bool:
        """Every mixer is causal under this config (what a causal LM needs; see ``Mixer.is_causal``)."""
        return all(cls.is_causal(self) for cls in self.used_mixers.values())

    @property
    def length_limits(self) -> dict[str, int]:
        """Each limit on the positions the model accepts, by what sets it: ``max_position_embeddings`` and every
        mixer kind with a limit (``Mixer.max_positions``, e.g. Linformer's ``linformer_max_length``)."""
        limits = {"max_position_embeddings": self.max_position_embeddings}
        limits.update({cls.max_positions_field or kind: cls.max_positions(self)
                       for kind, cls in self.used_mixers.items()})
        return {source: limit for source, limit in limits.items() if limit is not None}

    @property
    def max_length_limit(self) -> int | None:
        """The most positions the model accepts (the smallest of :attr:`length_limits`); None: unlimited."""
        return min(self.length_limits.values(), default=None)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba2_d_inner(self) -> int:
        return self.mamba2_inner_size or self.mamba2_expand * self.hidden_size

    @property
    def mamba2_num_heads(self) -> int:
        return self.mamba2_d_inner // self.mamba2_head_dim
