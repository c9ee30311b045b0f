"""Checkpoint and exact resume of a single-process run: model weights in safetensors, the optimizer,
scheduler, step and RNG states in a tensors-only file loaded with ``weights_only=True``.

``OUT/checkpoint`` is published crash-safely (:mod:`hybridlm.files`): staged as ``checkpoint.tmp``, closed by a
manifest of sha256 digests, renamed into place, the previous one deleted only after that; every file is checked
against the manifest when it is read back."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save

from hybridlm.files import (
    load_safetensors,
    load_torch,
    parse_json,
    publish_directory,
    read_checked,
    read_manifest,
    recover_directory,
    recoverable,
    staged_directory,
    staging_path,
    torch_bytes,
    write_file,
)

CHECKPOINT_DIR = "checkpoint"
WEIGHTS, TRAINER_STATE, CONFIG = "model.safetensors", "trainer_state.pt", "config.json"


def _config_dict(model) -> dict:
    return json.loads(model.config.to_json_string(use_diff=False))


def start_checkpoint(out: Path) -> Path:
    """The empty staging directory of the next checkpoint (what an interrupted save left is recovered first)."""
    return staged_directory(out / CHECKPOINT_DIR)


def finish_checkpoint(out: Path, model) -> Path:
    """Write the model's configuration into the staged checkpoint and publish it in place of the previous one."""
    write_file(staging_path(out / CHECKPOINT_DIR) / CONFIG, json.dumps(_config_dict(model), indent=1, sort_keys=True))
    publish_directory(out / CHECKPOINT_DIR)
    return out / CHECKPOINT_DIR


def save_checkpoint(out: Path, model, optimizer, scheduler, state: dict) -> Path:
    """Write ``OUT/checkpoint``; a kill at any point leaves the previous checkpoint or this one."""
    staged = start_checkpoint(out)
    weights = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    write_file(staged / WEIGHTS, save(_untie(weights)))
    write_file(staged / TRAINER_STATE, torch_bytes({"optimizer": optimizer.state_dict(),
                                                    "scheduler": scheduler.state_dict(),
                                                    "rng": torch.get_rng_state(), **state}))
    return finish_checkpoint(out, model)


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: copy tensors that alias one already kept (tied embeddings)."""
    seen, result = set(), {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        result[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return result


def check_new_run(out: Path, remedy: str = "pass --resume to continue it, or another --out") -> None:
    """A new run (no ``--resume``) must not overwrite a checkpoint, nor one a kill left half published; the
    error ends with ``remedy``."""
    found = recoverable(out / CHECKPOINT_DIR)
    if found:
        raise FileExistsError(f"--out {out} already holds a checkpoint ({', '.join(map(str, found))}): {remedy}")


def recover_checkpoint(out: Path) -> None:
    """Finish or undo the save of ``OUT/checkpoint`` that a kill interrupted, if any (main process only)."""
    recover_directory(out / CHECKPOINT_DIR)


def existing_checkpoint(out: Path) -> Path:
    """``OUT/checkpoint``; FileNotFoundError when there is none to resume."""
    path = out / CHECKPOINT_DIR
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {out} (expected {path}/{TRAINER_STATE})")
    return path


#: Config fields that say where a model came from or how it is stored, not what it is: a run moved to another
#: folder (its student loaded from ``OUT/transfer`` there) resumes.
NOT_THE_MODEL = ("transformers_version", "dtype", "_name_or_path")


def check_resumable(out: Path, model) -> Path:
    """The checkpoint directory, after checking it exists and was written for this model's configuration."""
    path = existing_checkpoint(out)
    saved = parse_json(read_checked(path, CONFIG, read_manifest(path)), path / CONFIG)
    current = _config_dict(model)
    differing = sorted(k for k in set(saved) | set(current)
                       if saved.get(k) != current.get(k) and k not in NOT_THE_MODEL)
    if differing:
        raise ValueError(f"--resume: the checkpoint in {path} is of another model (config fields differ: "
                         f"{', '.join(differing)})")
    return path


def load_trainer_state(path: Path, manifest: dict | None) -> dict:
    """The scheduler, RNG and counters saved in checkpoint ``path``, the RNG and scheduler not yet applied."""
    return load_torch(read_checked(path, TRAINER_STATE, manifest), path / TRAINER_STATE)


def load_checkpoint(out: Path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``OUT/checkpoint``; returns the saved state dict."""
    path = check_resumable(out, model)
    manifest = read_manifest(path)
    weights, _ = load_safetensors(read_checked(path, WEIGHTS, manifest), path / WEIGHTS)
    state = load_trainer_state(path, manifest)
    model.load_state_dict(weights)
    optimizer.load_state_dict(state.pop("optimizer"))
    scheduler.load_state_dict(state.pop("scheduler"))
    torch.set_rng_state(state.pop("rng"))
    return state
