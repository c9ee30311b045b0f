"""Foreign checkpoint formats: one small module per architecture, registered here by ``model_type``.

:func:`load` reads any supported checkpoint into a :class:`~hybridlm.HybridForCausalLM`; :func:`export`
writes a model back in a format transformers loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .base import (
    CheckpointFormat,
    check_expressible,
    check_state,
    read_config,
    read_weights,
    resolve_directory,
    undeclared_options,
)

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


def load(path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str | None = None):
    """Load a checkpoint directory (or hub id) of any supported architecture, hybridlm's own included."""
    from ..model import HybridForCausalLM

    directory = resolve_directory(path)
    foreign_config = read_config(directory)
    if foreign_config.get("model_type") == "hybridlm":
        return HybridForCausalLM.from_pretrained(directory, dtype=dtype, device_map=device)
    fmt = detect(foreign_config)
    config = fmt.to_config(foreign_config)
    state = fmt.import_weights(read_weights(directory), config, foreign_config)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    check_state(expected, state, f"{directory} ({fmt.model_type})")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(device=device or "cpu", dtype=dtype)
    return model.eval()


def export(model, directory: str | os.PathLike, model_type: str) -> None:
    """Write ``model`` as a ``model_type`` checkpoint that transformers loads as that architecture."""
    from safetensors.torch import save_file

    fmt = FORMATS.get(model_type)
    if fmt is None or fmt.from_config is None:
        writable = sorted(name for name, f in FORMATS.items() if f.from_config is not None)
        raise ValueError(f"cannot export to model_type={model_type!r}; hybridlm writes "
                         f"{', '.join(['hybridlm'] + writable)}")
    check_expressible(model_type, undeclared_options(model.config, fmt))
    foreign_config = fmt.from_config(model.config)  # raises, before anything is written, if the model does not fit
    foreign_config.setdefault("dtype", str(model.dtype).removeprefix("torch."))  # what dtype="auto" loads as
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # transformers omits the tied head (and safetensors refuses shared tensors)
        state.pop("lm_head.weight", None)
    state = fmt.export_weights(state, model.config)
    (out / "config.json").write_text(json.dumps(foreign_config, indent=2, sort_keys=True))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


# Format modules register themselves on import; add new ones here.
from . import bamba, falcon_h1, granitemoehybrid, jamba, mamba, mamba2, mamba_ssm, nemotron_h, zamba2  # noqa: E402, F401

__all__ = ["FORMATS", "CheckpointFormat", "detect", "export", "load", "register", "supported"]
