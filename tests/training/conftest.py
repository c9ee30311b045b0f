"""Inputs of the pretraining tests (test_pretrain.py, and the torchrun run of the recipe in test_distributed.py):
a tiny corpus of real Python, a tiny model config, and the recipe's arguments for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY_MODEL = dict(hidden_size=32, layer_pattern="SASM", num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, mamba_d_state=4, mamba2_d_state=8, mamba2_head_dim=16, mamba2_chunk_size=8)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few small Python files from the standard library: real text, tiny."""
    import csv
    import heapq
    import textwrap

    root = tmp_path_factory.mktemp("corpus")
    for module in (csv, heapq, textwrap):
        (root / Path(module.__file__).name).write_text(Path(module.__file__).read_text()[:6000])
    return root


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.json"
    path.write_text(json.dumps(TINY_MODEL))
    return path


def args_for(corpus: Path, model: Path | str, out: Path, *extra: str) -> list[str]:
    """``recipes/pretrain.py`` arguments: 4 rows of 32 tokens per step, a 300-entry BPE, evaluation and a
    checkpoint every 3 steps, metrics every step."""
    return ["--model", str(model), "--data", str(corpus / "csv.py"), str(corpus / "heapq.py"), "--eval-data",
            str(corpus / "textwrap.py"), "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4",
            "--lr", "1e-2", "--warmup", "2", "--eval-every", "3", "--eval-rows", "2", "--save-every", "3",
            "--log-every", "1", "--sample", "", "--out", str(out), *extra]
