"""Pretraining from the command line: ``hybridlm train ...`` and ``recipes/pretrain.py`` run this.

    hybridlm train --model hybrid-tiny --steps 2000 --out runs/tiny
    torchrun --nproc_per_node 2 recipes/pretrain.py --parallel ddp --model hybrid-tiny --out runs/tiny

Everything is validated before training starts, and nothing in ``--out`` is overwritten without ``--resume``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridlm.options import add_options, option
from hybridlm.training.config import LAYOUTS, PRECISIONS, TrainConfig

_DEFAULTS = TrainConfig()


#: The options of ``hybridlm train`` and ``recipes/pretrain.py``, as ``(flags, add_argument settings)``.
OPTIONS = [
    option("--model", default="hybrid-tiny",
           help="a preset name, a HybridConfig JSON file, or a checkpoint directory in any format hybridlm loads"),
    option("--data", nargs="+", default=None,
           help="training text: files, directories or globs (without it: the Python standard library's "
                "sources, with hybridlm.training.HELD_OUT_STDLIB held out)"),
    option("--eval-data", nargs="+", default=None,
           help="held-out text (without it: the standard library's held-out files, or every 50th --data file)"),
    option("--tokenizer", default=None,
           help="a tokenizer directory to reuse (without it: a checkpoint --model's own, else a byte-level BPE "
                "trained on the training text)"),
    option("--vocab-size", type=int, default=4096, help="vocabulary of a newly trained BPE"),
    option("--seq-len", type=int, default=512, help="tokens per training row"),
    option("--batch-size", type=int, default=_DEFAULTS.batch_size,
           help="global batch: rows per optimizer step, over all ranks and accumulation steps"),
    option("--grad-accum", type=int, default=_DEFAULTS.grad_accum, help="micro-batches per optimizer step"),
    option("--steps", type=int, default=_DEFAULTS.steps, help="optimizer steps"),
    option("--lr", type=float, default=_DEFAULTS.lr, help="peak learning rate"),
    option("--warmup", type=int, default=_DEFAULTS.warmup, help="linear warmup steps"),
    option("--weight-decay", type=float, default=_DEFAULTS.weight_decay, help="AdamW weight decay"),
    option("--precision", choices=PRECISIONS, default=_DEFAULTS.precision, help="fp32, or bf16 autocast"),
    option("--checkpointing", action="store_true", help="activation checkpointing (recompute in backward)"),
    option("--layout", choices=LAYOUTS, default=_DEFAULTS.layout,
           help="documents: packed, positions restart per document; stream: GPT-style rows"),
    option("--eval-every", type=int, default=_DEFAULTS.eval_every, help="steps between evaluations"),
    option("--eval-rows", type=int, default=_DEFAULTS.eval_rows,
           help="held-out rows per periodic evaluation; the final one uses all"),
    option("--save-every", type=int, default=_DEFAULTS.save_every, help="steps between checkpoints"),
    option("--log-every", type=int, default=_DEFAULTS.log_every, help="steps between metrics rows"),
    option("--out", type=Path, required=True, help="output directory (checkpoint, metrics.jsonl, loss.png, model)"),
    option("--resume", action="store_true", help="continue the run in --out exactly where its checkpoint stopped"),
    option("--seed", type=int, default=_DEFAULTS.seed, help="seed of the initialisation and the data order"),
    option("--parallel", choices=("none", "ddp", "fsdp"), default="none", help="data parallelism under torchrun"),
    option("--threads", type=int, default=None, help="torch CPU threads (without it: torch's choice)"),
    option("--sample", default="def ", help="prompt of the sample printed at the end ('' for none)"),
]


def _train_config(args) -> TrainConfig:
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                       warmup=args.warmup, weight_decay=args.weight_decay, precision=args.precision,
                       checkpointing=args.checkpointing, layout=args.layout, eval_every=args.eval_every,
                       eval_rows=args.eval_rows, save_every=args.save_every, log_every=args.log_every, seed=args.seed)


def _corpus(args):
    from hybridlm.training.corpus import stdlib_corpus, text_corpus

    if args.data is None and args.eval_data is None:
        return stdlib_corpus()
    if args.data is None:
        raise ValueError("--eval-data needs --data")
    return text_corpus(args.data, args.eval_data)


def _tokenizer(args, corpus, out: Path, resume: bool, parallel):
    """The run's tokenizer: ``--out``'s when resuming, ``--tokenizer``, a checkpoint ``--model``'s own (its
    embeddings learned those ids), else a BPE trained on the training text (by the main process; the others
    receive it, so no rank reads a file another is writing)."""
    from hybridlm.training.tokenizer import bpe_tokenizer_from_json, has_tokenizer, load_tokenizer, train_bpe_tokenizer

    if resume:
        return load_tokenizer(out)
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer)
    if Path(args.model).is_dir():
        if not has_tokenizer(args.model):
            raise ValueError(f"--model {args.model} has no tokenizer: pass --tokenizer DIR with the one it was "
                             "trained with (a newly trained BPE's ids would not match its embeddings)")
        return load_tokenizer(args.model)
    trained = train_bpe_tokenizer(corpus.train_texts, args.vocab_size) if parallel.is_main else None
    if parallel.world_size == 1:
        return trained
    return bpe_tokenizer_from_json(parallel.broadcast_text(trained and trained.backend_tokenizer.to_str()))


def build_model(spec: str, vocab_size: int, seed: int):
    """A model from a preset name, a config JSON file or a checkpoint directory; a new model's vocabulary is
    the tokenizer's, a loaded model's must hold the tokenizer's."""
    import torch

    from hybridlm.config import HybridConfig
    from hybridlm.model import HybridForCausalLM
    from hybridlm.presets import PRESETS, preset

    path = Path(spec)
    if path.is_dir():
        from hybridlm.model import load

        model = load(path, dtype=torch.float32)
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"the tokenizer has {vocab_size} entries but the model {spec} only "
                             f"{model.config.vocab_size}")
        return model
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"--model {spec}: no such file")
        config = HybridConfig(**{**json.loads(path.read_text()), "vocab_size": vocab_size})
    elif spec in PRESETS:
        config = preset(spec, vocab_size=vocab_size)
    else:
        raise ValueError(f"--model {spec!r} is not a preset ({', '.join(sorted(PRESETS))}), a config file or a "
                         "checkpoint directory")
    torch.manual_seed(seed)
    return HybridForCausalLM(config)


