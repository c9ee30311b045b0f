"""The models shipped in the package: present, small, loadable by transformers' Auto classes, and trained."""

import json

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
