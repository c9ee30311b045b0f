"""Distillation, a pretrained Transformer turned into a hybrid: ``hybridlm distill`` and ``recipes/distill.py``.

    hybridlm distill --teacher DIR --attention-every 4 --mixer mamba2 --stage both --out runs/student
    torchrun --nproc_per_node 2 recipes/distill.py --parallel ddp --teacher DIR --attention-every 4 --out ...

1. The student (:mod:`hybridlm.training.distill_student`): the teacher with its attention layers but those kept
   (``--keep-attention`` or ``--attention-every``) replaced by ``--mixer``, everything else copied, the new mixers
   initialised from the attention weights (``--init attention``) or fresh (``--init random``). ``--steps 0``
   writes it without training.
2. Stage 1, attention transfer (:mod:`hybridlm.training.distill_transfer`), in ``OUT/transfer``: each new mixer
   learns its attention layer's output from one frozen-teacher forward; only the new mixers train.
3. Stage 2, end to end, in ``OUT/finetune``: ``KL(teacher || student)`` of the next-token distributions at
   ``--temperature`` T (times T^2), plus ``--ce-weight`` x the cross-entropy of the data; the whole student
   trains, or LoRA adapters (``--lora R``) on the new mixers, the rest or all (``--lora-on``). The teacher's logits
   are computed on the fly, in the same micro-batch (not cached top-k on disk): its forward costs a third of the
   student's training step, while caching would write ``k`` values per training token before training could
   start, for a corpus that is seen about once.

Both stages run through the pretraining loop (:func:`hybridlm.training.loop.train`): packed rows, warmup and
cosine, crash-safe checkpoints, exact ``--resume``, ``metrics.jsonl`` (each evaluation with the teacher's and the
student's held-out bits per byte on the same rows, and the CPU-hours so far), ``loss.png``, a progress bar with
its ETA, and ``--parallel ddp|fsdp`` under torchrun. ``OUT`` ends with the student (a hybridlm checkpoint, or
``--format``) with the teacher's tokenizer and chat template, ``distill.json`` (held-out bits per byte of the
teacher and of the student after init and after each stage, KV bytes per token of both) and ``distill.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from hybridlm.options import add_options
from hybridlm.training.config import TrainConfig
from hybridlm.training.distill_options import OPTIONS, STAGES

SUMMARY, PLOT = "distill.json", "distill.png"


def load_teacher(spec: str):
    """The teacher, fp32, frozen, in eval mode; a source hybridlm cannot read is an error naming it."""
    import torch

    from hybridlm.model import load

    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"--teacher {spec}: no such directory or file")
    try:
        teacher = load(path, dtype=torch.float32)
    except (ValueError, KeyError, TypeError, OSError, ImportError) as error:
        raise ValueError(f"--teacher {spec}: hybridlm cannot read it ({type(error).__name__}: {error})") from None
    teacher.requires_grad_(False)
    return teacher.eval()


def teacher_tokenizer(spec: str, vocab_size: int):
    """The teacher's tokenizer (with its chat template): its directory's, or the one a GGUF file holds."""
    from hybridlm.paths import split_gguf_path
    from hybridlm.training.tokenizer import check_tokenizer_fits, has_tokenizer, load_tokenizer

    gguf = split_gguf_path(spec, None)
    if gguf is not None:
        from hybridlm.formats.gguf import read_gguf_tokenizer

        tokenizer = read_gguf_tokenizer(*gguf)
        if tokenizer is None:
            raise ValueError(f"--teacher {spec}: the GGUF file holds no tokenizer")
    elif not has_tokenizer(spec):
        raise ValueError(f"--teacher {spec} has no tokenizer files: the student is trained on the teacher's own "
                         "tokens, so the teacher directory must hold its tokenizer")
    else:
        tokenizer = load_tokenizer(spec)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--teacher {spec}: the tokenizer has no eos_token to separate documents")
    return check_tokenizer_fits(tokenizer, vocab_size, spec)


def stage_steps(args) -> dict[str, int]:
    """The optimizer steps of each stage that runs (none with ``--steps 0``)."""
    if args.steps == 0:
        return {}
    steps = {"transfer": args.transfer_steps if args.transfer_steps is not None else args.steps,
             "finetune": args.steps}
    return {stage: steps[stage] for stage in STAGES[args.stage] if steps[stage] != 0}


def stage_config(args, stage: str, steps: int) -> TrainConfig:
    """The loop's settings for ``stage`` (validated on construction, so before any training)."""
    lr = args.transfer_lr if stage == "transfer" else args.lr
    seed = args.seed if stage == "transfer" else args.seed + 1  # stage 2 draws its own row order
    return TrainConfig(steps=steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=lr,
                       warmup=min(args.warmup, steps), weight_decay=args.weight_decay, precision=args.precision,
                       checkpointing=args.checkpointing and stage == "finetune", layout=args.layout,
                       eval_every=args.eval_every, eval_rows=args.eval_rows, save_every=args.save_every,
                       log_every=args.log_every, seed=seed)


