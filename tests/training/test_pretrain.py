"""Pretraining end to end at toy scale: data, tokenizer, packing, exact resume, outputs, and bad input."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridlm import HybridConfig, HybridForCausalLM
from hybridlm.training import pretrain
from hybridlm.training.packing import pack_documents, rows_for_step

from .conftest import TINY_MODEL, args_for


def test_packing_restarts_positions_at_document_starts():
    eos = 0
    rows = pack_documents(torch.tensor([5, 6, 0, 7, 8, 9, 0, 1, 2, 3, 4, 0, 9]), seq_len=4, eos_id=eos)
    assert rows.ids.tolist() == [[5, 6, 0, 7], [8, 9, 0, 1], [2, 3, 4, 0]]
    # a document cut by a row boundary continues as a new document (position 0) in the next row
    assert rows.positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 0], [0, 1, 2, 3]]
    batch = rows.batch(torch.tensor([0]), "documents")
    assert batch["labels"].tolist() == [[-100, 6, 0, -100]]  # nothing predicts a document's first token
    assert "position_ids" not in rows.batch(torch.tensor([0]), "stream")


def test_row_order_is_a_function_of_step_and_covers_each_epoch():
    epoch = torch.cat([rows_for_step(step, 4, 12, seed=3) for step in range(3)])
    assert sorted(epoch.tolist()) == list(range(12))
    assert torch.equal(rows_for_step(4, 4, 12, seed=3), rows_for_step(4, 4, 12, seed=3))
    assert not torch.equal(rows_for_step(3, 4, 12, seed=3), rows_for_step(0, 4, 12, seed=3))  # a new epoch order


def test_pretrain_learns_saves_and_loads_with_auto_classes(corpus, model_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    last = pretrain.main(args_for(corpus, model_file, tmp_path, "--steps", "12"))
    said = capsys.readouterr().out  # each slow phase says what it is doing before it starts
    assert said.index("reading the corpus") < said.index("preparing the tokenizer") < said.index("tokenizing")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_loss" in r]
    assert {"step", "loss", "lr", "tokens", "tokens_per_s"} <= set(train_rows[0])
    assert {"eval_loss", "bits_per_byte"} <= set(eval_rows[-1])
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0  # from ~ln(300) = 5.7 towards the text's statistics
    if importlib.util.find_spec("matplotlib"):  # the optional `plot` extra (in `dev`)
        assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    else:
        assert not (tmp_path / "loss.png").exists()
    assert last["step"] == 12 and last["tokens"] == 12 * 4 * 32
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.vocab_size == len(tokenizer) == 300
    assert tokenizer.model_max_length == 32  # the trained length, what lm-eval scores windows of
    ids = tokenizer("def heappush(heap, item):", return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == "def heappush(heap, item):"  # byte-level: text round-trips exactly
    assert model(ids).logits.shape == (1, ids.shape[1], 300)
    # bits per byte: nats per token x the held-out text's tokens per byte (end-of-text counted as one) / ln 2; the
    # final evaluation covers every full held-out row
    text = (corpus / "textwrap.py").read_text()
    tokens, text_bytes = len(tokenizer(text)["input_ids"]) + 1, len(text.encode()) + 1
    final = eval_rows[-1]
    assert final["bits_per_byte"] == pytest.approx(final["eval_loss"] * tokens / text_bytes / math.log(2), rel=1e-9)
    assert final["eval_tokens"] == tokens // 32 * 32 > eval_rows[0]["eval_tokens"] == 2 * 32


def test_resume_continues_exactly(corpus, model_file, tmp_path, monkeypatch):
    """A run stopped after its step-3 checkpoint and resumed ends with the weights of an uninterrupted run."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    pretrain.main(args_for(corpus, model_file, whole, "--steps", "7"))

    from hybridlm.training import loop

    def stop_at_step_4(step, *args, **kwargs):
        if step == 4:
            raise KeyboardInterrupt  # as if the process were killed after the step-3 checkpoint
        return rows_for_step(step, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "rows_for_step", stop_at_step_4)
        with pytest.raises(KeyboardInterrupt):
            pretrain.main(args_for(corpus, model_file, split, "--steps", "7"))
    pretrain.main(args_for(corpus, model_file, split, "--steps", "7", "--resume"))
    expected, got = load_file(whole / "model.safetensors"), load_file(split / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert (got[name] - expected[name]).abs().max() <= 1e-6, name
    steps = [json.loads(line)["step"] for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(line)["step"] for line in (whole / "metrics.jsonl").read_text().splitlines()]


def test_only_models_with_attention_record_a_context_length():
    """A stack with a growing (KV) state records its training length; an all-fixed-state stack records none."""
    from hybridlm import HybridConfig
    from hybridlm.training.tokenizer import (
        UNLIMITED_LENGTH,
        bpe_tokenizer_from_json,
        record_context_length,
        train_bpe_tokenizer,
    )

    tokenizer = bpe_tokenizer_from_json(train_bpe_tokenizer(["def f(x):\n    return x\n"] * 4, 260)
                                        .backend_tokenizer.to_str())
    for pattern, expected in (("SA", 64), ("SS", UNLIMITED_LENGTH)):
        record_context_length(tokenizer, HybridConfig(vocab_size=260, hidden_size=32, layer_pattern=pattern,
                                                      num_attention_heads=2, mamba2_head_dim=8), 64)
        assert tokenizer.model_max_length == expected, pattern


def test_bad_input_is_an_error_before_training(corpus, model_file, tmp_path):
    def fails(message: str, *argv: str, out: Path | None = None):
        target = out if out is not None else tmp_path / "new"
        with pytest.raises((ValueError, FileNotFoundError, FileExistsError), match=message):
            pretrain.main(args_for(corpus, model_file, target, "--steps", "2", *argv))

    fails("no such file", "--data", str(corpus / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    fails("empty", "--data", str(empty))
    fails("--eval-data .*missing.txt.*no such file", "--eval-data", str(corpus / "missing.txt"))
    fails("--eval-data .*the files are empty", "--eval-data", str(empty))
    short = tmp_path / "short.py"
    short.write_text("x = 1\n")
    fails(r"the held-out text \(--eval-data\) has \d+ tokens, fewer than one row", "--eval-data", str(short))
    (tmp_path / "no_files").mkdir()
    fails("--data .*no_files.*the directory holds no files", "--data", str(tmp_path / "no_files"))
    limited = tmp_path / "limited.json"
    limited.write_text(json.dumps({**TINY_MODEL, "max_position_embeddings": 16}))
    fails("beyond the model's limit", "--model", str(limited))
    fails("--seq-len must be at least 2", "--seq-len", "1")
    fails("not divisible by --grad-accum", "--grad-accum", "3")
    fails("--weight-decay must be a finite number >= 0", "--weight-decay", "-1")
    fails("--threads must be a positive integer", "--threads", "-2")
    fails("not a preset", "--model", "no-such-preset")
    fails("--resume: no checkpoint", "--resume")

    done = tmp_path / "done"
    pretrain.main(args_for(corpus, model_file, done, "--steps", "3"))
    before = (done / "checkpoint" / "model.safetensors").read_bytes()
    fails("already holds a checkpoint", out=done)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**TINY_MODEL, "hidden_size": 64}))
    fails("of another model.*hidden_size", "--model", str(other), "--resume", out=done)
    fails(r"--resume: .* other settings.*--seq-len 16 \(the run used 32\); --batch-size 8 \(the run used 4\)",
          "--seq-len", "16", "--batch-size", "8", "--resume", out=done)
    fails(r"--resume: .* other settings.*--seed 5 \(the run used 0\)", "--seed", "5", "--resume", out=done)
    fails(r"--resume: .* other settings.*training rows \(--data\) differ", "--data", str(corpus / "heapq.py"),
          "--resume", out=done)
    small_vocab = tmp_path / "small_vocab"
    pretrain.main(args_for(corpus, model_file, small_vocab, "--steps", "1", "--vocab-size", "280"))
    fails("the tokenizer has 300 entries", "--model", str(small_vocab), "--tokenizer", str(done))
    without_tokenizer = tmp_path / "without_tokenizer"
    HybridForCausalLM(HybridConfig(**TINY_MODEL, vocab_size=300)).save_pretrained(without_tokenizer)
    fails("has no tokenizer", "--model", str(without_tokenizer))
    assert (done / "checkpoint" / "model.safetensors").read_bytes() == before  # nothing overwritten


