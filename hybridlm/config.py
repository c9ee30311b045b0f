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

MIXER_TYPES = ("attention", "mamba", "mamba2", "performer", "linformer")
MLP_TYPES = ("dense", "moe", "none")
MLP_ACTIVATIONS = ("silu", "gelu", "relu2")
#: ``mamba2_norm``: "gated" rms_norm(y * silu(z)) (Mamba-2); "norm_before_gate" rms_norm(y) * silu(z);
#: "none" y * silu(z) (the last two: Falcon-H1's ``mamba_norm_before_gate`` / ``mamba_rms_norm=False``).
MAMBA2_NORMS = ("gated", "norm_before_gate", "none")
#: ``moe_router``: "softmax" (softmax, then top-k); "sigmoid" (sigmoid scores, top-k chosen by score plus a
#: per-expert selection bias, optionally within the best ``moe_topk_groups`` of ``moe_num_groups`` groups:
#: DeepSeek-V3 / Nemotron-H).
MOE_ROUTERS = ("softmax", "sigmoid")

#: ``layer_pattern`` letters: A attention, M Mamba-1 (selective scan), S Mamba-2 (SSD),
#: P Performer (FAVOR+), L Linformer.
PATTERN_LETTERS = {"A": "attention", "M": "mamba", "S": "mamba2", "P": "performer", "L": "linformer"}

# Keys that transformers' own machinery may hand to a config besides its fields.
_TRANSFORMERS_KWARGS = {
    "model_type", "torch_dtype", "name_or_path", "_commit_hash", "output_attentions", "attn_implementation",
    "experts_implementation", "per_layer_config", "num_labels", "_attn_implementation_internal",
    "_experts_implementation_internal",
}


