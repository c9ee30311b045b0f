"""``hybridlm.load``: any checkpoint hybridlm reads, as a :class:`~hybridlm.HybridForCausalLM`."""

from __future__ import annotations

import os

import torch

from hybridlm.formats.gguf import read_gguf  # imports the optional ``gguf`` package when called
from hybridlm.model.checkpoint_io import build_foreign, load_pretrained
from hybridlm.model.modeling import HybridForCausalLM
from hybridlm.paths import split_gguf_path


def load(path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
         gguf_file: str | None = None) -> HybridForCausalLM:
    """Load a checkpoint directory (or hub id) of any supported architecture, hybridlm's own included, or a GGUF
    file (``path`` ending in ``.gguf``, or a directory and ``gguf_file``; needs the ``gguf`` extra)."""
    located = split_gguf_path(path, gguf_file)
    if located is not None:
        foreign_config, state = read_gguf(*located, dtype=dtype)
        return build_foreign(HybridForCausalLM, foreign_config, state, str(located[0] / located[1]), dtype, device)
    return load_pretrained(HybridForCausalLM, path, dtype=dtype, device_map=device)
