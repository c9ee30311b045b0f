"""Checkpoint and exact resume of a single-process run: model weights in safetensors, the optimizer,
scheduler, step and RNG states in a tensors-only file loaded with ``weights_only=True``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CHECKPOINT_DIR = "checkpoint"


def _config_dict(model) -> dict:
    return json.loads(model.config.to_json_string(use_diff=False))


def save_checkpoint(out: Path, model, optimizer, scheduler, state: dict) -> Path:
    """Write ``OUT/checkpoint`` atomically (a temporary directory renamed over the old one)."""
    final, temporary = out / CHECKPOINT_DIR, out / (CHECKPOINT_DIR + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    weights = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(_untie(weights), temporary / "model.safetensors")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(), **state}, temporary / "trainer_state.pt")
    (temporary / "config.json").write_text(json.dumps(_config_dict(model), indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    temporary.rename(final)
    return final


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: copy tensors that alias one already kept (tied embeddings)."""
    seen, result = set(), {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        result[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return result


def check_resumable(out: Path, model) -> Path:
    """The checkpoint directory, after checking it exists and was written for this model's configuration."""
    path = out / CHECKPOINT_DIR
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {out} (expected {path}/trainer_state.pt)")
    saved = json.loads((path / "config.json").read_text())
    current = _config_dict(model)
    differing = sorted(k for k in set(saved) | set(current)
                       if saved.get(k) != current.get(k) and k not in ("transformers_version", "dtype"))
    if differing:
        raise ValueError(f"--resume: the checkpoint in {path} is of another model (config fields differ: "
                         f"{', '.join(differing)})")
    return path


def load_checkpoint(out: Path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``OUT/checkpoint``; returns the saved state dict."""
    path = check_resumable(out, model)
    model.load_state_dict(load_file(path / "model.safetensors"))
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    optimizer.load_state_dict(state.pop("optimizer"))
    scheduler.load_state_dict(state.pop("scheduler"))
    torch.set_rng_state(state.pop("rng"))
    return state
