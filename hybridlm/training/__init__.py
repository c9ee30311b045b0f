"""Training beside the model, not inside it: corpora, tokenizers, packing, the loop, checkpoints and metrics.

The model code knows nothing of this package; recipes in ``recipes/`` and ``hybridlm train`` are thin fronts.
May import everything below the command line (decoding, the model, formats, config, mixers, cache, layers, ops).
Names are imported on first use (``hybridlm train --help`` does not import torch).
"""

from __future__ import annotations

import importlib

#: Public name -> the module defining it.
_PUBLIC = {
    "HELD_OUT_STDLIB": "corpus", "Corpus": "corpus", "stdlib_corpus": "corpus", "text_corpus": "corpus",
    "TrainConfig": "config", "evaluate": "loop", "train": "loop",
    "PackedRows": "packing", "pack_documents": "packing",
    "load_tokenizer": "tokenizer", "train_bpe_tokenizer": "tokenizer",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hybridlm.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value
