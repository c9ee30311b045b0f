"""Training beside the model, not inside it: corpora, tokenizers, packing, the loop, checkpoints and metrics.

The model code knows nothing of this package; recipes in ``recipes/`` and ``hybridlm train`` are thin fronts.
"""

from .corpus import HELD_OUT_STDLIB, Corpus, stdlib_corpus, text_corpus
from .loop import TrainConfig, evaluate, train
from .packing import PackedRows, pack_documents
from .tokenizer import load_tokenizer, train_bpe_tokenizer

__all__ = [
    "HELD_OUT_STDLIB", "Corpus", "PackedRows", "TrainConfig", "evaluate", "load_tokenizer", "pack_documents",
    "stdlib_corpus", "text_corpus", "train", "train_bpe_tokenizer",
]
