"""The options of ``hybridlm distill`` and ``recipes/distill.py``, and the choices they offer: torch-free, so that
``hybridlm --help`` and argument errors answer at once. Read by :mod:`hybridlm.training.distill` (which runs
them), :mod:`hybridlm.training.distill_student` (which checks a student's mixer and init) and the command line."""

from __future__ import annotations

from pathlib import Path

from hybridlm.options import option
from hybridlm.training.config import LAYOUTS, PRECISIONS, TrainConfig

#: The mixers that may replace attention, and the initialisations of a new mixer (see distill_student).
NEW_MIXERS = ("mamba2", "gated_deltanet", "mamba")
INITS = ("attention", "random")

_DEFAULTS = TrainConfig(steps=200, batch_size=8, lr=1e-4, warmup=20, weight_decay=0.0, eval_every=50,
                        save_every=50, eval_rows=16)
STAGES = {"transfer": ("transfer",), "finetune": ("finetune",), "both": ("transfer", "finetune")}
LORA_ON = ("all", "new", "rest")

#: The options of ``hybridlm distill`` and ``recipes/distill.py``, as ``(flags, add_argument settings)``.
OPTIONS = [
    option("--teacher", required=True,
           help="the Transformer to convert: a checkpoint directory in any format hybridlm reads, or a .gguf file"),
    option("--keep-attention", default=None, metavar="I,J,...",
           help="the attention layers the student keeps (0-based); the other attention layers are replaced "
                "(without it: give --attention-every)"),
    option("--attention-every", type=int, default=None, metavar="N",
           help="keep attention layers N-1, 2N-1, ... (about 1 in N) and replace the others (without it: give "
                "--keep-attention)"),
    option("--mixer", choices=NEW_MIXERS, default="mamba2", help="the mixer that replaces attention"),
    option("--init", choices=INITS, default="attention",
           help="new mixers initialised from the attention weights they replace, or fresh (random)"),
    option("--data", nargs="+", default=None,
           help="training text: files, directories or globs, or one JSONL file of text / prompt-response / chat / "
                "input_ids lines (without it: the Python standard library, hybridlm.training.HELD_OUT_STDLIB held "
                "out)"),
    option("--eval-data", nargs="+", default=None,
           help="held-out text or JSONL (without it: the standard library's held-out files, or every 50th "
                "--data document)"),
    option("--held-out-rows", type=int, default=None,
           help="evaluate on at most this many held-out rows, evenly spaced (without it: every row)"),
    option("--stage", choices=tuple(STAGES), default="both",
           help="transfer (stage 1), finetune (stage 2) or both, one after the other"),
    option("--steps", type=int, default=_DEFAULTS.steps,
           help="optimizer steps of each stage; 0: write the initialised student and train nothing"),
    option("--transfer-steps", type=int, default=None,
           help="stage 1's optimizer steps (without it: --steps)"),
    option("--transfer-lr", type=float, default=1e-3, help="stage 1's peak learning rate"),
    option("--lr", type=float, default=_DEFAULTS.lr, help="stage 2's peak learning rate"),
    option("--temperature", type=float, default=1.0, help="stage 2: softmax temperature of the KL"),
    option("--ce-weight", type=float, default=0.0,
           help="stage 2: weight of the data's cross-entropy added to the KL (0: KL alone)"),
    option("--lora", type=int, default=0, help="stage 2: LoRA rank; 0: full training"),
    option("--lora-alpha", type=float, default=None, help="LoRA scale numerator (without it: 2 x rank)"),
    option("--lora-on", choices=LORA_ON, default="all",
           help="stage 2 with --lora: adapters on the linear layers of the new mixers, of the rest, or all"),
    option("--format", default="hybridlm",
           help="format of the saved student: hybridlm or a model_type that fits it (e.g. bamba)"),
    option("--seq-len", type=int, default=512, help="tokens per packed row"),
    option("--batch-size", type=int, default=_DEFAULTS.batch_size,
           help="global batch: rows per optimizer step, over all ranks and accumulation steps"),
    option("--grad-accum", type=int, default=_DEFAULTS.grad_accum, help="micro-batches per optimizer step"),
    option("--warmup", type=int, default=_DEFAULTS.warmup, help="linear warmup steps of each stage"),
    option("--weight-decay", type=float, default=_DEFAULTS.weight_decay, help="AdamW weight decay"),
    option("--precision", choices=PRECISIONS, default=_DEFAULTS.precision, help="fp32, or bf16 autocast"),
    option("--checkpointing", action="store_true", help="stage 2: activation checkpointing (recompute in backward)"),
    option("--layout", choices=LAYOUTS, default=_DEFAULTS.layout,
           help="documents: packed, positions restart per document; stream: GPT-style rows"),
    option("--eval-every", type=int, default=_DEFAULTS.eval_every, help="steps between evaluations"),
    option("--eval-rows", type=int, default=_DEFAULTS.eval_rows,
           help="held-out rows per periodic evaluation; the last one of a stage uses all"),
    option("--save-every", type=int, default=_DEFAULTS.save_every, help="steps between checkpoints"),
    option("--log-every", type=int, default=_DEFAULTS.log_every, help="steps between metrics rows"),
    option("--out", type=Path, required=True,
           help="output directory (the student, distill.json, distill.png; transfer/ and finetune/ per stage)"),
    option("--resume", action="store_true", help="continue the distillation in --out exactly where it stopped"),
    option("--seed", type=int, default=_DEFAULTS.seed, help="seed of the new mixers' fresh weights and the data order"),
    option("--parallel", choices=("none", "ddp", "fsdp"), default="none", help="data parallelism under torchrun"),
    option("--threads", type=int, default=None, help="torch CPU threads (without it: torch's choice)"),
]