def _check_options(args, parallel) -> None:
    if args.steps < 0 or (args.transfer_steps is not None and args.transfer_steps < 0):
        raise ValueError(f"--steps and --transfer-steps must be >= 0, got {args.steps} and {args.transfer_steps}")
    if args.temperature <= 0 or args.temperature != args.temperature:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    if not args.ce_weight >= 0:
        raise ValueError(f"--ce-weight must be >= 0, got {args.ce_weight}")
    if args.lora < 0:
        raise ValueError(f"--lora rank must be >= 0 (0: full training), got {args.lora}")
    if args.lora and getattr(parallel, "kind", None) == "fsdp":
        raise ValueError("--lora with --parallel fsdp is not supported: use --parallel ddp (adapters are small)")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads}")


def _sha1(tensors) -> str:
    import torch

    digest = hashlib.sha1()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_settings(args, keep: list[int], rows, teacher) -> dict:
    """What a resumed distillation must share with the run it continues (names as the command line gives them)."""
    return {"--keep-attention": keep, "--mixer": args.mixer, "--init": args.init, "--stage": args.stage,
            "--lora": args.lora, "--lora-on": args.lora_on,
            "--temperature": args.temperature, "--ce-weight": args.ce_weight, "--seq-len": args.seq_len,
            "--batch-size": args.batch_size, "--layout": args.layout, "--seed": args.seed,
            "--held-out-rows": args.held_out_rows,
            "teacher weights (--teacher)": _sha1(teacher.state_dict().values()),
            "training rows (--data)": hashlib.sha1(rows.ids.numpy().tobytes()).hexdigest()}


def kl_losses(teacher, temperature: float = 1.0, ce_weight: float = 0.0):
    """The loop's ``losses`` for stage 2: ``T^2 KL(softmax(teacher / T) || softmax(student / T))`` summed over
    the labelled next-token targets, plus ``ce_weight`` x their summed cross-entropy; the teacher's logits are
    computed here, without gradients, on the same micro-batch."""
    import torch
    import torch.nn.functional as F

    from hybridlm.training.loop import _autocast

    def losses(model, batch, precision: str = "fp32"):
        device = next(model.parameters()).device
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch.get("position_ids")}
        targets = batch["labels"][:, 1:]
        keep = targets != -100
        with _autocast(precision, device):
            with torch.no_grad():
                teacher_logits = teacher(**inputs).logits[:, :-1][keep].float()
            out = model(**inputs)
        logits = out.logits[:, :-1][keep].float()
        log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
        log_q = F.log_softmax(logits / temperature, dim=-1)
        loss = (log_p.exp() * (log_p - log_q)).sum() * temperature ** 2
        if ce_weight:
            loss = loss + ce_weight * F.cross_entropy(logits, targets[keep], reduction="sum")
        return loss, int(keep.sum()), out.aux_loss

    return losses


class _CpuClock:
    """CPU-hours of the distillation so far (this process's CPU time, all threads), continued across resumes
    from the last value a stage's metrics hold (the time between that evaluation and a kill is not counted)."""

    def __init__(self):
        self.base, self.start = None, time.process_time()

    def restart(self, base: float | None) -> None:
        self.base, self.start = base, time.process_time()

    def hours(self, metrics: Path, before: float) -> float:
        if self.base is None:  # first evaluation of a stage: the metrics were truncated to the resumed step
            from hybridlm.training.metrics import read_metrics

            rows = [r for r in read_metrics(metrics) if "cpu_hours" in r] if metrics.is_file() else []
            self.base = rows[-1]["cpu_hours"] if rows else before
        return self.base + (time.process_time() - self.start) / 3600


