"""The models shipped in the package: present, small, loadable by transformers' Auto classes, and trained."""

import glob
import json
from pathlib import Path

import pytest
import torch

from hybridlm import bundled_model_dir
from hybridlm.bundled import BUNDLED_MODELS, load_bundled


@pytest.mark.parametrize("name", list(BUNDLED_MODELS))
def test_bundled_model_is_small_and_loads_with_auto_classes(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model_dir(name)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 12 * 2**20
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.float32  # stored in bfloat16, computed in float32
    assert model.config.vocab_size == len(tokenizer)
    figures = json.loads((path / "eval.json").read_text())
    assert figures["bits_per_byte"] < 2.0 and figures["train_seconds"] >= 3600


def test_default_is_the_hybrid_and_unknown_names_are_errors():
    assert bundled_model_dir() == bundled_model_dir("hybrid")
    with pytest.raises(ValueError, match="unknown bundled model 'gpt'"):
        bundled_model_dir("gpt")


def test_bundled_hybrid_predicts_python():
    """Teacher-forced on a line it has not seen verbatim, it ranks most next tokens among its top 5."""
    model, tokenizer = load_bundled()
    ids = tokenizer("    def __init__(self, name, value=None):\n        self.name = name\n        self.value = value\n",
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    top5 = logits.topk(5, dim=-1).indices
    hits = (top5 == ids[0, 1:, None]).any(-1).float().mean().item()
    assert hits > 0.6, hits


def test_package_data_ships_every_bundled_file():
    """pyproject's package-data globs (resolved as setuptools does, from the package directory) cover every file
    of every bundled model, so a wheel carries them; checked by hand too: the wheel lists all 12 files."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    package = Path(bundled_model_dir()).parents[1]
    patterns = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {Path(name) for pattern in patterns["hybridlm"] for name in glob.glob(pattern, root_dir=package)}
    bundled = {path.relative_to(package) for name in BUNDLED_MODELS for path in bundled_model_dir(name).iterdir()
               if path.is_file()}
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= {path.name for path in bundled}
    assert bundled <= shipped, f"not in the wheel: {sorted(map(str, bundled - shipped))}"
