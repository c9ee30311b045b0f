"""What a foreign checkpoint format is, the registry of formats, and reading and checking checkpoints.

A format is data: how its ``config.json`` maps to a :class:`HybridConfig`, and how its weight names and
layouts map to hybridlm's (and back, for export). It never holds modeling code. The vocabulary a format module
describes itself with (field maps, rename rules, shared checks) is in :mod:`.mapping`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridlm.config import HybridConfig
from hybridlm.formats.mapping import StateDict, differences
from hybridlm.paths import local_directory


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
    * ``weights_name``: the file export writes the weights to (``pytorch_model.bin``: with ``torch.save``, as
      mamba-ssm reads them).
    """

    model_type: str
    to_config: Callable[[dict], HybridConfig]
    import_weights: Callable[[StateDict, HybridConfig, dict], StateDict]
    from_config: Callable[[HybridConfig], dict] | None = None
    export_weights: Callable[[StateDict, HybridConfig], StateDict] | None = None
    matches: Callable[[dict], bool] | None = None
    options: frozenset[str] = frozenset()
    weights_name: str = "model.safetensors"


#: Every supported foreign format, by ``model_type``; a format module adds itself with :func:`register`.
FORMATS: dict[str, CheckpointFormat] = {}


#: Architectures recognised but not read, with the options hybridlm lacks for each (see :func:`refuse`).
REFUSED: dict[str, list[str]] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    FORMATS[fmt.model_type] = fmt
    return fmt


def refuse(model_type: str, missing: list[str]) -> None:
    """Record that ``model_type`` is known and refused because hybridlm lacks ``missing`` (named in the error)."""
    REFUSED[model_type] = missing


def supported() -> list[str]:
    return sorted(FORMATS)


def detect(foreign_config: dict) -> CheckpointFormat:
    """The format of a checkpoint from its config: by ``model_type``, else by a format's own test."""
    model_type = foreign_config.get("model_type")
    if model_type in FORMATS:
        return FORMATS[model_type]
    if model_type in REFUSED:
        raise ValueError(f"{model_type} checkpoints are not supported: hybridlm lacks "
                         f"{'; '.join(REFUSED[model_type])}")
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
    "moe_shared_expert_gate": False, "rope_scaling": None, "attention_output_bias": None,
}


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


def resolve_directory(path: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub id, from huggingface_hub's cache when it is there (no network
    call), else downloaded. A path that :func:`~hybridlm.paths.looks_local` but does not exist is an error saying
    so."""
    local = local_directory(path)
    if local is not None:
        return local
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
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not a config (a JSON object)")
    return _decode_floats(config)


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


def undeclared_options(config: HybridConfig, fmt: CheckpointFormat) -> list[str]:
    """Export problems: the :data:`EXPORT_OPTIONS` that ``config`` sets and ``fmt`` does not handle."""
    return differences(config, {name: value for name, value in EXPORT_OPTIONS.items() if name not in fmt.options})
