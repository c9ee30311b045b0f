"""Copy trained models into the package (hybridlm/bundled_models), weights in bfloat16, and measure them.

    python recipes/bundle_models.py --hybrid runs/hybrid-tiny --attention runs/attention-tiny

Each model is evaluated as shipped (its bfloat16 weights, computed in float32) on all held-out standard-library
files; the figures and the training summary go to ``eval.json`` beside the weights and are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hybridlm import HybridForCausalLM
from hybridlm.bundled import BUNDLED_MODELS
from hybridlm.files import publish_directory, staged_directory, write_file
from hybridlm.training import stdlib_corpus
from hybridlm.training.evaluation import HeldOut
from hybridlm.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1] / "hybridlm" / "bundled_models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def training_summary(run: Path) -> dict:
    train = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    return {"steps": train[-1]["step"], "tokens": train[-1]["tokens"], "train_seconds": train[-1]["elapsed_s"],
            "final_train_loss": train[-1]["loss"]}


def bundle(name: str, run: Path, seq_len: int) -> dict:
    """Write the bundled model ``name`` from training output ``run``: staged beside the old one, which is
    replaced only once the new one is complete (hybridlm.files)."""
    target = ROOT / BUNDLED_MODELS[name]
    staged = staged_directory(target)
    model = HybridForCausalLM.from_pretrained(run, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(staged)
    config_file = staged / "config.json"  # stored in bfloat16, loaded (dtype="auto") and computed in float32
    write_file(config_file, json.dumps({**json.loads(config_file.read_text()), "dtype": "float32"}, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        shutil.copy(run / file, staged / file)
    shipped = HybridForCausalLM.from_pretrained(staged, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(staged)
    held_out = HeldOut.of(tokenizer, stdlib_corpus().held_out_texts, seq_len)
    figures = {"model": name, "parameters": sum(p.numel() for p in shipped.parameters()),
               **held_out.evaluate(shipped, "stream"), **training_summary(run)}
    write_file(staged / "eval.json", json.dumps(figures, indent=1) + "\n")
    publish_directory(target)
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in BUNDLED_MODELS:
        parser.add_argument(f"--{name}", type=Path, required=True, help=f"training output of the {name} model")
    parser.add_argument("--seq-len", type=int, default=512, help="held-out rows as in training")
    args = parser.parse_args(argv)
    for name in BUNDLED_MODELS:
        print(json.dumps(bundle(name, getattr(args, name), args.seq_len)))


if __name__ == "__main__":
    main()
