"""The training loop: AdamW, warmup + cosine, clipping, gradient accumulation, fp32 or bf16 autocast,
activation checkpointing, MoE auxiliary loss, periodic evaluation, checkpoints and exact resume.

``batch_size`` is the global batch: sequences per optimizer step, summed over accumulation steps (and ranks),
so the same settings give the same training however the batch is split.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybridlm.training.checkpoint import recover_checkpoint
from hybridlm.training.config import TrainConfig
from hybridlm.training.metrics import MetricsLog, plot_loss
from hybridlm.training.packing import PackedRows, rows_for_step


def _autocast(precision: str, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def token_losses(model, batch: dict[str, torch.Tensor], precision: str = "fp32"):
    """Summed next-token cross-entropy over the batch's labelled targets, their count, and the MoE aux loss."""
    device = next(model.parameters()).device
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    with _autocast(precision, device):
        out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"))
    targets = batch["labels"][:, 1:]
    loss_sum = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                               reduction="sum")
    return loss_sum, int((targets != -100).sum()), out.aux_loss


@torch.no_grad()
def evaluate(model, rows: PackedRows, layout: str, limit: int | None = None, batch_size: int = 8,
             precision: str = "fp32", progress: bool = False) -> float:
    """Mean cross-entropy (nats per target token) over the first ``limit`` rows (all without a limit);
    ``progress``: a progress bar of the batches, removed when done (a final evaluation can take a minute)."""
    was_training = model.training
    model.eval()
    count = len(rows) if limit is None else min(limit, len(rows))
    total, targets = 0.0, 0
    starts = range(0, count, batch_size)
    for start in tqdm(starts, desc=f"evaluating {count} held-out rows", leave=False, disable=not progress,
                      dynamic_ncols=True):
        batch = rows.batch(torch.arange(start, min(start + batch_size, count)), layout)
        loss_sum, n, _ = token_losses(model, batch, precision)
        total, targets = total + float(loss_sum), targets + n
    model.train(was_training)
    return total / max(targets, 1)


def train(model, rows: PackedRows, config: TrainConfig, out: str | Path, *, eval_rows: PackedRows | None = None,
          tokens_per_byte: float | None = None, resume: bool = False, parallel=None,
          losses=token_losses, eval_fields=None) -> dict:
    """Train ``model`` on ``rows``; checkpoints and metrics go to ``out``. Returns the last logged metrics.

    ``losses(model, batch, precision) -> (summed loss, target count, aux loss)`` is :func:`token_losses` unless a
    task computes its loss otherwise (MQAR: logits only at its few answer positions; distillation: the KL to a
    teacher). ``eval_fields(rows) -> dict``, when given, adds fields to each evaluation's metrics row, called
    (on every rank) with the number of held-out rows just evaluated (distillation: the teacher's loss on them).

    ``parallel`` (a strategy of :mod:`hybridlm.training.distributed`: ``SingleProcess`` when None, ``DataParallel``,
    ``FullyShardedParallel``) wraps the model,
    shards each global batch by rank and reduces the logged numbers."""
    from hybridlm.training.distributed import SingleProcess

    parallel = parallel or SingleProcess()
    micro = config.batch_size // config.grad_accum
    parallel.check_batch(micro)  # before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    if config.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    wrapped = parallel.wrap(model)
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, config.schedule)
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
    if resume:
        if parallel.is_main:
            recover_checkpoint(out)  # what a kill during a save left: finished or undone
        parallel.barrier()
        state.update(parallel.load(out, model, optimizer, scheduler))
    log = MetricsLog(out, resume_step=state["step"] if resume else None) if parallel.is_main else None
    coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    seq_len = rows.ids.shape[1]
    progress = tqdm(range(state["step"], config.steps), initial=state["step"], total=config.steps,
                    desc="training", disable=not parallel.is_main, dynamic_ncols=True)
    # the window since the last metrics row: summed loss and targets, steps, and training seconds (evaluation
    # and checkpoint time left out)
    window_loss, window_targets, window_steps, window_seconds, last = 0.0, 0, 0, 0.0, {}
    mark = time.perf_counter()
    for step in progress:
        indices = rows_for_step(step, config.batch_size, len(rows), config.seed)
        global_targets = int((rows.batch(indices, config.layout)["labels"][:, 1:] != -100).sum())
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        chunks = indices.split(micro)
        for k, chunk in enumerate(chunks):
            local = parallel.shard(chunk)
            batch = rows.batch(local, config.layout)
            with parallel.no_sync(wrapped, last_micro=k == len(chunks) - 1):
                loss_sum, _, aux = losses(wrapped, batch, config.precision)
                loss = loss_sum / global_targets  # gradients are summed over ranks: the global mean
                if aux is not None and coef:
                    loss = loss + coef * aux * (len(local) / config.batch_size)
                loss.backward()
            step_loss += float(loss_sum.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip))
        optimizer.step()
        model.after_optimizer_step()  # step-based mixer schedules (Performer feature redraws)
        scheduler.step()
        step_loss = parallel.sum(step_loss)
        state["step"], state["tokens"] = step + 1, state["tokens"] + config.batch_size * seq_len
        now = time.perf_counter()
        window_loss, window_targets = window_loss + step_loss, window_targets + global_targets
        window_steps, window_seconds, mark = window_steps + 1, window_seconds + now - mark, now
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            state["elapsed_s"] += window_seconds
            tokens_per_s = window_steps * config.batch_size * seq_len / max(window_seconds, 1e-9)
            last = {"step": step + 1, "loss": window_loss / window_targets, "lr": scheduler.get_last_lr()[0],
                    "tokens": state["tokens"], "tokens_per_s": tokens_per_s, "grad_norm": grad_norm,
                    "elapsed_s": state["elapsed_s"]}
            progress.set_postfix(loss=f"{last['loss']:.3f}", lr=f"{last['lr']:.2e}", tok_s=f"{tokens_per_s:.0f}")
            if log:
                log.write(last)
            window_loss, window_targets, window_steps, window_seconds = 0.0, 0, 0, 0.0
        final = step + 1 == config.steps
        if eval_rows is not None and ((step + 1) % config.eval_every == 0 or final):
            used = len(eval_rows) if final else min(config.eval_rows, len(eval_rows))
            eval_loss = evaluate(model, eval_rows, config.layout, used, precision=config.precision,
                                 progress=parallel.is_main)
            row = {"step": step + 1, "tokens": state["tokens"], "eval_loss": eval_loss,
                   "eval_tokens": used * eval_rows.ids.shape[1]}
            if tokens_per_byte is not None:
                row["bits_per_byte"] = eval_loss * tokens_per_byte / math.log(2)
            if eval_fields is not None:
                row.update(eval_fields(used))
            last.update(row)
            if parallel.is_main:
                progress.write(evaluation_line(row))
            if log:
                log.write(row)
                plot_loss(log.rows(), out / "loss.png")
            mark = time.perf_counter()  # evaluation time is not training time
        if (step + 1) % config.save_every == 0 or final:
            parallel.save(out, model, optimizer, scheduler, {**state, "elapsed_s": state["elapsed_s"] + window_seconds})
            mark = time.perf_counter()
    if log:
        plot_loss(log.rows(), out / "loss.png")
    return last


def evaluation_line(row: dict) -> str:
    """One console line per evaluation (the metrics row holds the same numbers)."""
    line = f"step {row['step']}: held-out loss {row['eval_loss']:.4f} over {row['eval_tokens']:,} tokens"
    if "bits_per_byte" in row:
        line += f", {row['bits_per_byte']:.4f} bits per byte"
    return line


def _param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases, SSM scalars)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
