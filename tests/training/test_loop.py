"""The training loop's optimisation pieces, each against an independent computation: the learning-rate schedule,
the gradient it steps with (token loss over the global batch plus the MoE auxiliary loss, summed over micro-batches),
and gradient clipping."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hybridlm.training.config import TrainConfig
from hybridlm.training.loop import train
from hybridlm.training.packing import pack_documents, rows_for_step

from ..helpers import TINY, tiny_model

EOS = 1


def tiny_rows(rows: int = 8, seq_len: int = 12):
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(2, TINY["vocab_size"], (rows * seq_len,), generator=generator)
    stream[torch.rand(stream.shape, generator=generator) < 0.15] = EOS
    return pack_documents(stream, seq_len, EOS)


def expected_multiplier(step: int, warmup: int, steps: int, floor: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then half a cosine from 1 down to ``floor`` at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / (steps - warmup)
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2


def test_schedule_is_warmup_then_cosine():
    config = TrainConfig(steps=20, warmup=5, lr=1e-3, min_lr_ratio=0.1)
    got = [config.schedule(step) for step in range(25)]
    expected = [expected_multiplier(min(step, 20), 5, 20, 0.1) for step in range(25)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[4] == 1.0 and got[20] == pytest.approx(0.1) and got[24] == pytest.approx(0.1)  # flat after the end


def test_logged_learning_rate_follows_the_schedule(tmp_path):
    config = TrainConfig(steps=8, batch_size=2, lr=1e-2, warmup=3, log_every=1, eval_every=100, save_every=100)
    train(tiny_model(layer_pattern="SA").train(), tiny_rows(), config, str(tmp_path / "run"))  # a str is a path
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # a row logged after step s shows the rate of the next step
    logged = [row["lr"] for row in rows if "lr" in row]
    assert logged == pytest.approx([1e-2 * expected_multiplier(s, 3, 8, 0.1) for s in range(1, 9)], rel=1e-9)


def gradients_stepped_with(monkeypatch, model, rows, config, tmp_path) -> list[dict[str, torch.Tensor]]:
    """Train and return, for each optimizer step, the gradients AdamW was given (after clipping)."""
    seen = []
    original = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        seen.append({name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None})
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    train(model, rows, config, tmp_path)
    return seen


def test_gradient_is_the_global_mean_token_loss_plus_the_moe_aux_loss(monkeypatch, tmp_path):
    """One step, the batch of 4 rows split in 2 micro-batches: the gradient equals that of (summed token loss over
    all 4 rows / their target count + coef x each micro-batch's aux loss weighted by its share of rows)."""
    coef = 0.5
    model = tiny_model(3, layer_pattern="SA", expert_layer_period=1, router_aux_loss_coef=coef).train()
    reference = tiny_model(3, layer_pattern="SA", expert_layer_period=1, router_aux_loss_coef=coef).train()
    rows = tiny_rows()
    config = TrainConfig(steps=1, batch_size=4, grad_accum=2, warmup=0, clip=1e9, eval_every=100, save_every=100)
    (got,) = gradients_stepped_with(monkeypatch, model, rows, config, tmp_path)

    batch = rows.batch(rows_for_step(0, 4, len(rows), config.seed), "documents")
    targets = batch["labels"][:, 1:]
    count = int((targets != -100).sum())
    assert 0 < count < targets.numel()  # document starts are not targets
    total, aux_total = 0.0, 0.0
    for part in range(2):
        rows_of_part = slice(2 * part, 2 * part + 2)
        out = reference(input_ids=batch["input_ids"][rows_of_part], position_ids=batch["position_ids"][rows_of_part])
        loss_sum = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets[rows_of_part].flatten(),
                                   ignore_index=-100, reduction="sum")
        assert out.aux_loss is not None and out.aux_loss > 0
        total = total + loss_sum / count + coef * out.aux_loss * 0.5
        aux_total = aux_total + out.aux_loss
    total.backward(retain_graph=True)
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name in expected:
        assert (got[name] - expected[name]).abs().max() <= 1e-5 * expected[name].abs().max().clamp_min(1e-6), name
    # the aux loss is in it: without it the router's gradient would differ
    routers = [p for name, p in reference.named_parameters() if name.endswith("router.weight")]
    assert routers
    aux_grads = torch.autograd.grad(aux_total, routers)
    assert all(g.abs().max() > 1e-4 for g in aux_grads)


