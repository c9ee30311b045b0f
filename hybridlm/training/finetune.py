"""Supervised fine-tuning: ``recipes/finetune.py`` and ``python -m hybridlm.training.finetune`` run this.

    python recipes/finetune.py --model runs/tiny --data docstrings --lora 8 --steps 200 --out runs/tiny-sft

Examples are JSONL lines, ``{"prompt", "response"}`` or chat ``{"messages": [{"role", "content"}, ...]}`` (rendered
with the tokenizer's chat template; :data:`DEFAULT_CHAT_TEMPLATE` when it has none, saved with the result). The
loss covers the response (assistant) tokens and the end-of-text after them, nothing else. Whole examples are
packed into rows (``position_ids`` restart per example; never cut unless longer than a row) and trained by the
pretraining loop. Full fine-tuning, or LoRA (``--lora RANK``) on every linear layer; adapters are saved, or
merged (``--merge``) and the model written in ``--format`` (default: the format it was loaded from).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridlm.options import add_options, option
from hybridlm.training.config import PRECISIONS, TrainConfig

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
BUILTIN_TASKS = {"docstrings": "docstring -> function from the standard library (hybridlm.training.docstring_task)"}


def read_examples(path: str | Path, option: str = "--data") -> list[dict]:
    """The examples of a JSONL file, each checked to be a prompt/response pair or a chat with an assistant turn;
    ``option`` is the command-line option named in errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{option} {path}: no such file")
    examples = []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            example = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{option} {path}:{number}: not UTF-8 text ({error.reason} at byte {error.start} of "
                             "the line)") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{option} {path}:{number}: not a JSON line ({error})") from None
        if not (_is_pair(example) or _is_chat(example)):
            raise ValueError(f"{option} {path}:{number}: an example needs string 'prompt' and 'response', or a "
                             "'messages' list of {'role': str, 'content': str} with an assistant turn")
        examples.append(example)
    if not examples:
        raise ValueError(f"{option} {path}: no examples")
    return examples


def _is_pair(example) -> bool:
    return isinstance(example, dict) and all(isinstance(example.get(k), str) for k in ("prompt", "response"))


def _is_chat(example) -> bool:
    messages = example.get("messages") if isinstance(example, dict) else None
    return (isinstance(messages, list)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)
            and any(m["role"] == "assistant" for m in messages))


def _chat_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation as ``(text, trained)`` pieces: each assistant turn trained, the rest not."""
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (prefix.startswith(done) and full.startswith(prefix)):
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation; "
                             "the assistant turns cannot be located")
        segments += [(prefix[len(done):], False), (full[len(prefix):], True)]
        done = full
    if not segments:
        raise ValueError("a chat example has no assistant message to learn")
    return segments


def encode_example(tokenizer, example: dict) -> tuple[list[int], list[bool]]:
    """Token ids and which of them are targets (response tokens and the closing end-of-text)."""
    if "messages" in example:
        segments = _chat_segments(tokenizer, example["messages"])
    else:
        segments = [(example["prompt"], False), (example["response"], True)]
    ids, trained = [], []
    for text, is_target in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        trained += [is_target] * len(piece)
    return ids + [tokenizer.eos_token_id], trained + [True]


def with_targets(encoded: list[tuple[list[int], list[bool]]], seq_len: int, option: str = "--data"):
    """The examples that keep a target token within the first ``seq_len`` (longer ones are cut when packed), and
    the counts ``{"examples_cut", "examples_without_target"}`` (printed when not zero); an error when no example
    keeps one."""
    counts = {"examples_cut": sum(len(ids) > seq_len for ids, _ in encoded)}
    kept = [(ids, trained) for ids, trained in encoded if any(trained[:seq_len])]
    counts["examples_without_target"] = len(encoded) - len(kept)
    if not kept:
        raise ValueError(f"{option}: none of the {len(encoded)} examples keeps a response token within --seq-len "
                         f"{seq_len} (each prompt fills the row); raise --seq-len or shorten the prompts")
    if counts["examples_cut"]:
        print(f"{option}: {counts['examples_cut']} of {len(encoded)} examples are longer than --seq-len {seq_len} "
              f"and were cut; {counts['examples_without_target']} of them kept no response token and are left out")
    return kept, counts


def pack_examples(encoded: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
    """Whole examples packed greedily, in order, into rows of ``seq_len`` (an example longer than a row is cut);
    each row's tail is padding (untrained). Returns :class:`~hybridlm.training.packing.PackedRows`."""
    import torch

    from hybridlm.training.packing import PackedRows

    rows: list[tuple[list[int], list[int], list[bool]]] = []
    ids, positions, trained = [], [], []

    def close_row():
        pad = seq_len - len(ids)
        rows.append((ids + [pad_id] * pad, positions + list(range(pad)), trained + [False] * pad))

    for example_ids, example_trained in encoded:
        example_ids, example_trained = example_ids[:seq_len], example_trained[:seq_len]
        if len(ids) + len(example_ids) > seq_len:
            close_row()
            ids, positions, trained = [], [], []
        ids, trained = ids + example_ids, trained + example_trained
        positions += range(len(example_ids))
    if ids:
        close_row()
    columns = list(zip(*rows))
    return PackedRows(torch.tensor(columns[0]), torch.tensor(columns[1]), torch.tensor(columns[2]))


