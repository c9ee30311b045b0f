"""The vocabulary a format module describes itself with: config fields that map one to one, weight names that
map by pattern, the checks that name what hybridlm cannot read or a format cannot hold, and the few layout
changes several formats share. Data and small functions only; the loader and exporter are in :mod:`.base`.
"""

from __future__ import annotations

import re

import torch

from hybridlm.config import HybridConfig

StateDict = dict[str, torch.Tensor]


# --- config fields ------------------------------------------------------------------------------


def with_transformers_defaults(foreign_config: dict) -> dict:
    """``foreign_config`` completed by transformers' own config class for its ``model_type`` (defaults, legacy
    keys, validation), so that a field missing from ``config.json`` means what it means to transformers."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING

    model_type = foreign_config["model_type"]
    try:
        return CONFIG_MAPPING[model_type].from_dict(foreign_config).to_dict()
    except (StrictDataclassError, TypeError, ValueError) as error:
        raise ValueError(f"invalid {model_type} config.json: {error}") from error


def public_fields(foreign_config: dict) -> dict:
    """An exported ``config.json`` with every field that transformers' ``save_pretrained`` writes for its
    ``model_type`` (the fields public checkpoints carry), so that readers that take fields from the file without
    transformers' defaults (vLLM, llama.cpp's converter) find them. The format's own values win; RoPE's base is
    also written at the top level (``rope_theta``), where transformers 4.x and llama.cpp's converter read it."""
    from transformers import CONFIG_MAPPING

    model_type = foreign_config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return foreign_config
    written = {**CONFIG_MAPPING[model_type].from_dict(foreign_config).to_diff_dict(), **foreign_config}
    rope = written.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        written.setdefault("rope_theta", rope["rope_theta"])
    return written


def same_names(*names: str) -> dict[str, str]:
    """Field pairs for settings that transformers and HybridConfig name alike."""
    return {name: name for name in names}


#: Settings every supported transformers config names as HybridConfig does.
COMMON_FIELDS = same_names("vocab_size", "hidden_size", "initializer_range", "pad_token_id", "bos_token_id",
                           "eos_token_id")
#: ... and those of the decoder configs with attention layers.
ATTENTION_FIELDS = same_names("num_attention_heads", "num_key_value_heads", "max_position_embeddings")
#: ... and transformers' names of the Gated DeltaNet settings (Qwen3-Next, Qwen3.5, OLMo-Hybrid).
DELTANET_FIELDS = {
    "linear_num_key_heads": "deltanet_num_key_heads", "linear_num_value_heads": "deltanet_num_value_heads",
    "linear_key_head_dim": "deltanet_key_head_dim", "linear_value_head_dim": "deltanet_value_head_dim",
    "linear_conv_kernel_dim": "deltanet_conv_size",
}


class FieldMap:
    """Config fields that map one to one: ``FieldMap({"state_size": "mamba_d_state", ...})`` (theirs: ours)."""

    def __init__(self, pairs: dict[str, str]):
        self.pairs = pairs

    def to_ours(self, foreign_config: dict) -> dict:
        """HybridConfig keyword arguments for the fields present in ``foreign_config``."""
        return {ours: foreign_config[theirs] for theirs, ours in self.pairs.items() if theirs in foreign_config}

    def to_theirs(self, config: HybridConfig) -> dict:
        """The foreign fields; one unset (None) in ``config`` is left out, so the format's default applies."""
        return {theirs: getattr(config, ours) for theirs, ours in self.pairs.items()
                if getattr(config, ours) is not None}


def require_settings(foreign_config: dict, supported: dict, model_type: str) -> None:
    """Raise naming each setting of ``foreign_config`` that hybridlm cannot reproduce. ``supported`` maps a field
    to the values hybridlm runs exactly (a field absent from the config takes its first listed value)."""
    problems = [f"{key}={foreign_config[key]!r} (supported: {', '.join(map(repr, allowed))})"
                for key, allowed in supported.items() if foreign_config.get(key, allowed[0]) not in allowed]
    if problems:
        raise ValueError(f"{model_type} checkpoint uses settings hybridlm does not implement: {'; '.join(problems)}")


