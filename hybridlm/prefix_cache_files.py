"""Prefix-cache files: one safetensors file holding every snapshot's tensors, with the cache's settings, the
identity of the model it serves and each snapshot's key and per-state metadata as JSON in the file's metadata
(nothing is pickled). A state is rebuilt on the model's own empty state of its layer, so only its tensors and
plain fields travel."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping

import torch

from .cache import HybridCache, LayerState, StateGroup

METADATA_KEY = "hybridlm_prefix_cache"


def save_snapshots(path, header: dict, entries: list[tuple[str, int, str | None, HybridCache]]) -> None:
    """Write ``(key, blocks, parent key, one-row snapshot)`` entries (least recently used first) under
    ``header``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    items = []
    for index, (key, blocks, parent, snapshot) in enumerate(entries):
        states = [_state_meta(state, f"{index}.{layer}", tensors) for layer, state in enumerate(snapshot.states)]
        tensors[f"{index}.positions"] = snapshot.positions.cpu()
        items.append({"key": key, "blocks": blocks, "parent": parent, "seen": snapshot.seen, "states": states})
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps({**header, "entries": items})})


def read_header(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata() or {}
    if METADATA_KEY not in metadata:
        raise ValueError(f"PrefixCache.load: {path} is not a hybridlm prefix cache (no {METADATA_KEY!r} metadata)")
    return json.loads(metadata[METADATA_KEY])


def load_snapshots(path, header: dict, template: HybridCache) -> list[tuple[str, int, str | None, HybridCache]]:
    """The entries of the file, rebuilt on ``template`` (an empty one-row cache of the model, on its device)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path), device=str(template.positions.device))
    entries = []
    for index, item in enumerate(header["entries"]):
        snapshot = copy.copy(template)
        snapshot.states = [_state_from_meta(empty, meta, f"{index}.{layer}", tensors) for layer, (empty, meta) in
                           enumerate(zip(template.states, item["states"], strict=True))]
        snapshot.positions, snapshot.seen = tensors[f"{index}.positions"], item["seen"]
        entries.append((item["key"], item["blocks"], item["parent"], snapshot))
    return entries


def policy_json(policy) -> dict | None:
    """A cache policy (None, a CachePolicy, or ``{state index: CachePolicy}``) as JSON-able data."""
    if policy is None:
        return None
    if isinstance(policy, Mapping):
        return {"per_state": {str(index): dataclasses.asdict(p) for index, p in sorted(policy.items())}}
    return {"all": dataclasses.asdict(policy)}


def policy_from_json(data: dict | None):
    from .kv.policy import CachePolicy

    if data is None:
        return None
    if "all" in data:
        return CachePolicy(**data["all"])
    return {int(index): CachePolicy(**fields) for index, fields in data["per_state"].items()}


def _state_meta(state: LayerState, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    """JSON metadata of ``state``; its tensors go into ``tensors`` under ``prefix.field``."""
    if isinstance(state, StateGroup):
        return {"type": "StateGroup", "parts": {name: _state_meta(part, f"{prefix}.{name}", tensors)
                                                for name, part in state.parts.items()}}
    fields = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            tensors[f"{prefix}.{field.name}"] = value.detach().to("cpu").contiguous()
        else:
            fields[field.name] = value
    return {"type": type(state).__name__, "fields": fields}


def _state_from_meta(empty: LayerState, meta: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> LayerState:
    """The state :func:`_state_meta` described, rebuilt on ``empty`` (the model's own empty state of that layer)."""
    if meta["type"] != type(empty).__name__:
        raise ValueError(f"PrefixCache.load: state {prefix} is a {meta['type']} in the file, a "
                         f"{type(empty).__name__} in this model's cache")
    if isinstance(empty, StateGroup):
        return StateGroup({name: _state_from_meta(part, meta["parts"][name], f"{prefix}.{name}", tensors)
                           for name, part in empty.parts.items()})
    values = {field.name: tensors[f"{prefix}.{field.name}"] if f"{prefix}.{field.name}" in tensors
              else meta["fields"][field.name] for field in dataclasses.fields(empty)}
    return dataclasses.replace(empty, **values)
