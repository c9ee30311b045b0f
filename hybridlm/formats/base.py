"""What a foreign checkpoint format is, and the one loader/exporter that every format shares.

A format is data: how its ``config.json`` maps to a :class:`HybridConfig`, and how its weight names and
layouts map to hybridlm's (and back, for export). It never holds modeling code.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import HybridConfig

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CheckpointFormat:
    """How one foreign architecture maps onto hybridlm.

    * ``to_config(foreign_config) -> HybridConfig``
    * ``import_weights(foreign_state, config, foreign_config) -> state`` with hybridlm's names and layouts
    * ``from_config(config) -> foreign_config`` and ``export_weights(state, config) -> foreign_state``: the
      inverse, for formats hybridlm can write (None otherwise).
    * ``matches(foreign_config)``: recognises the format when ``model_type`` alone does not (mamba-ssm).
    * ``options``: the fields of :data:`EXPORT_OPTIONS` that ``from_config`` handles itself; export refuses a
      model that sets any other of them.
    """

    model_type: str
    to_config: Callable[[dict], HybridConfig]
    import_weights: Callable[[StateDict, HybridConfig, dict], StateDict]
    from_config: Callable[[HybridConfig], dict] | None = None
    export_weights: Callable[[StateDict, HybridConfig], StateDict] | None = None
    matches: Callable[[dict], bool] | None = None
    options: frozenset[str] = frozenset()


#: Every supported foreign format, by ``model_type``; a format module adds itself with :func:`register`.
FORMATS: dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    FORMATS[fmt.model_type] = fmt
    return fmt


def supported() -> list[str]:
    return sorted(FORMATS)


def detect(foreign_config: dict) -> CheckpointFormat:
    """The format of a checkpoint from its config: by ``model_type``, else by a format's own test."""
    model_type = foreign_config.get("model_type")
    if model_type in FORMATS:
        return FORMATS[model_type]
    for fmt in FORMATS.values():
        if fmt.matches is not None and fmt.matches(foreign_config):
            return fmt
    raise ValueError(f"unsupported checkpoint model_type={model_type!r}; hybridlm reads "
                     f"{', '.join(['hybridlm'] + supported())}")


def is_own(config_dict: dict) -> bool:
    """Whether a ``config.json`` is hybridlm's: ``model_type="hybridlm"``, or no model_type and no foreign
    format recognises it (a config written by hand)."""
    model_type = config_dict.get("model_type")
    if model_type is None:
        return not any(fmt.matches is not None and fmt.matches(config_dict) for fmt in FORMATS.values())
    return model_type == HybridConfig.model_type


def to_hybrid_config(config_dict: dict) -> HybridConfig:
    """The :class:`HybridConfig` a checkpoint's ``config.json`` describes, hybridlm's own or a foreign one."""
    if is_own(config_dict):
        return HybridConfig.from_dict(config_dict)
    return detect(config_dict).to_config(config_dict)


#: Options that express other architectures' quirks, with the value a format that does not declare them in
#: ``CheckpointFormat.options`` needs: a checkpoint written without them would compute something else.
EXPORT_OPTIONS = {
    "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_multiplier": 1.0, "attention_scale": None,
    "mamba2_inner_size": None, "mamba2_norm": "gated", "moe_router": "softmax", "moe_routed_scaling": 1.0,
    "shared_block_layers": None, "attention_qk_norm": False, "attention_output_gate": False,
    "moe_shared_expert_gate": False,
}


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


# --- reading ------------------------------------------------------------------------------------


def _decode_floats(obj):
    """transformers 5.x writes infinities as ``{"__float__": "Infinity"}``; older files as bare ``Infinity``."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"].replace("Infinity", "inf"))
        return {key: _decode_floats(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(value) for value in obj]
    return obj


_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja"]


def looks_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` can only mean a local directory: absolute, starting with ``.`` or ``~``, or inside a
    directory that exists here (``checkpoints/run1`` when ``checkpoints/`` exists). A hub id is
    ``name`` or ``owner/name``."""
    text = os.fspath(path)
    local = Path(text)
    return (local.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text
            or (len(local.parts) > 1 and local.parent.is_dir()))


