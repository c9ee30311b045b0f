"""The recipes run end to end at toy scale."""

import importlib.util
import math
from pathlib import Path

import torch

from hybridlm import HybridForCausalLM

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretrain_bytes_trains_saves_and_reloads(tmp_path):
    recipe = load_recipe("pretrain_bytes")
    first = recipe.main(["--steps", "1", "--hidden", "32", "--batch", "4", "--length", "32", "--lr", "0"])
    last = recipe.main(["--steps", "25", "--hidden", "32", "--batch", "4", "--length", "32",
                        "--corpus-bytes", "50000", "--out", str(tmp_path)])
    assert math.isfinite(last) and last < first - 0.5  # from ~ln(256) = 5.5 towards byte statistics
    model = HybridForCausalLM.from_pretrained(tmp_path)
    assert model.config.vocab_size == 256
    assert model(torch.tensor([[100, 101]])).logits.shape == (1, 2, 256)
