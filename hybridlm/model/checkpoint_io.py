"""Whole checkpoints in and out, in any format: hybridlm's own (through transformers' ``from_pretrained``,
made strict) and every foreign format of :mod:`hybridlm.formats` (mapped, checked, built on the meta device).

The model class is a parameter, not an import: the model classes call this module from ``from_pretrained`` and
``save_pretrained``, and :func:`hybridlm.load` (:mod:`hybridlm.model.loading`) passes the causal LM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from hybridlm.config import HybridConfig
from hybridlm.files import write_file, written_aside
from hybridlm.formats import (
    FORMATS,
    check_expressible,
    check_state,
    detect,
    is_own,
    public_fields,
    read_config,
    read_weights,
    resolve_directory,
    safetensors_files,
    undeclared_options,
)


def load_pretrained(cls, path: str | os.PathLike, *args, **kwargs):
    """The one checkpoint loader, behind :func:`hybridlm.load` and ``from_pretrained`` of hybridlm's model classes
    (``cls``): resolves
    ``path`` once and reads its ``config.json`` once. hybridlm's own checkpoints load through transformers'
    ``from_pretrained`` (every loading argument works), strictly: a missing, unexpected or mis-shaped weight is
    an error naming it. A foreign checkpoint loads into a class that ``reads_foreign_checkpoints`` (the causal
    LM) and takes only ``dtype`` and ``device_map``."""
    directory = resolve_directory(path)  # a hub id is resolved here, once
    if isinstance(kwargs.get("config"), HybridConfig):  # read already (AutoModel reads it for AutoConfig)
        return _load_own(cls, directory, {}, args, kwargs)
    # read_config names a missing config.json (transformers would build a default, randomly initialised model)
    config_dict = read_config(directory)
    if is_own(config_dict):
        return _load_own(cls, directory, config_dict, args, kwargs)
    if not cls.reads_foreign_checkpoints:
        raise TypeError(f"{cls.__name__}.from_pretrained reads hybridlm checkpoints only; {directory} is a "
                        f"{config_dict.get('model_type')!r} checkpoint: load it with hybridlm.load()")
    if args or set(kwargs) - {"dtype", "device_map"}:
        raise TypeError(f"foreign checkpoints take only dtype= and device_map=, got {sorted(kwargs)}")
    return _load_foreign(cls, directory, config_dict, kwargs.get("dtype"), kwargs.get("device_map"))


def _load_own(cls, directory: Path, config_dict: dict, args: tuple, kwargs: dict):
    """transformers' ``from_pretrained`` with the config already read (keyword arguments that are HybridConfig
    fields override it, as in transformers), then the check it does not make."""
    safetensors_files(directory)  # a truncated file is an error naming it (transformers' does not say which)
    kwargs = dict(kwargs)
    if kwargs.get("config") is None:
        fields = {name for name in HybridConfig.__dataclass_fields__ if not name.startswith("_")}
        overrides = {name: kwargs.pop(name) for name in list(kwargs) if name in fields and name != "dtype"}
        kwargs["config"] = HybridConfig.from_dict({**config_dict, **overrides})
    wants_info = kwargs.pop("output_loading_info", False)
    model, info = PreTrainedModel.from_pretrained.__func__(cls, directory, *args, output_loading_info=True, **kwargs)
    problems = [f"{kind.replace('_', ' ')}: {', '.join(sorted(map(str, info[kind])))}"
                for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(kind)]
    if problems:
        raise ValueError(f"{directory} does not match {cls.__name__}: " + " | ".join(problems))
    return (model, info) if wants_info else model


def _load_foreign(cls, directory: Path, foreign_config: dict, dtype, device):
    """A foreign checkpoint directory as a ``cls`` (see :func:`build_foreign`)."""
    detect(foreign_config)  # an unsupported or refused architecture fails before its weights are read
    return build_foreign(cls, foreign_config, read_weights(directory), str(directory), dtype, device)


def build_foreign(cls, foreign_config: dict, foreign_state, source: str, dtype, device):
    """A ``cls`` (the causal LM) from a foreign config and its weights (transformers' names): both mapped by the
    format, every weight checked, built on the meta device and filled in place (the weights are not copied)."""
    fmt = detect(foreign_config)
    config = fmt.to_config(foreign_config)
    state = fmt.import_weights(foreign_state, config, foreign_config)
    with torch.device("meta"):
        model = cls(config)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    check_state(expected, state, f"{source} ({fmt.model_type})")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(device=device or "cpu", dtype=dtype)
    return model.eval()


def export(model, directory: str | os.PathLike, model_type: str) -> None:
    """Write ``model`` as a ``model_type`` checkpoint that transformers loads as that architecture; each file is
    written aside and renamed into place (a kill leaves the old file or the new one)."""
    fmt = FORMATS.get(model_type)
    if fmt is None or fmt.from_config is None:
        writable = sorted(name for name, f in FORMATS.items() if f.from_config is not None)
        raise ValueError(f"cannot export to model_type={model_type!r}; hybridlm writes "
                         f"{', '.join(['hybridlm'] + writable)}")
    check_expressible(model_type, undeclared_options(model.config, fmt))
    foreign_config = fmt.from_config(model.config)  # raises, before anything is written, if the model does not fit
    if "model_type" in foreign_config:  # a transformers config (mamba-ssm's takes no other keys than its own)
        foreign_config = public_fields(foreign_config)
        foreign_config.setdefault("dtype", str(model.dtype).removeprefix("torch."))  # what dtype="auto" loads as
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # transformers omits the tied head (and safetensors refuses shared tensors)
        state.pop("lm_head.weight", None)
    state = fmt.export_weights(state, model.config)
    with written_aside(out / fmt.weights_name) as weights:
        if fmt.weights_name.endswith(".bin"):
            torch.save(state, weights)
        else:
            save_file(state, weights, metadata={"format": "pt"})
    write_file(out / "config.json", json.dumps(foreign_config, indent=2, sort_keys=True))
    if getattr(model, "generation_config", None) is not None:
        write_file(out / "generation_config.json", model.generation_config.to_json_string())
