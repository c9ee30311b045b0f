"""Prefix-cache files: one safetensors file holding every snapshot's tensors, with the cache's settings, the
identity of the model it serves and each snapshot's key and per-state metadata as JSON in the file's metadata
(nothing is pickled), and a sha256 digest of that JSON and every tensor. A file is written crash-safely and read
in one read (so a save of the same path by another process cannot mix two files); its digest is checked, then
every tensor's name, shape and dtype against the model's own empty states, which the snapshots are rebuilt on
(only tensors and plain fields travel)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from hybridlm.cache import HybridCache, LayerState, StateGroup
from hybridlm.files import DamagedFileError, load_safetensors, write_file

METADATA_KEY = "hybridlm_prefix_cache"
DIGEST_KEY = "hybridlm_prefix_cache_sha256"


def save_snapshots(path, header: dict, entries: list[tuple[str, int, str | None, HybridCache]]) -> None:
    """Write ``(key, blocks, parent key, one-row snapshot)`` entries (least recently used first) under
    ``header``."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    items = []
    for index, (key, blocks, parent, snapshot) in enumerate(entries):
        states = [_state_meta(state, f"{index}.{layer}", tensors) for layer, state in enumerate(snapshot.states)]
        tensors[f"{index}.positions"] = snapshot.positions.cpu()
        items.append({"key": key, "blocks": blocks, "parent": parent, "seen": snapshot.seen, "states": states})
    text = json.dumps({**header, "entries": items})
    write_file(path, save(tensors, metadata={METADATA_KEY: text, DIGEST_KEY: _digest(text, tensors)}))


def _digest(text: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the header's JSON and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def read_snapshot_file(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and the tensors of a prefix-cache file, read once and checked against its digest."""
    tensors, metadata = load_safetensors(Path(path).read_bytes(), path)
    if METADATA_KEY not in metadata:
        raise ValueError(f"PrefixCache.load: {path} is not a hybridlm prefix cache (no {METADATA_KEY!r} metadata)")
    if metadata.get(DIGEST_KEY) != _digest(metadata[METADATA_KEY], tensors):
        raise DamagedFileError(f"PrefixCache.load: {path} is damaged (its sha256 digest does not match; a file "
                               "saved without one must be saved again)")
    return json.loads(metadata[METADATA_KEY]), tensors


def load_snapshots(path, header: dict, tensors: dict[str, torch.Tensor],
                   template: HybridCache) -> list[tuple[str, int, str | None, HybridCache]]:
    """The entries of the file, rebuilt on ``template`` (an empty one-row cache of the model, on its device).
    Every tensor of the file must be used, with the dtype and shape of the empty state's tensor (one axis, the
    length, may differ in a state that grows with context); a field the empty state holds no tensor in (spilled
    slots) is checked by name only."""
    device, used = template.positions.device, set()

    def take(name: str, like: torch.Tensor | None, grows: bool = False) -> torch.Tensor:
        tensor = tensors.get(name)
        if tensor is None:
            raise ValueError(f"PrefixCache.load: {path} has no tensor {name!r}")
        if like is not None and (tensor.dtype != like.dtype or tensor.dim() != like.dim()
                                 or sum(a != b for a, b in zip(tensor.shape, like.shape)) > grows):
            raise ValueError(f"PrefixCache.load: {path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                             f"this model's is {like.dtype} {tuple(like.shape)}"
                             + (" (only the length may differ)" if grows else ""))
        used.add(name)
        return tensor.to(device)

    entries = []
    for index, item in enumerate(header["entries"]):
        if len(item["states"]) != len(template.states):
            raise ValueError(f"PrefixCache.load: {path}: snapshot {index} has {len(item['states'])} states, this "
                             f"model's cache {len(template.states)}")
        snapshot = copy.copy(template)
        layers = enumerate(zip(template.states, item["states"], template.linear))
        snapshot.states = [_state_from_meta(path, empty, meta, f"{index}.{layer}",
                                            functools.partial(take, grows=not fixed))
                           for layer, (empty, meta, fixed) in layers]
        snapshot.positions, snapshot.seen = take(f"{index}.positions", template.positions), item["seen"]
        entries.append((item["key"], item["blocks"], item["parent"], snapshot))
    if used != tensors.keys():
        raise ValueError(f"PrefixCache.load: {path} holds tensors no snapshot uses: "
                         f"{', '.join(sorted(tensors.keys() - used))}")
    return entries


def policy_json(policy) -> dict | None:
    """A cache policy (None, a CachePolicy, or ``{state index: CachePolicy}``) as JSON-able data."""
    if policy is None:
        return None
    if isinstance(policy, Mapping):
        return {"per_state": {str(index): dataclasses.asdict(p) for index, p in sorted(policy.items())}}
    return {"all": dataclasses.asdict(policy)}


def policy_from_json(data: dict | None):
    from hybridlm.cache.kv.policy import CachePolicy

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


def _state_from_meta(path, empty: LayerState, meta: dict, prefix: str, take) -> LayerState:
    """The state :func:`_state_meta` described, rebuilt on ``empty`` (the model's own empty state of that layer);
    ``take(name, like)`` is the file's tensor ``name``, checked against ``like``."""
    if meta.get("type") != type(empty).__name__:
        raise ValueError(f"PrefixCache.load: {path}: state {prefix} is a {meta.get('type')} in the file, a "
                         f"{type(empty).__name__} in this model's cache")
    if isinstance(empty, StateGroup):
        if meta["parts"].keys() != empty.parts.keys():
            raise ValueError(f"PrefixCache.load: {path}: state {prefix} has the parts {sorted(meta['parts'])}, this "
                             f"model's {sorted(empty.parts)}")
        return StateGroup({name: _state_from_meta(path, part, meta["parts"][name], f"{prefix}.{name}", take)
                           for name, part in empty.parts.items()})
    values = {}
    for field in dataclasses.fields(empty):
        value = getattr(empty, field.name)
        if field.name in meta["fields"] and not isinstance(value, torch.Tensor):
            values[field.name] = meta["fields"][field.name]
        else:
            values[field.name] = take(f"{prefix}.{field.name}", value if isinstance(value, torch.Tensor) else None)
    return dataclasses.replace(empty, **values)