def rope_settings(foreign_config: dict, default_partial_rotary_factor: float = 1.0, scaling: bool = False) -> dict:
    """RoPE fields as HybridConfig arguments from ``rope_parameters`` (transformers 5.x) or the older top-level
    ``rope_theta`` / ``partial_rotary_factor``. With ``scaling``, a ``linear``, ``dynamic``, ``llama3`` or
    ``yarn`` scaling is read into ``rope_scaling`` (with its original context filled in as transformers does);
    otherwise only the default (unscaled) RoPE is supported."""
    rope = dict(foreign_config.get("rope_parameters") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        rope.setdefault(key, foreign_config.get(key))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("type", None)  # the legacy name transformers keeps beside rope_type
    theta, factor = rope.pop("rope_theta"), rope.pop("partial_rotary_factor")
    settings = {"rope_theta": float(theta if theta is not None else 10000.0),
                "partial_rotary_factor": float(factor if factor is not None else default_partial_rotary_factor)}
    if rope_type == "default" and not foreign_config.get("rope_scaling"):
        return settings
    if not scaling:
        raise ValueError(f"RoPE type {rope_type!r} / rope_scaling={foreign_config.get('rope_scaling')!r} is not "
                         "supported: hybridlm implements the default (unscaled) RoPE only for this format")
    if rope_type == "dynamic":  # transformers scales relative to max_position_embeddings, whatever else is given
        rope["original_max_position_embeddings"] = foreign_config.get("max_position_embeddings")
    elif rope_type in ("yarn", "llama3"):  # the context the scaling is relative to
        rope.setdefault("original_max_position_embeddings", foreign_config.get("max_position_embeddings"))
    if rope_type == "yarn" and rope.get("factor") is None:  # DeepSeek's form: the ratio of the two contexts
        rope["factor"] = foreign_config["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return {**settings, "rope_scaling": {"rope_type": rope_type, **rope}}


def head_dim_of(foreign_config: dict) -> int:
    """The attention head width a config states, else ``hidden_size / num_attention_heads``."""
    return foreign_config.get("head_dim") or foreign_config["hidden_size"] // foreign_config["num_attention_heads"]


def our_kinds(foreign_config: dict, kinds: dict[str, str], model_type: str, field: str = "layer_types") -> list[str]:
    """``foreign_config[field]`` mapped by ``kinds`` (theirs: ours); an unknown kind, or no list of kinds, is an
    error naming it."""
    if not isinstance(foreign_config.get(field), list):
        raise ValueError(f"{model_type} config: {field} must be a list of layer kinds, one per layer "
                         f"({sorted(kinds)}), got {foreign_config.get(field)!r}")
    unknown = sorted(set(foreign_config[field]) - set(kinds))
    if unknown:
        raise ValueError(f"{model_type} config: {field} {unknown} are not supported (hybridlm reads "
                         f"{sorted(kinds)})")
    return [kinds[kind] for kind in foreign_config[field]]


def their_kinds(kinds: list[str], ours_of: dict[str, str]) -> list[str]:
    """The inverse of :func:`our_kinds`: our layer ``kinds`` under the foreign names of ``ours_of`` (theirs: ours)."""
    theirs = {ours: name for name, ours in ours_of.items()}
    return [theirs[kind] for kind in kinds]


def check_mamba2_heads(config: HybridConfig, foreign_config: dict, field: str, formula: str, model_type: str) -> None:
    """The Mamba-2 head count a config states (``field``) must be the one its widths imply (``formula``)."""
    if config.mamba2_num_heads != foreign_config[field]:
        raise ValueError(f"{model_type} config: {field}={foreign_config[field]} but {formula} = "
                         f"{config.mamba2_num_heads}")


def rope_parameters(config: HybridConfig, partial: bool = True) -> dict:
    """The ``rope_parameters`` of an exported config (default RoPE, or the config's ``rope_scaling``; with
    ``partial``, its rotated fraction)."""
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    if rope["rope_type"] == "dynamic":  # transformers reads it from max_position_embeddings
        rope.pop("original_max_position_embeddings")
    return {**rope, "partial_rotary_factor": config.partial_rotary_factor} if partial else rope


# --- weight names -------------------------------------------------------------------------------


class RenameRules:
    """Bidirectional name mapping by patterns with ``{i}``-style integer fields.

    ``RenameRules([("model.layers.{i}.mamba.{rest}", "model.layers.{i}.mixer.{rest}")])`` maps foreign names
    to ours with :meth:`to_ours` and back with :meth:`to_theirs`; ``{rest}`` matches any dotted tail. The first
    rule that matches wins; a name no rule matches is returned as None.
    """

    def __init__(self, pairs: list[tuple[str, str]]):
        self.pairs = pairs
        self._forward = [(self._compile(theirs), ours) for theirs, ours in pairs]
        self._backward = [(self._compile(ours), theirs) for theirs, ours in pairs]

    @staticmethod
    def _compile(pattern: str) -> re.Pattern:
        regex = re.escape(pattern)
        regex = re.sub(r"\\\{rest\\\}", r"(?P<rest>.+)", regex)
        regex = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>\\d+)", regex)
        return re.compile(f"^{regex}$")

    @staticmethod
    def _apply(rules, name: str) -> str | None:
        for regex, template in rules:
            match = regex.match(name)
            if match:
                return template.format(**match.groupdict())
        return None

    def to_ours(self, name: str) -> str | None:
        return self._apply(self._forward, name)

    def to_theirs(self, name: str) -> str | None:
        return self._apply(self._backward, name)


def rename_state(state: StateDict, rules: RenameRules, to_ours: bool = True) -> StateDict:
    """``state`` with every name mapped by ``rules``; a name no rule matches is kept as is, so that
    :func:`check_state` reports it by its own name."""
    rename = rules.to_ours if to_ours else rules.to_theirs
    return {rename(name) or name: tensor for name, tensor in state.items()}


def layer_rules(config: HybridConfig, theirs: str, mixer_names: dict[str, str]) -> list[tuple[str, str]]:
    """Rename pairs for each layer's mixer, whose foreign name depends on its kind: ``theirs`` is the foreign
    layer prefix with ``{i}`` (``"model.layers.{i}"``), ``mixer_names`` maps a mixer kind to its foreign name."""
    return [(f"{theirs.format(i=i)}.{mixer_names[kind]}.{{rest}}", f"model.layers.{i}.mixer.{{rest}}")
            for i, kind in enumerate(config.layer_types)]


def outer_rules(final_norm: str = "model.norm.weight", embeddings: str = "model.embed_tokens.weight"
                ) -> list[tuple[str, str]]:
    """Rename pairs for the tensors outside the layers: the embedding, the final norm and the LM head."""
    return [(embeddings, "model.embed_tokens.weight"), (final_norm, "model.norm.weight"),
            ("lm_head.weight", "lm_head.weight")]


def renaming(rules_of):
    """``(import_weights, export_weights)`` of a format whose weights differ from ours by their names alone;
    ``rules_of(config)`` gives its :class:`RenameRules`."""

    def import_weights(state: StateDict, config: HybridConfig, foreign_config: dict) -> StateDict:
        return rename_state(state, rules_of(config))

    def export_weights(state: StateDict, config: HybridConfig) -> StateDict:
        return rename_state(state, rules_of(config), to_ours=False)

    return import_weights, export_weights


def split_stacked(state: StateDict, name: str, targets: list[str]) -> StateDict:
    """``state`` with the stacked expert tensor ``name`` (``[experts, rows, cols]``, the rows of each expert cut
    into ``len(targets)`` equal blocks) replaced by one tensor per expert and block; ``targets`` are names with
    ``{e}`` for the expert (``["...experts.{e}.gate_proj.weight", "...experts.{e}.up_proj.weight"]``)."""
    state = dict(state)
    for e, stacked in enumerate(state.pop(name)):
        for target, block in zip(targets, stacked.chunk(len(targets), dim=0)):
            state[target.format(e=e)] = block.contiguous()
    return state


def join_weights(state: StateDict, prefix: str, joined: dict[str, tuple[str, ...]]) -> None:
    """In place: for each ``ours: parts`` of ``joined``, the weights ``{prefix}.{part}.weight`` concatenated along
    their rows, in order, into ``{prefix}.{ours}.weight``. A set with a part missing is left as it is, so that
    the loader names the parts left over."""
    for ours, parts in joined.items():
        names = [f"{prefix}.{part}.weight" for part in parts]
        if all(name in state for name in names):
            state[f"{prefix}.{ours}.weight"] = torch.cat([state.pop(name) for name in names])


# --- export checks ------------------------------------------------------------------------------


def differences(config: HybridConfig, required: dict) -> list[str]:
    """Export problems: one per HybridConfig field whose value is not the one the target format fixes."""
    return [f"{name}={getattr(config, name)!r} (the format needs {value!r})"
            for name, value in required.items() if getattr(config, name) != value]


def positions(kinds: list[str], kind: str) -> list[int]:
    """Indices of the layers of ``kind`` (for error messages)."""
    return [i for i, k in enumerate(kinds) if k == kind]


def check_expressible(model_type: str, problems: list[str]) -> None:
    """Export guard: raise one error listing everything about a model that ``model_type`` cannot hold."""
    if problems:
        raise ValueError(f"this model cannot be written as {model_type}: " + "; ".join(problems))


def other_positions(kinds: list[str], kind: str) -> list[int]:
    """Indices of the layers that are not of ``kind`` (for error messages)."""
    return [i for i, k in enumerate(kinds) if k != kind]


def unsupported_kinds(config: HybridConfig, allowed: list[str], family: str) -> list[str]:
    """Export problems: the layer kinds of ``config`` outside ``allowed``, which ``family`` layers are."""
    other = sorted(set(config.layer_types) - set(allowed))
    if not other:
        return []
    return [f"{family} layers are {' or '.join(map(repr, allowed))}, this model has {other}"]