_DEFAULTS = TrainConfig(lr=1e-4, warmup=10, steps=200, batch_size=8, eval_every=50, save_every=100)


#: The options of ``hybridlm finetune`` and ``recipes/finetune.py``, as ``(flags, add_argument settings)``.
OPTIONS = [
    option("--model", required=True,
           help="a checkpoint directory in any format hybridlm loads (or a preset name, for a quick test)"),
    option("--data", required=True,
           help=f"training examples: a JSONL file, or a built-in task ({', '.join(BUILTIN_TASKS)})"),
    option("--eval-data", default=None,
           help="evaluation examples (JSONL; without it: the task's held-out part, or every 10th --data example)"),
    option("--tokenizer", default=None, help="a tokenizer directory (without it: the --model directory)"),
    option("--lora", type=int, default=0, help="LoRA rank; 0: full fine-tuning"),
    option("--lora-alpha", type=float, default=None, help="LoRA scale numerator (without it: 2 x rank)"),
    option("--merge", action="store_true", help="with --lora: merge the adapters and save the whole model"),
    option("--format", default=None,
           help="format of the saved model: hybridlm or a foreign model_type (without it: the format of --model)"),
    option("--seq-len", type=int, default=512, help="tokens per packed row"),
    option("--batch-size", type=int, default=_DEFAULTS.batch_size, help="rows per optimizer step"),
    option("--grad-accum", type=int, default=_DEFAULTS.grad_accum, help="micro-batches per step"),
    option("--steps", type=int, default=_DEFAULTS.steps, help="optimizer steps"),
    option("--lr", type=float, default=_DEFAULTS.lr, help="peak learning rate"),
    option("--warmup", type=int, default=_DEFAULTS.warmup, help="linear warmup steps"),
    option("--precision", choices=PRECISIONS, default=_DEFAULTS.precision, help="training precision"),
    option("--checkpointing", action="store_true", help="activation checkpointing (recompute in backward)"),
    option("--eval-every", type=int, default=_DEFAULTS.eval_every, help="steps between evaluations"),
    option("--save-every", type=int, default=_DEFAULTS.save_every, help="steps between checkpoints"),
    option("--log-every", type=int, default=_DEFAULTS.log_every, help="steps between metrics rows"),
    option("--out", type=Path, required=True, help="output directory (model or adapter, tokenizer, metrics)"),
    option("--seed", type=int, default=_DEFAULTS.seed, help="random seed"),
]


def _examples(args) -> tuple[list[dict], list[dict]]:
    if args.data in BUILTIN_TASKS:
        from hybridlm.training.docstring_task import docstring_examples

        train = docstring_examples(held_out=False)
        return train, (read_examples(args.eval_data, "--eval-data") if args.eval_data
                       else docstring_examples(held_out=True))
    train = read_examples(args.data)
    if args.eval_data:
        return train, read_examples(args.eval_data, "--eval-data")
    if len(train) < 2:
        raise ValueError(f"--data {args.data}: too few examples to hold some out; pass --eval-data")
    return [e for i, e in enumerate(train) if i % 10], train[::10]


