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
    """

    model_type: str
    to_config: Callable[[dict], HybridConfig]
    import_weights: Callable[[StateDict, HybridConfig, dict], StateDict]
    from_config: Callable[[HybridConfig], dict] | None = None
    export_weights: Callable[[StateDict, HybridConfig], StateDict] | None = None
    matches: Callable[[dict], bool] | None = None


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


def resolve_directory(path: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub id resolved through huggingface_hub's cache."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"{path} is a file; a checkpoint is a directory holding config.json and weights")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model",
                                                                 "*.txt", "*.jinja"]))
    except Exception as error:  # network errors, unknown repos, offline mode without a cached copy
        raise FileNotFoundError(f"{path} is neither a local directory nor a hub id available here: {error}") \
            from error


def read_config(directory: Path) -> dict:
    file = directory / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {directory}: not a Hugging Face-format checkpoint")
    try:
        return _decode_floats(json.loads(file.read_text()))
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error


def read_weights(directory: Path) -> StateDict:
    """All tensors of a checkpoint: ``model.safetensors``, sharded safetensors with an index file, or (mamba-ssm)
    ``pytorch_model.bin`` read with ``weights_only=True``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{directory / 'pytorch_model.bin'} does not hold a state dict")
        return state
    else:
        raise FileNotFoundError(f"no weights in {directory}: expected model.safetensors, "
                                "model.safetensors.index.json or pytorch_model.bin")
    state: StateDict = {}
    for name in files:
        file = directory / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in the index but missing")
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
