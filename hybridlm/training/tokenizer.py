"""Byte-level BPE tokenizers trained with the ``tokenizers`` library and saved so ``AutoTokenizer`` loads them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenisation, every byte in the base alphabet, so any text encodes)
    with one special token, ``<|endoftext|>``, that separates documents. Returns a
    ``PreTrainedTokenizerFast``; ``save_pretrained`` writes ``tokenizer.json`` + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 258 entries (256 bytes, "
                         "the end-of-text token and one merge)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return _wrapped(tokenizer)


def bpe_tokenizer_from_json(text: str):
    """The tokenizer :func:`train_bpe_tokenizer` returned, from its ``backend_tokenizer.to_str()``."""
    from tokenizers import Tokenizer

    return _wrapped(Tokenizer.from_str(text))


def _wrapped(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   unk_token=None, model_max_length=UNLIMITED_LENGTH)


def load_tokenizer(path: str | Path):
    """A tokenizer saved in a directory (``AutoTokenizer.from_pretrained``), with a clear error when missing."""
    from transformers import AutoTokenizer

    from hybridlm.files import DamagedFileError

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--tokenizer {path}: no such directory")
    if not has_tokenizer(path):
        raise FileNotFoundError(f"{path} holds no tokenizer (tokenizer.json or tokenizer_config.json); "
                                "pass --tokenizer DIR")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as error:  # json, tokenizers and transformers each raise their own kinds
        raise DamagedFileError(f"{path}: its tokenizer files cannot be read ({type(error).__name__}: {error})") \
            from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer {path}: the tokenizer has no eos_token to separate documents")
    return tokenizer


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: text in and out for byte-level models saved without a tokenizer."""

    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds tokenizer files ``AutoTokenizer`` reads."""
    return Path(directory, "tokenizer.json").is_file() or Path(directory, "tokenizer_config.json").is_file()


def tokenizer_for(directory: str | Path, vocab_size: int):
    """The tokenizer saved in ``directory`` (checked to fit the model's ``vocab_size``); else
    :class:`ByteTokenizer` for a 256-token (byte-level) model; else None."""
    if has_tokenizer(directory):
        from transformers import AutoTokenizer

        return check_tokenizer_fits(AutoTokenizer.from_pretrained(directory), vocab_size, directory)
    return ByteTokenizer() if vocab_size == 256 else None


#: ``model_max_length`` of a tokenizer whose model has no context limit (every mixer a fixed-size state):
#: transformers' and lm-eval's "as long as you like" (they score a document in one window).
UNLIMITED_LENGTH = 1 << 30


def record_context_length(tokenizer, config, seq_len: int) -> None:
    """Set ``tokenizer.model_max_length``, which harnesses read as the model's context (lm-eval, when the config
    has no ``max_position_embeddings``): the length the model was trained at if any of its layers grows with the
    context (attention), else :data:`UNLIMITED_LENGTH`."""
    grows = any(cls.grows_with_context for cls in config.used_mixers.values())
    tokenizer.model_max_length = seq_len if grows else UNLIMITED_LENGTH


def check_tokenizer_fits(tokenizer, vocab_size: int, source) -> object:
    """``tokenizer``, if every id it can produce is below ``vocab_size`` (a model may have more rows than the
    tokenizer has tokens, never fewer); otherwise an error naming ``source``."""
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer in {source} has {len(tokenizer)} tokens but the model has "
                         f"vocab_size={vocab_size}: it is not this model's tokenizer")
    return tokenizer