def check_seq_len(seq_len: int, model) -> None:
    """``--seq-len`` leaves a token to predict and fits the model's positions."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (a token and the next one to predict), got {seq_len}")
    limit = model.config.max_length_limit
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is beyond the model's limit of {limit} positions")


#: The settings a resumed run must share with the run it continues (written in ``--out`` by a new run).
RUN_SETTINGS = "run_settings.json"


def _run_settings(args, rows) -> dict:
    """What decides the rows each step trains on: the packed training ids (data, tokenizer, --seq-len), the global
    batch, the layout and the seed of the data order."""
    import hashlib

    return {"--seq-len": args.seq_len, "--batch-size": args.batch_size, "--layout": args.layout, "--seed": args.seed,
            "training rows (--data)": hashlib.sha1(rows.ids.numpy().tobytes()).hexdigest()}


def record_settings(out: Path, settings: dict) -> None:
    """Write ``settings`` to ``OUT/run_settings.json`` (crash-safely), for :func:`check_same_settings`."""
    from hybridlm.files import write_file

    write_file(out / RUN_SETTINGS, json.dumps(settings, indent=1))


def check_same_settings(out: Path, settings: dict) -> None:
    """``--resume`` continues exactly only with the settings of the run in ``out``: refuse others, naming them
    (a run written before this file existed is not checked)."""
    from hybridlm.files import DamagedFileError, read_json

    path = out / RUN_SETTINGS
    if not path.is_file():
        return
    saved = read_json(path)
    if not isinstance(saved, dict) or saved.keys() != settings.keys():
        raise DamagedFileError(f"{path}: not the settings a run records (expected the keys {', '.join(settings)})")
    differing = [f"{name} {settings[name]} (the run used {saved[name]})" if name.startswith("--")
                 else f"{name} differ from the run's" for name in settings if saved[name] != settings[name]]
    if differing:
        raise ValueError(f"--resume: {out} was trained with other settings ({path}), so it would not continue "
                         "exactly: " + "; ".join(differing))


def run(args) -> dict:
    """Validate, prepare the data, train, save the model with its tokenizer; returns the last metrics."""
    import torch

    from hybridlm.files import save_pretrained_aside
    from hybridlm.training.checkpoint import check_new_run, check_resumable, existing_checkpoint, recover_checkpoint
    from hybridlm.training.distributed import SingleProcess, from_environment
    from hybridlm.training.evaluation import HeldOut
    from hybridlm.training.loop import train
    from hybridlm.training.packing import pack_documents, tokenize_documents
    from hybridlm.training.tokenizer import record_context_length

    config = _train_config(args)
    parallel = SingleProcess() if args.parallel == "none" else from_environment(args.parallel)
    out: Path = args.out
    if args.resume:
        if parallel.is_main:
            recover_checkpoint(out)  # what a kill during a save left: finished or undone
        parallel.barrier()
        existing_checkpoint(out)
    else:
        check_new_run(out)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    status = print if parallel.is_main else (lambda *_, **__: None)
    status("reading the corpus ...", flush=True)
    corpus = _corpus(args)
    status(f"{len(corpus.train)} training and {len(corpus.held_out)} held-out documents; preparing the tokenizer "
           "(training a BPE takes ~20 s on the standard library) ...", flush=True)
    tokenizer = _tokenizer(args, corpus, out, args.resume, parallel)
    model = build_model(args.model, len(tokenizer), args.seed)
    check_seq_len(args.seq_len, model)
    parallel.check_batch(config.batch_size // config.grad_accum)
    if args.resume:
        check_resumable(out, model)
    eos = tokenizer.eos_token_id
    status("tokenizing and packing the corpus ...", flush=True)
    rows = pack_documents(tokenize_documents(tokenizer, corpus.train_texts), args.seq_len, eos)
    held_out = HeldOut.of(tokenizer, corpus.held_out_texts, args.seq_len)
    settings = _run_settings(args, rows)
    if args.resume:
        check_same_settings(out, settings)
    if parallel.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not args.resume:  # a resumed run loaded both from OUT
            record_context_length(tokenizer, model.config, args.seq_len)
            save_pretrained_aside(tokenizer, out)
            record_settings(out, settings)
        print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, layers {model.config.layer_types}")
        print(f"data: {len(rows)} rows x {args.seq_len} tokens for training ({len(corpus.train)} documents), "
              f"{len(held_out.rows)} held-out rows; {1 / held_out.tokens_per_byte:.2f} bytes per token")
    last = train(model, rows, config, out, eval_rows=held_out.rows, tokens_per_byte=held_out.tokens_per_byte,
                 resume=args.resume, parallel=parallel)
    model = parallel.full_model(model)  # FSDP: gather the shards (collective); None on other ranks
    if parallel.is_main:
        model.config.eos_token_id = model.generation_config.eos_token_id = eos
        model.config.bos_token_id = model.generation_config.bos_token_id = eos
        save_pretrained_aside(model, out)
        print(json.dumps(last))
        if args.sample:
            print(sample(model, tokenizer, args.sample))
    return last


def sample(model, tokenizer, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy continuation of ``prompt`` (a quick look at what the model learned)."""
    from hybridlm.decoding.incremental import IncrementalDecoder

    model.eval()
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = IncrementalDecoder(model).generate([ids], max_new_tokens=max_new_tokens)[0, len(ids):]
    return prompt + tokenizer.decode(out.tolist())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return run(add_options(parser, OPTIONS).parse_args(argv))


if __name__ == "__main__":
    from hybridlm.options import run_reporting_bad_input

    run_reporting_bad_input("python -m hybridlm.training.pretrain", main)
