"""GGUF files (llama.cpp's format), read through transformers' dequantizer: the file's config and tensors become
a transformers checkpoint of a family hybridlm reads (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ...), which
the family's format maps like any other. Needs the optional extra ``gguf`` (the ``gguf`` and ``accelerate``
packages); every tensor is dequantized to fp32 (or ``dtype``), so a Q4 file loads at full precision.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridlm.formats.mapping import StateDict

EXTRA_HINT = "pip install 'hybridlm[gguf]' (the gguf and accelerate packages)"


def _require_extra() -> None:
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError as error:
            raise ImportError(f"reading GGUF files needs the {package!r} package: {EXTRA_HINT}") from error


def check_gguf_file(file: Path) -> None:
    """Parse the header and tensor table of ``file`` and check every tensor lies inside it and has a type the
    dequantizer implements; errors name the file (and the tensor)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(file)
    except Exception as error:  # numpy raises on a short memmap, gguf on a bad magic or version
        raise ValueError(f"cannot read {file} (truncated or not a GGUF file?): {error}") from error
    size = file.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ValueError(f"{file} is truncated: tensor {tensor.name} ends at byte "
                             f"{tensor.data_offset + tensor.n_bytes}, the file has {size}")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        try:  # one row: whether this type has a dequantizer at all
            dequantize(tensor.data.reshape(-1, tensor.data.shape[-1])[:1], qtype)
        except NotImplementedError as error:
            raise ValueError(f"{file}: tensor {tensor.name} is {qtype.name}, which transformers cannot dequantize "
                             f"({error})") from error


def read_gguf(directory: Path, name: str, dtype: torch.dtype | None = None) -> tuple[dict, StateDict]:
    """``(foreign config dict, state dict with transformers' names)`` of the GGUF file ``directory / name``,
    dequantized by transformers. The transformers model is dropped at once; its tensors are the ones returned,
    so the weights are held once."""
    _require_extra()
    file = directory / name
    check_gguf_file(file)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config,
                                                     dtype=dtype or torch.float32)
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        raise ValueError(f"cannot load {file} through transformers' GGUF reader: {error}") from error
    state = {key: value.detach() for key, value in model.state_dict().items()}
    return model.config.to_dict(), state


def read_gguf_tokenizer(directory: Path, name: str):
    """The tokenizer transformers builds from the GGUF file's vocabulary (and chat template); None when the file
    holds no vocabulary."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    if "tokenizer.ggml.model" not in GGUFReader(directory / name).fields:
        return None
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)