def test_gradients_are_clipped_to_the_configured_norm(monkeypatch, tmp_path):
    model = tiny_model(layer_pattern="SA").train()
    config = TrainConfig(steps=2, batch_size=4, lr=1e-3, warmup=0, clip=0.05, log_every=1, eval_every=100,
                         save_every=100)
    stepped = gradients_stepped_with(monkeypatch, model, tiny_rows(), config, tmp_path)
    logged = [json.loads(line)["grad_norm"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for grads, norm_before in zip(stepped, logged):
        assert norm_before > 0.5  # well above the limit: clipping has work to do
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        assert float(norm) == pytest.approx(0.05, rel=1e-4)


def test_tokens_per_second_and_elapsed_time_count_training_steps_only(monkeypatch, tmp_path):
    """On a clock where each training step takes 1 s and each checkpoint 100 s: every metrics row shows the tokens
    of one step per second, and elapsed time counts the steps alone, wherever the checkpoints and the logged rows
    fall (checkpoints every 3 steps, rows every 4, 10 steps: a resumed-like partial window at the end)."""
    from types import SimpleNamespace

    from hybridlm.training import loop
    from hybridlm.training.distributed import SingleProcess

    now = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    original_step, original_save = torch.optim.AdamW.step, SingleProcess.save

    def step_taking_a_second(self, *args, **kwargs):
        now[0] += 1.0
        return original_step(self, *args, **kwargs)

    def save_taking_100_seconds(self, *args, **kwargs):
        now[0] += 100.0
        return original_save(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_taking_a_second)
    monkeypatch.setattr(SingleProcess, "save", save_taking_100_seconds)
    rows = tiny_rows()
    config = TrainConfig(steps=10, batch_size=2, warmup=0, log_every=4, eval_every=100, save_every=3)
    train(tiny_model(layer_pattern="SA").train(), rows, config, tmp_path)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [4, 8, 10]
    assert [row["elapsed_s"] for row in logged] == [4.0, 8.0, 10.0]
    assert all(row["tokens_per_s"] == 2 * rows.ids.shape[1] for row in logged)


def test_each_evaluation_is_shown_on_the_console_as_it_is_logged(tmp_path, capsys):
    rows, held_out = tiny_rows(8), tiny_rows(6)
    config = TrainConfig(steps=4, batch_size=2, eval_every=2, eval_rows=3, save_every=100, log_every=1)
    train(tiny_model(), rows, config, tmp_path, eval_rows=held_out, tokens_per_byte=0.5)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluations = [row for row in logged if "eval_loss" in row]
    assert [row["step"] for row in evaluations] == [2, 4]  # every 2 steps, and the final one over all rows
    printed = [line for line in capsys.readouterr().out.splitlines() if "held-out loss" in line]
    assert printed == [f"step {row['step']}: held-out loss {row['eval_loss']:.4f} over {row['eval_tokens']:,} "
                       f"tokens, {row['bits_per_byte']:.4f} bits per byte" for row in evaluations]
    assert evaluations[0]["eval_tokens"] == 3 * 12 and evaluations[1]["eval_tokens"] == len(held_out) * 12


def test_evaluation_shows_a_progress_bar_only_when_asked(capsys):
    from hybridlm.training.loop import evaluate

    model, held_out = tiny_model(), tiny_rows(6)
    quiet = evaluate(model, held_out, "documents", batch_size=2)
    assert "evaluating" not in capsys.readouterr().err
    shown = evaluate(model, held_out, "documents", batch_size=2, progress=True)
    assert "evaluating 6 held-out rows" in capsys.readouterr().err
    assert shown == quiet and shown > 0
