"""hybridlm: hybrid Transformer-SSM language models with one cache for every layer kind.

The public names below are imported on first use, so that ``import hybridlm`` (and the ``hybridlm`` command's
``--help``) does not import torch or transformers. The first use of any of them also registers
``model_type="hybridlm"`` with transformers' Auto classes (:mod:`hybridlm.hf_compat`).
"""

from __future__ import annotations

import importlib

#: Public name -> the module defining it.
_PUBLIC = {
    "HybridCache": "cache",
    "HybridConfig": "config",
    "HybridForCausalLM": "model",
    "HybridModel": "model",
    "load": "formats",
    "bundled_model_dir": "bundled",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hybridlm' has no attribute {name!r}")
    importlib.import_module(".model", __name__)  # defines the model classes and registers them with transformers
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