def test_accumulation_and_activation_checkpointing_give_the_same_training(corpus, model_file, tmp_path):
    """The global batch split into micro-batches, with blocks recomputed in backward, trains the same weights."""
    plain, split = tmp_path / "plain", tmp_path / "split"
    pretrain.main(args_for(corpus, model_file, plain, "--steps", "3"))
    pretrain.main(args_for(corpus, model_file, split, "--steps", "3", "--grad-accum", "2", "--checkpointing"))
    expected, got = load_file(plain / "model.safetensors"), load_file(split / "model.safetensors")
    for name in expected:
        assert (got[name] - expected[name]).abs().max() <= 1e-5 * expected[name].abs().max().clamp_min(1), name


def test_bf16_autocast_trains(corpus, model_file, tmp_path):
    last = pretrain.main(args_for(corpus, model_file, tmp_path, "--steps", "3", "--precision", "bf16"))
    assert torch.isfinite(torch.tensor(last["loss"])) and last["loss"] < 6.5


def test_default_corpus_is_the_standard_library_with_a_fixed_held_out_set():
    from hybridlm.training.corpus import HELD_OUT_STDLIB, stdlib_corpus

    corpus = stdlib_corpus()
    held_out = [name for name, _ in corpus.held_out]
    train = {name for name, _ in corpus.train}
    assert sorted(held_out) == sorted(HELD_OUT_STDLIB)
    assert not train & set(held_out)
    assert "os.py" in train and "pydoc_data/topics.py" in train  # sources and the documentation
    assert not any({"test", "tests", "idle_test", "site-packages"} & set(name.split("/")[:-1]) for name in train)
    assert sum(map(len, corpus.train_texts)) > 5_000_000