def _source_format(spec: str) -> str:
    """``hybridlm`` for hybridlm's own checkpoints and presets, else the checkpoint's ``model_type``."""
    from hybridlm.formats import is_own, read_config

    if not Path(spec).is_dir():
        return "hybridlm"
    config = read_config(Path(spec))
    return "hybridlm" if is_own(config) else config["model_type"]


def check_exportable(model, fmt: str) -> None:
    """Raise, before training, if ``model`` cannot be written as ``fmt``."""
    from hybridlm.formats import FORMATS, check_expressible, undeclared_options

    if fmt == "hybridlm":
        return
    target = FORMATS.get(fmt)
    if target is None or target.from_config is None:
        writable = sorted(name for name, f in FORMATS.items() if f.from_config is not None)
        raise ValueError(f"--format {fmt!r}: hybridlm writes {', '.join(['hybridlm'] + writable)}")
    check_expressible(fmt, undeclared_options(model.config, target))
    target.from_config(model.config)


def run(args) -> dict:
    """Validate, encode and pack, evaluate, train, evaluate, save; returns the eval losses before and after."""
    import torch

    from hybridlm.files import write_file
    from hybridlm.training.checkpoint import check_new_run
    from hybridlm.training.loop import evaluate, train
    from hybridlm.training.pretrain import build_model, check_seq_len
    from hybridlm.training.tokenizer import load_tokenizer

    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                         warmup=args.warmup, precision=args.precision, checkpointing=args.checkpointing,
                         eval_every=args.eval_every, save_every=args.save_every, log_every=args.log_every,
                         seed=args.seed, weight_decay=0.0)
    if args.merge and not args.lora:
        raise ValueError("--merge needs --lora")
    check_new_run(args.out, "choose another --out")
    tokenizer_dir = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    if tokenizer_dir is None:
        raise ValueError(f"--model {args.model} is not a directory: pass --tokenizer")
    tokenizer = load_tokenizer(tokenizer_dir)
    train_examples, eval_examples = _examples(args)
    if tokenizer.chat_template is None and any("messages" in e for e in train_examples + eval_examples):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    model = build_model(args.model, len(tokenizer), args.seed)
    fmt = args.format or _source_format(args.model)
    if not args.lora or args.merge:
        check_exportable(model, fmt)
    check_seq_len(args.seq_len, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_encoded, counts = with_targets([encode_example(tokenizer, e) for e in train_examples], args.seq_len)
    eval_encoded, _ = with_targets([encode_example(tokenizer, e) for e in eval_examples], args.seq_len,
                                   "--eval-data" if args.eval_data else "held-out examples")
    rows = pack_examples(train_encoded, args.seq_len, pad)
    eval_rows = pack_examples(eval_encoded, args.seq_len, pad)
    if args.lora:
        from hybridlm.training.lora import add_lora

        model = add_lora(model, args.lora, args.lora_alpha)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{len(train_examples)} training examples in {len(rows)} rows, {len(eval_examples)} evaluation examples; "
          f"{trainable:,} trainable parameters")
    before = evaluate(model, eval_rows, "documents", precision=config.precision)
    print(f"eval loss before: {before:.4f}")
    torch.manual_seed(args.seed)
    last = train(model, rows, config, args.out, eval_rows=eval_rows)
    result = {"eval_loss_before": before, "eval_loss_after": last["eval_loss"], "steps": config.steps, **counts}
    _save(model, tokenizer, args, fmt)
    write_file(args.out / "finetune.json", json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


def _save(model, tokenizer, args, fmt: str) -> None:
    """Adapters alone (``--lora``), or the whole model in ``fmt`` (full fine-tuning, ``--lora --merge``)."""
    from hybridlm.files import save_pretrained_aside

    if args.lora and not args.merge:
        model.peft_config["default"].base_model_name_or_path = str(args.model)
        save_pretrained_aside(model, args.out)
    else:
        if args.lora:
            from hybridlm.training.lora import merge_lora

            model = merge_lora(model)
        save_pretrained_aside(model, args.out, format=fmt)
    save_pretrained_aside(tokenizer, args.out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return run(add_options(parser, OPTIONS).parse_args(argv))


if __name__ == "__main__":
    from hybridlm.options import run_reporting_bad_input

    run_reporting_bad_input("python -m hybridlm.training.finetune", main)
