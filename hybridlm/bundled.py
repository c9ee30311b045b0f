"""The small models shipped inside the package, trained with ``hybridlm train`` (docs/training.md says how):
a 1:3 attention:Mamba-2 hybrid and its all-attention twin of about the same size, with their tokenizer."""

from __future__ import annotations

from pathlib import Path

#: name -> directory under ``hybridlm/bundled_models``; the first is the default.
BUNDLED_MODELS = {"hybrid": "hybrid-tiny", "attention": "attention-tiny"}
_ROOT = Path(__file__).resolve().parent / "bundled_models"


def bundled_model_dir(name: str | None = None) -> Path:
    """The ``save_pretrained`` directory of a bundled model (``"hybrid"`` by default, or ``"attention"``):
    ``HybridForCausalLM.from_pretrained`` / ``AutoModelForCausalLM`` and ``AutoTokenizer`` load it."""
    name = name or next(iter(BUNDLED_MODELS))
    if name not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {name!r}; bundled: {', '.join(BUNDLED_MODELS)}")
    path = _ROOT / BUNDLED_MODELS[name]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the bundled model {name!r} is missing from this installation ({path}); "
                                "reinstall hybridlm, or train one with 'hybridlm train' (docs/training.md)")
    return path


def load_bundled(name: str | None = None):
    """A bundled model in float32 (its weights are stored in bfloat16 to keep the package small) and its
    tokenizer, in eval mode."""
    import torch
    from transformers import AutoTokenizer

    from hybridlm.model import HybridForCausalLM

    path = bundled_model_dir(name)
    return HybridForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
