"""hybridlm: hybrid Transformer-SSM language models with one cache for every layer kind.

The public names below are imported on first use, so that ``import hybridlm`` (and the ``hybridlm`` command's
``--help``) does not import torch or transformers. ``model_type="hybridlm"`` is registered with transformers'
Auto classes (:mod:`hybridlm.model.hf_compat`) as soon as both hybridlm and transformers are imported, in either order:
``import hybridlm`` then ``AutoModelForCausalLM.from_pretrained(...)`` works as for any architecture.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: Public name -> the module defining it.
_PUBLIC = {
    "CachePolicy": "cache",
    "HybridCache": "cache",
    "HybridConfig": "config",
    "HybridForCausalLM": "model",
    "HybridModel": "model",
    "PrefixCache": "decoding",
    "SpeculativeDecoding": "decoding",
    "load": "model",
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


def _register_auto_classes() -> None:
    """Define the model classes, which registers them with transformers' Auto classes."""
    importlib.import_module(".model", __name__)


class _RegisterWhenTransformersLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_auto_classes` right after ``transformers`` is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            if "hybridlm.config" not in sys.modules:  # else hybridlm.model is being imported: it registers itself
                _register_auto_classes()

        spec.loader.exec_module = exec_module
        return spec


if "transformers" in sys.modules:
    _register_auto_classes()
elif not any(isinstance(finder, _RegisterWhenTransformersLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenTransformersLoads())