def _eval_fields(teacher, held_out, config: TrainConfig, clock: _CpuClock, metrics: Path, before: float,
                 transfer=None):
    """The loop's ``eval_fields``: the teacher's loss and bits per byte on the rows the student was evaluated on,
    in the same precision (computed once per row count), the CPU-hours so far, and in stage 1 each new mixer's
    held-out error."""
    from hybridlm.training.distill_transfer import held_out_errors
    from hybridlm.training.loop import evaluate

    teacher_losses: dict[int, float] = {}

    def fields(used: int) -> dict:
        if used not in teacher_losses:
            teacher_losses[used] = evaluate(teacher, held_out.rows, config.layout, used, precision=config.precision)
        loss = teacher_losses[used]
        row = {"teacher_eval_loss": loss, "teacher_bits_per_byte": held_out.bits_per_byte(loss)}
        if transfer is not None:
            errors = held_out_errors(transfer, held_out.rows, config.layout, used, precision=config.precision)
            row.update(layer_error=_mean(errors), layer_errors=errors)
        row["cpu_hours"] = clock.hours(metrics, before)
        return row

    return fields


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _write_summary(out: Path, summary: dict) -> None:
    from hybridlm.files import write_file

    write_file(out / SUMMARY, json.dumps(summary, indent=1))


def _lora_targets(model, replaced: list[int], on: str) -> list[str]:
    from hybridlm.training.lora import linear_module_names

    new = tuple(f"model.layers.{i}.mixer." for i in replaced)
    return [name for name in linear_module_names(model) if on == "all" or name.startswith(new) == (on == "new")]