def test_hybridlm_train_is_the_same_pretraining(corpus, model_file, tmp_path):
    """The installed command ``hybridlm train`` runs the recipe's pretraining: same options, same weights."""
    from hybridlm.cli import main as cli

    pretrain.main(args_for(corpus, model_file, tmp_path / "recipe", "--steps", "2"))
    cli(["train", *args_for(corpus, model_file, tmp_path / "cli", "--steps", "2")])
    expected = load_file(tmp_path / "recipe" / "model.safetensors")
    got = load_file(tmp_path / "cli" / "model.safetensors")
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_a_new_run_trains_its_own_tokenizer_whatever_out_holds(corpus, model_file, tmp_path):
    """A tokenizer left in --out by a run stopped before its first checkpoint is not silently reused: the new run
    trains the --vocab-size it was given (only --resume reads --out's tokenizer)."""
    from transformers import AutoTokenizer

    from hybridlm.training.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(["def f(x):\n    return x\n"] * 4, vocab_size=270).save_pretrained(tmp_path)
    pretrain.main(args_for(corpus, model_file, tmp_path, "--steps", "1"))
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 300


def test_continued_pretraining_keeps_the_checkpoints_tokenizer(corpus, model_file, tmp_path):
    """--model a trained run: its own tokenizer comes with it (a newly trained BPE's ids would not be the ones its
    embeddings learned), whatever --vocab-size says, and training continues from its weights."""
    from transformers import AutoTokenizer

    first = tmp_path / "first"
    pretrain.main(args_for(corpus, model_file, first, "--steps", "3", "--vocab-size", "280"))
    before = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    last = pretrain.main(args_for(corpus, first, tmp_path / "second", "--steps", "1"))
    assert AutoTokenizer.from_pretrained(tmp_path / "second").get_vocab() == \
        AutoTokenizer.from_pretrained(first).get_vocab()
    assert last["loss"] < before[0]["loss"] - 0.3  # it starts where the first run ended, not from scratch
