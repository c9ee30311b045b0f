"""``transformers.Trainer`` trains a HybridForCausalLM like any causal LM: with DataCollatorForLanguageModeling,
with DataCollatorWithFlattening (padding-free: its loss is the per-document loss), with gradient checkpointing,
and a peft (LoRA) model. Tiny models, a few steps on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from ..helpers import tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
LENGTHS = (9, 14, 6, 11)


@pytest.fixture(scope="module")
def tokenizer():
    from hybridlm.training.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["def add(a, b):\n    return a + b\n" * 3, "x = [i * i for i in range(9)]\n"], 300)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _documents(seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 300, (n,), generator=generator).tolist()} for n in LENGTHS]


def _model(**overrides):
    return tiny_model(seed=2, vocab_size=300, layer_pattern="MSAP", **overrides).train()


def _train(model, collator, tmp_path, **arguments):
    """Five steps on the same four documents (a batch of 4): the loss must fall."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, learning_rate=1e-2, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_documents() * 5, data_collator=collator)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 5 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
    return trainer


def test_language_modeling_collator(tokenizer, tmp_path):
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    _train(_model(), collator, tmp_path)


def test_gradient_checkpointing(tokenizer, tmp_path):
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    model = _model()
    _train(model, collator, tmp_path, gradient_checkpointing=True)
    assert model.model.gradient_checkpointing


def test_peft_model(tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    from hybridlm.training.lora import add_lora

    model = add_lora(_model(), rank=4)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    _train(model, collator, tmp_path)
    assert isinstance(model, peft.PeftModel)
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)


def test_flattening_collator_loss_is_the_per_document_loss(tmp_path):
    """The flattened batch (one row, position_ids restarting per document) gives the same loss as each document
    run alone: no mixer reads across a boundary. Then Trainer trains with it."""
    collator = transformers.DataCollatorWithFlattening()
    documents = _documents(seed=1)
    batch = collator(documents)
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and int((batch["position_ids"] == 0).sum()) == 4
    model = _model(expert_layer_period=2, expert_layer_offset=1, router_aux_loss_coef=0.0).eval()
    with torch.no_grad():
        packed = model(**batch).loss
        total, count = 0.0, 0
        for document in documents:
            ids = torch.tensor([document["input_ids"]])
            logits = model(input_ids=ids).logits
            total += F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            count += ids.shape[1] - 1
    assert torch.isclose(packed, total / count, rtol=1e-5), (float(packed), float(total / count))
    _train(_model(), collator, tmp_path)


def test_num_items_in_batch_makes_the_loss_a_sum_over_the_step(tmp_path):
    """Under gradient accumulation transformers' Trainer passes ``num_items_in_batch`` and no longer divides by the
    accumulation steps: the loss must then be the summed token loss over that count, as in transformers' models."""
    from ..helpers import random_ids

    model = tiny_model(layer_pattern="SA")
    ids = random_ids(2, 9)
    labels = ids.clone()
    labels[0, :4] = -100
    logits = model(ids).logits
    summed = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                             reduction="sum")
    targets = int((labels[:, 1:] != -100).sum())
    mean = model(ids, labels=labels).loss
    assert torch.allclose(mean, summed / targets, rtol=1e-6)
    for count in (targets, 3 * targets):  # this micro-batch's share of a larger accumulated step
        got = model(ids, labels=labels, num_items_in_batch=torch.tensor(count)).loss
        assert torch.allclose(got, summed / count, rtol=1e-6)