def _fail(field: str, value, allowed: str) -> None:
    raise ValueError(f"HybridConfig.{field}={value!r} is invalid: {allowed}")


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def mixer_parts(kind: str) -> list[str]:
    """The mixers of a ``layer_types`` entry: ``"none"`` (an MLP-only layer) has none; ``"attention+mamba2"``
    runs both on the same input and sums their outputs (Falcon-H1)."""
    return [] if kind == "none" else kind.split("+")


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
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    attention_bias: bool = False
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5

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

    # --- linear attention -------------------------------------------------------------------
    performer_num_features: int = 64
    performer_redraw_interval: int | None = None
    linformer_rank: int = 64
    linformer_max_length: int = 4096
    linformer_causal: bool = True

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
    router_aux_loss_coef: float = 0.001

    # --- scalar multipliers (Granite, Falcon-H1) -------------------------------------------------
    embedding_multiplier: float = 1.0  # scales the token embeddings
    residual_multiplier: float = 1.0  # scales each mixer and MLP output before its residual add
    logits_multiplier: float = 1.0  # scales the logits

    # --- shared transformer blocks (Zamba2), see hybridlm/shared_blocks.py -------------------------
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
        mixers, mlps = self.layer_types, self.mlp_types
        super().__post_init__(**kwargs)
        # transformers renames legacy layer names ("mamba", "attention") in place; ours are not legacy.
        self.layer_types, self.mlp_types = mixers, mlps
        self._resolve_layers()
        self._resolve_sizes()
        self._check()

    # --- resolution of the short forms ------------------------------------------------------

    def _resolve_layers(self) -> None:
        plans, jamba_default = self._mixer_plans()
        self.layer_types = self._agree("layer_types", plans, jamba_default)
        if self.num_hidden_layers is None:
            self.num_hidden_layers = len(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            _fail("num_hidden_layers", self.num_hidden_layers, f"the layer plan has {len(self.layer_types)} layers")
        for i, kind in enumerate(self.layer_types):
            parts = mixer_parts(kind)
            if any(part not in MIXER_TYPES for part in parts) or len(set(parts)) != len(parts):
                _fail(f"layer_types[{i}]", kind, f"allowed: a mixer from {MIXER_TYPES}, distinct mixers joined by "
                      "'+' (run in parallel), or 'none' (an MLP-only layer)")
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
            bad = sorted(set(self.layer_pattern) - set(PATTERN_LETTERS))
            if bad or not self.layer_pattern:
                _fail("layer_pattern", self.layer_pattern, f"letters must be from {PATTERN_LETTERS}")
            plans["layer_pattern"] = [PATTERN_LETTERS[c] for c in self.layer_pattern]
        n = self.num_hidden_layers if self.num_hidden_layers is not None else 8
        period = self.attn_layer_period if self.attn_layer_period is not None else 8
        offset = self.attn_layer_offset if self.attn_layer_offset is not None else 4
        if period < 1 or not 0 <= offset < period:
            _fail("attn_layer_offset", offset, f"need 0 <= offset < attn_layer_period={period}")
        jamba = ["attention" if i % period == offset else self.ssm_layer_type for i in range(n)]
        plans["attn_layer_period"] = jamba if self.attn_layer_period is not None else None
        return plans, jamba

    def _mlp_plans(self) -> dict[str, list[str] | None]:
        n = self.num_hidden_layers
        plans: dict[str, list[str] | None] = {"mlp_types": self.mlp_types, "expert_layer_period": None}
        if self.expert_layer_period is not None:
            period, offset = self.expert_layer_period, self.expert_layer_offset or 0
            if period < 1 or not 0 <= offset < period:
                _fail("expert_layer_offset", offset, f"need 0 <= offset < expert_layer_period={period}")
            plans["expert_layer_period"] = ["moe" if i % period == offset else "dense" for i in range(n)]
        return plans

    def _resolve_sizes(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mamba_dt_rank == "auto":
            self.mamba_dt_rank = math.ceil(self.hidden_size / 16)
        if self.mamba2_dt_limit is None:
            self.mamba2_dt_limit = [0.0, float("inf")]
        self.mamba2_dt_limit = [float(v) for v in self.mamba2_dt_limit]
        if self.mamba_dt_norm_eps is None:
            self.mamba_dt_norm_eps = self.rms_norm_eps

    def _check(self) -> None:
        positive = [
            "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank",
            "mamba2_d_state", "mamba2_d_conv", "mamba2_expand", "mamba2_head_dim", "mamba2_n_groups",
            "mamba2_chunk_size", "performer_num_features", "linformer_rank", "linformer_max_length",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "must be a positive integer")
        for name in ("max_position_embeddings", "sliding_window", "performer_redraw_interval"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                _fail(name, value, "must be None or a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(
                "num_key_value_heads", self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads} (GQA groups query heads evenly)",
            )
        if not 0.0 <= self.partial_rotary_factor <= 1.0:
            _fail("partial_rotary_factor", self.partial_rotary_factor, "must be in [0, 1]")
        if int(self.head_dim * self.partial_rotary_factor) % 2:
            _fail("partial_rotary_factor", self.partial_rotary_factor, "head_dim * factor must be even")
        if self.ssm_layer_type not in MIXER_TYPES:
            _fail("ssm_layer_type", self.ssm_layer_type, f"allowed mixers are {MIXER_TYPES}")
        for name in ("rms_norm_eps", "mamba_dt_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
                _fail(name, value, "must be a number in (0, 1)")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            _fail("mlp_activation", self.mlp_activation, f"allowed activations are {MLP_ACTIVATIONS}")
        if self.num_experts_per_tok > self.num_experts:
            _fail("num_experts_per_tok", self.num_experts_per_tok, f"must be <= num_experts={self.num_experts}")
        if "mamba2" in self.mixer_kinds:
            inner = self.mamba2_d_inner
            if inner % self.mamba2_head_dim:
                _fail("mamba2_head_dim", self.mamba2_head_dim, f"must divide the SSD inner size {inner}")
            heads = inner // self.mamba2_head_dim
            if heads % self.mamba2_n_groups:
                _fail("mamba2_n_groups", self.mamba2_n_groups, f"must divide the number of SSD heads ({heads})")
        low, high = self.mamba2_dt_limit
        if len(self.mamba2_dt_limit) != 2 or not 0.0 <= low < high:
            _fail("mamba2_dt_limit", self.mamba2_dt_limit, "must be [low, high] with 0 <= low < high")
        self._check_options()

    def _check_options(self) -> None:
        """The options that express foreign architectures' quirks (multipliers, routers, shared blocks)."""
        for name in ("embedding_multiplier", "residual_multiplier", "logits_multiplier", "moe_routed_scaling"):
            if not _positive_number(getattr(self, name)):
                _fail(name, getattr(self, name), "must be a positive finite number")
        if self.attention_scale is not None and not _positive_number(self.attention_scale):
            _fail("attention_scale", self.attention_scale, "must be None or a positive finite number")
        if self.mamba2_inner_size is not None and (not isinstance(self.mamba2_inner_size, int)
                                                   or self.mamba2_inner_size < 1):
            _fail("mamba2_inner_size", self.mamba2_inner_size, "must be None or a positive integer")
        if self.mamba2_norm not in MAMBA2_NORMS:
            _fail("mamba2_norm", self.mamba2_norm, f"allowed: {MAMBA2_NORMS}")
        self._check_router()
        self._check_shared_blocks()

    def _check_router(self) -> None:
        if self.moe_router not in MOE_ROUTERS:
            _fail("moe_router", self.moe_router, f"allowed: {MOE_ROUTERS}")
        groups, chosen = self.moe_num_groups, self.moe_topk_groups
        if not isinstance(groups, int) or groups < 1 or self.num_experts % groups:
            _fail("moe_num_groups", groups, f"must be a positive divisor of num_experts={self.num_experts}")
        if groups > 1 and (self.moe_router != "sigmoid" or self.num_experts // groups < 2):
            _fail("moe_num_groups", groups, "groups need moe_router='sigmoid' and at least 2 experts per group")
        if not isinstance(chosen, int) or not 1 <= chosen <= groups:
            _fail("moe_topk_groups", chosen, f"must be in [1, moe_num_groups={groups}]")
        if self.num_experts_per_tok > chosen * (self.num_experts // groups):
            _fail("num_experts_per_tok", self.num_experts_per_tok,
                  f"exceeds the experts in the {chosen} eligible group(s)")

    def _check_shared_blocks(self) -> None:
        layers = self.shared_block_layers
        if layers is None:
            return
        if not layers or sorted(set(layers)) != list(layers) or not all(
                isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in layers):
            _fail("shared_block_layers", layers,
                  f"must be increasing, distinct layer indices in [0, {self.num_hidden_layers})")
        if not isinstance(self.num_shared_blocks, int) or not 1 <= self.num_shared_blocks <= len(layers):
            _fail("num_shared_blocks", self.num_shared_blocks, f"must be in [1, {len(layers)}] (one per application "
                  "at most)")
        rank = self.shared_block_adapter_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            _fail("shared_block_adapter_rank", rank, "must be a non-negative integer")
        if self.shared_block_attention_adapters and rank == 0:
            _fail("shared_block_attention_adapters", True, "needs shared_block_adapter_rank > 0")

    def validate(self) -> None:
        """transformers' class validators, minus its check of ``layer_types`` against its own layer names
        (ours are mixer names, checked in ``__post_init__``)."""
        for validator in PreTrainedConfig.__class_validators__:
            if validator.__name__ != "validate_layer_type":
                validator(self)

    # --- derived quantities -----------------------------------------------------------------

    @property
    def max_length_limit(self) -> int | None:
        """The most positions the model accepts: ``max_position_embeddings``, and ``linformer_max_length`` when
        a Linformer layer is present (its projections have one column per position). None: unlimited."""
        limits = [self.max_position_embeddings] if self.max_position_embeddings is not None else []
        if "linformer" in self.layer_types:
            limits.append(self.linformer_max_length)
        return min(limits) if limits else None

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba2_d_inner(self) -> int:
        return self.mamba2_inner_size or self.mamba2_expand * self.hidden_size

    @property
    def mixer_kinds(self) -> set[str]:
        """Every mixer kind some layer runs (the parts of parallel layers included)."""
        return {part for kind in self.layer_types for part in mixer_parts(kind)}

    @property
    def mamba2_num_heads(self) -> int:
        return self.mamba2_d_inner // self.mamba2_head_dim