def _gathered_student(parallel, transfer, plain):
    """Stage 1's student as a plain module on the main rank: ``transfer.student`` (one process, DDP), or
    ``plain`` given the new mixers gathered from their FSDP shards (None on other ranks)."""
    if getattr(parallel, "kind", None) != "fsdp":
        return transfer.student if parallel.is_main else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(transfer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not parallel.is_main:
        return None
    for k, i in enumerate(transfer.layers):
        prefix = f"mixers.{k}."
        plain.model.layers[i].mixer.load_state_dict({name[len(prefix):]: tensor for name, tensor in weights.items()
                                                     if name.startswith(prefix)})
    return plain


def run(args) -> dict:
    """Validate everything, build the student, run the stages, save; returns ``distill.json``'s contents."""
    import copy

    import torch

    from hybridlm.files import read_json, recoverable, save_pretrained_aside
    from hybridlm.model import HybridForCausalLM
    from hybridlm.training.checkpoint import CHECKPOINT_DIR, check_new_run, recover_checkpoint
    from hybridlm.training.distill_data import distill_rows
    from hybridlm.training.distill_student import build_student, kept_layers, parse_layers, replaced_layers
    from hybridlm.training.distill_transfer import AttentionTransfer, fit_output_scales, transfer_losses
    from hybridlm.training.distributed import SingleProcess, from_environment
    from hybridlm.training.finetune import check_exportable
    from hybridlm.training.loop import train
    from hybridlm.training.packing import rows_for_step
    from hybridlm.training.pretrain import check_same_settings, check_seq_len, record_settings

    parallel = SingleProcess() if args.parallel == "none" else from_environment(args.parallel)
    _check_options(args, parallel)
    out: Path = args.out
    if args.resume:
        if not (out / "run_settings.json").is_file():
            raise FileNotFoundError(f"--resume: no distillation in {out} (expected {out}/run_settings.json)")
        if parallel.is_main:
            for stage in STAGES["both"]:
                recover_checkpoint(out / stage)  # what a kill during a save left: finished or undone
        parallel.barrier()
    else:
        for stage in STAGES["both"]:
            check_new_run(out / stage)
        if (out / "run_settings.json").exists():
            raise FileExistsError(f"--out {out} already holds a distillation: pass --resume to continue it, or "
                                  "another --out")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steps = stage_steps(args)
    configs = {stage: stage_config(args, stage, n) for stage, n in steps.items()}
    teacher = load_teacher(args.teacher)
    tokenizer = teacher_tokenizer(args.teacher, teacher.config.vocab_size)
    keep = kept_layers(teacher.config, parse_layers(args.keep_attention) if args.keep_attention is not None
                       else None, args.attention_every)
    student = build_student(teacher, keep, args.mixer, args.init, args.seed)
    replaced = replaced_layers(teacher.config, student.config)
    check_seq_len(args.seq_len, student)
    check_exportable(student, args.format)
    parallel.check_batch(args.batch_size // args.grad_accum)
    rows, held_out = distill_rows(args, tokenizer)
    settings = run_settings(args, keep, rows, teacher)
    if args.resume:
        check_same_settings(out, settings)
    teacher.to(parallel.device)
    summary = read_json(out / SUMMARY) if args.resume and (out / SUMMARY).is_file() else {}
    if parallel.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            record_settings(out, settings)
        print(f"teacher: {teacher.config.num_hidden_layers} layers; student: attention kept at {keep}, {args.mixer} "
              f"at {replaced} (--init {args.init}); {sum(p.numel() for p in student.parameters()):,} parameters")
        print(f"data: {len(rows)} rows x {args.seq_len} tokens for training, {len(held_out.rows)} held-out rows; "
              f"{1 / held_out.tokens_per_byte:.2f} bytes per token")
    if "teacher" not in summary:
        summary["teacher"] = held_out.evaluate(teacher, args.layout)
        summary["kv_bytes_per_token"] = _kv_bytes(teacher.config, student.config)
    if "init" not in summary:
        summary["init"] = {**held_out.evaluate(student.to(parallel.device), args.layout), "tokens": 0}
    if parallel.is_main:
        _write_summary(out, summary)
        print(f"held-out bits per byte: teacher {summary['teacher']['bits_per_byte']:.4f}, student after init "
              f"{summary['init']['bits_per_byte']:.4f}")
    clock, tokens, hours = _CpuClock(), 0, summary["init"].get("cpu_hours", 0.0)
    for stage, config in configs.items():
        stage_out = out / stage
        if stage in summary:  # finished in an earlier run: its student is in its directory
            tokens, hours = summary[stage]["tokens"], summary[stage]["cpu_hours"]
            student = HybridForCausalLM.from_pretrained(stage_out, dtype=torch.float32)
            continue
        resuming = args.resume and bool(recoverable(stage_out / CHECKPOINT_DIR))
        clock.restart(None)
        if parallel.is_main:
            print(f"stage {'1, attention transfer' if stage == 'transfer' else '2, end to end'}: {config.steps} steps"
                  f"{' (resumed)' if resuming else ''}, in {stage_out}")
        student.to(parallel.device)
        if stage == "transfer":
            plain = copy.deepcopy(student) if getattr(parallel, "kind", None) == "fsdp" else None
            student.requires_grad_(False)
            model = AttentionTransfer(student, teacher, replaced).requires_grad_(True)
            if not resuming:  # the closed-form fit of the output scales, on the first step's rows
                first = rows.batch(rows_for_step(0, config.batch_size, len(rows), config.seed), config.layout)
                summary["transfer_fit_errors"] = fit_output_scales(model, first)
                if parallel.is_main:
                    _write_summary(out, summary)
                    print(f"output scales fitted: error on the first batch {_mean(summary['transfer_fit_errors']):.4f} "
                          "(mean over the new layers; 1 = a zero output)")
            losses = transfer_losses
            fields = _eval_fields(teacher, held_out, config, clock, stage_out / "metrics.jsonl", hours, model)
        else:
            model = student.requires_grad_(True)
            if args.lora:
                from hybridlm.training.lora import add_lora

                model = add_lora(student, args.lora, args.lora_alpha,
                                 targets=_lora_targets(student, replaced, args.lora_on))
            losses = kl_losses(teacher, args.temperature, args.ce_weight)
            fields = _eval_fields(teacher, held_out, config, clock, stage_out / "metrics.jsonl", hours)
        last = train(model, rows, config, stage_out, eval_rows=held_out.rows, tokens_per_byte=held_out.tokens_per_byte,
                     resume=resuming, parallel=parallel, losses=losses, eval_fields=fields)
        if stage == "transfer":
            trained = _gathered_student(parallel, model, plain)
        else:
            trained = parallel.full_model(model)
            if args.lora and trained is not None:
                from hybridlm.training.lora import merge_lora

                trained = merge_lora(trained)
        tokens += config.steps * config.batch_size * args.seq_len
        if parallel.is_main:  # the student on every held-out row in fp32, as the teacher and the init were
            final = last.get("eval_tokens") == len(held_out.rows) * args.seq_len and config.precision == "fp32"
            result = {name: last[name] for name in ("eval_loss", "bits_per_byte", "eval_tokens")} if final \
                else held_out.evaluate(trained, args.layout)  # (resumed after the last evaluation, or bf16)
            errors = {name: last[name] for name in ("layer_error", "layer_errors") if name in last}
            summary[stage] = {**result, **errors, "cpu_hours": clock.hours(stage_out / "metrics.jsonl", hours),
                              "tokens": tokens}
            save_pretrained_aside(trained, stage_out)
            _write_summary(out, summary)  # the stage is done: a resume starts after it
            plot_distillation(out)
        parallel.barrier()
        hours = clock.hours(stage_out / "metrics.jsonl", hours)
        if stage == "transfer" and "finetune" in configs:
            student = HybridForCausalLM.from_pretrained(stage_out, dtype=torch.float32)  # every rank, unsharded
        else:
            student = trained
    if parallel.is_main:
        student.config.eos_token_id = student.generation_config.eos_token_id = tokenizer.eos_token_id
        save_pretrained_aside(student, out, format=args.format)
        save_pretrained_aside(tokenizer, out)
        _write_summary(out, summary)
        plot_distillation(out)
        print(json.dumps({k: v for k, v in summary.items()}, indent=1))
    return summary


def _kv_bytes(teacher_config, student_config) -> dict:
    """Attention KV bytes per token (16-bit) and each model's fixed cache bytes, from the cache's own accounting
    (:func:`hybridlm.model.memory.memory_rows`) at an 8K context."""
    from hybridlm.model.memory import memory_rows

    result = {}
    for name, config in (("teacher", teacher_config), ("student", student_config)):
        (row,) = memory_rows(config, [8192], 1, [16])
        result[name] = {"bytes_per_token": row["bytes_per_token"], "fixed_bytes": row["fixed_bytes"],
                        "bytes_per_request_8k": row["bytes_per_request"]}
    return result


def plot_distillation(out: Path) -> bool:
    """``OUT/distill.png``: the student's held-out bits per byte against tokens and against CPU-hours, through
    both stages, with the teacher's on the same rows; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from hybridlm.files import read_json, written_aside
    from hybridlm.training.metrics import read_metrics

    summary = read_json(out / SUMMARY) if (out / SUMMARY).is_file() else {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    offset, teacher_labelled = 0, False
    for stage, color, label in (("transfer", "tab:blue", "student, stage 1 (transfer)"),
                                ("finetune", "tab:orange", "student, stage 2 (KL)")):
        path = out / stage / "metrics.jsonl"
        rows = [r for r in read_metrics(path) if "bits_per_byte" in r] if path.is_file() else []
        for ax, x in zip(axes, ("tokens", "cpu_hours")) if rows else ():
            xs = [r[x] + (offset if x == "tokens" else 0) for r in rows]
            ax.plot(xs, [r["bits_per_byte"] for r in rows], "o-", color=color, label=label)
            ax.plot(xs, [r["teacher_bits_per_byte"] for r in rows], "--", color="gray",
                    label=None if teacher_labelled else "teacher (same rows)")
        teacher_labelled = teacher_labelled or bool(rows)
        if stage == "transfer" and rows:  # stage 2's tokens continue stage 1's
            offset = summary.get("transfer", {}).get("tokens", rows[-1]["tokens"])
    if "init" in summary:
        for ax in axes:
            ax.plot([0], [summary["init"]["bits_per_byte"]], "ks", label="student after init")
    if "teacher" in summary:
        for ax in axes:
            ax.axhline(summary["teacher"]["bits_per_byte"], color="k", lw=0.8, label="teacher (all held-out rows)")
    axes[0].set_xlabel("training tokens (both stages)")
    axes[1].set_xlabel("CPU-hours")
    axes[0].set_ylabel("held-out bits per byte")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    with written_aside(out / PLOT) as temporary:
        fig.savefig(temporary, dpi=100, format="png")
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return run(add_options(parser, OPTIONS).parse_args(argv))


if __name__ == "__main__":
    from hybridlm.options import run_reporting_bad_input

    run_reporting_bad_input("python -m hybridlm.training.distill", main)