def resolve_directory(path: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub id, from huggingface_hub's cache when it is there (no network
    call), else downloaded. A path that :func:`looks_local` but does not exist is an error saying so."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"{path} is a file; a checkpoint is a directory holding config.json and weights")
    if looks_local(path):
        raise FileNotFoundError(f"directory {path} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), allow_patterns=_CHECKPOINT_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not in the cache: ask the hub
    except HFValidationError as error:
        raise FileNotFoundError(f"directory {path} does not exist (nor is it a valid hub id: {error})") from error
    try:
        return Path(snapshot_download(str(path), allow_patterns=_CHECKPOINT_FILES))
    except Exception as error:  # network errors, unknown repos, offline mode
        raise FileNotFoundError(f"directory {path} does not exist, and the hub id {path} is not available here: "
                                f"{error}") from error


def read_config(path: Path) -> dict:
    """The ``config.json`` of a checkpoint directory (or that file itself), with infinities decoded."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face-format checkpoint")
    try:
        return _decode_floats(json.loads(file.read_text()))
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint (one, or the shards its index lists), each checked to exist and to
    hold as many bytes as its header declares (reads the headers only); [] when it has none."""
    from safetensors import SafetensorError, safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        return []
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in the index but missing")
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"cannot read {file} (truncated or not safetensors?): {error}") from error
    return files


def read_weights(directory: Path) -> StateDict:
    """All tensors of a checkpoint: ``model.safetensors``, sharded safetensors with an index file, or (mamba-ssm)
    ``pytorch_model.bin`` read with ``weights_only=True``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = safetensors_files(directory)
    if not files and (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{directory / 'pytorch_model.bin'} does not hold a state dict")
        return state
    if not files:
        raise FileNotFoundError(f"no weights in {directory}: expected model.safetensors, "
                                "model.safetensors.index.json or pytorch_model.bin")
    state: StateDict = {}
    for file in files:
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"cannot read {file} (truncated or not safetensors?): {error}") from error
    return state


# --- checking -----------------------------------------------------------------------------------


def check_state(expected: dict[str, torch.Size], state: StateDict, source: str) -> None:
    """Raise one error naming every missing, unexpected or wrongly shaped tensor."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{name}: checkpoint {tuple(state[name].shape)} vs model {tuple(shape)}"
                  for name, shape in expected.items() if name in state and state[name].shape != shape]
    problems = []
    if missing:
        problems.append(f"missing weights: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected weights: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched)}")
    if problems:
        raise ValueError(f"{source}: " + " | ".join(problems))


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# --- shared mapping helpers -----------------------------------------------------------------------


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


def same_names(*names: str) -> dict[str, str]:
    """Field pairs for settings that transformers and HybridConfig name alike."""
    return {name: name for name in names}


#: Settings every supported transformers config names as HybridConfig does.
COMMON_FIELDS = same_names("vocab_size", "hidden_size", "initializer_range", "pad_token_id", "bos_token_id",
                           "eos_token_id")
#: ... and those of the decoder configs with attention layers.
ATTENTION_FIELDS = same_names("num_attention_heads", "num_key_value_heads", "max_position_embeddings")


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


def rope_settings(foreign_config: dict, default_partial_rotary_factor: float = 1.0) -> dict:
    """RoPE fields as HybridConfig arguments from ``rope_parameters`` (transformers 5.x) or the older top-level
    ``rope_theta`` / ``partial_rotary_factor``; only the default (unscaled) RoPE is supported."""
    rope = dict(foreign_config.get("rope_parameters") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        rope.setdefault(key, foreign_config.get(key))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or foreign_config.get("rope_scaling"):
        raise ValueError(f"RoPE type {rope_type!r} / rope_scaling={foreign_config.get('rope_scaling')!r} is not "
                         "supported: hybridlm implements the default (unscaled) RoPE only")
    factor = rope["partial_rotary_factor"]
    return {"rope_theta": float(rope["rope_theta"] if rope["rope_theta"] is not None else 10000.0),
            "partial_rotary_factor": float(factor if factor is not None else default_partial_rotary_factor)}


def undeclared_options(config: HybridConfig, fmt: CheckpointFormat) -> list[str]:
    """Export problems: the :data:`EXPORT_OPTIONS` that ``config`` sets and ``fmt`` does not handle."""
    return differences(config, {name: value for name, value in EXPORT_OPTIONS.items() if name not in fmt.options})


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


def split_stacked(state: StateDict, name: str, targets: list[str]) -> StateDict:
    """``state`` with the stacked expert tensor ``name`` (``[experts, rows, cols]``, the rows of each expert cut
    into ``len(targets)`` equal blocks) replaced by one tensor per expert and block; ``targets`` are names with
    ``{e}`` for the expert (``["...experts.{e}.gate_proj.weight", "...experts.{e}.up_proj.weight"]``)."""
    state = dict(state)
    for e, stacked in enumerate(state.pop(name)):
        for target, block in zip(targets, stacked.chunk(len(targets), dim=0)):
            state[target.format(e=e)] = block.contiguous()
    return state
