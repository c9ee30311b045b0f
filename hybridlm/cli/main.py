"""The ``hybridlm`` command: its parser and entry point, and the subcommands that run, convert and train
checkpoints (``generate``, ``convert``, ``train``, ``finetune``, ``distill``); those that try, inspect and measure
are in :mod:`hybridlm.cli.inspection`.

Each subcommand is one function registered in :data:`~hybridlm.cli.common.COMMANDS` with
:func:`~hybridlm.cli.common.command`; it imports what it needs when it runs, so ``hybridlm --help`` and argument
errors answer without importing torch or transformers. To add one::

    @command("name", "one line of help", option("--flag", type=int, default=3, help="what it sets"))
    def run_name(args):
        from .something import heavy  # imported here, not at the top of this module
        ...
"""

from __future__ import annotations

import argparse
import logging

from hybridlm.cli import inspection  # noqa: F401  (registers demo, info, build-kernels, bench, memory: listed first)
from hybridlm.cli.common import COMMANDS, KV_BITS, command, print_stream
from hybridlm.options import (
    add_options,
    non_negative_float,
    non_negative_int,
    option,
    positive_int,
    probability,
    run_reporting_bad_input,
    token_ids,
)
from hybridlm.training.distill_options import OPTIONS as DISTILL_OPTIONS  # argparse settings only: these load no torch
from hybridlm.training.finetune import OPTIONS as FINETUNE_OPTIONS
from hybridlm.training.pretrain import OPTIONS as PRETRAIN_OPTIONS


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help when it has a default worth stating, and wraps lines at
    spaces only (a preset name such as ``qwen3-next-small`` is not split at its hyphens)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        stated = default is not None and default is not False and default != argparse.SUPPRESS
        if stated and "%(default)" not in text and "(default: " not in text and action.option_strings:
            if isinstance(default, list):
                shown = " ".join(map(str, default))
            elif isinstance(default, str) and not default.isprintable():  # a newline would print as a space
                shown = repr(default).replace("%", "%%")
            else:
                shown = "%(default)s"
            text += f" (default: {shown})"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridlm", formatter_class=_HelpFormatter,
        description="Hybrid Transformer-SSM language models: try, inspect, benchmark, run and convert them.",
        epilog="'hybridlm COMMAND --help' lists the options of one command.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        sub = commands.add_parser(name, help=cmd.help, description=cmd.help, formatter_class=_HelpFormatter)
        add_options(sub, cmd.options).set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    quiet_optional_imports()
    run_reporting_bad_input(f"hybridlm {args.command}", args.run, args)


def quiet_optional_imports() -> None:
    """torchao (which transformers imports whenever it is installed: hybridlm's int8 extra) logs the CUDA
    libraries it cannot load on a CPU machine, and torch notes the enums it registers: noise on every command."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


# --- commands --------------------------------------------------------------------------------------

@command(
    "generate", "Generate from a checkpoint (any supported format, default: the bundled hybrid); text in and out.",
    option("--model", metavar="DIR_OR_HUB_ID",
           help="checkpoint directory, a .gguf file (needs the gguf extra), or a hub id already in the local "
                "Hugging Face cache; default: the bundled hybrid (hybridlm.bundled_model_dir())"),
    option("--prompt", help="text prompt, encoded with the checkpoint's tokenizer (or as UTF-8 bytes for a "
                            "byte-level model without one); default: give --ids instead"),
    option("--chat", action="store_true",
           help="send --prompt as a user message through the tokenizer's chat template (instruct models)"),
    option("--ids", type=token_ids,
           help="comma-separated token ids, instead of --prompt; default: give --prompt instead"),
    option("--max-new-tokens", type=non_negative_int, default=64, help="tokens to generate at most"),
    option("--temperature", type=non_negative_float, default=0.0, help="sampling temperature; 0 = greedy"),
    option("--top-k", type=positive_int, help="sample from the k most likely tokens only; default: no top-k filtering"),
    option("--top-p", type=probability, help="nucleus sampling threshold in (0, 1]; default: no top-p filtering"),
    option("--seed", type=int, help="random seed for sampling; default: not seeded"),
    option("--prefill-chunk", type=positive_int, default=512, help="prompt tokens fed per forward during prefill"),
    option("--kv-bits", type=int, choices=KV_BITS, default=16,
           help="KV cache bits: 16, or 8 / 4 / 2 (KIVI quantization)"),
    option("--kv-residual", type=non_negative_int,
           help="with --kv-bits: recent tokens kept in full precision (lower it for a short --window); "
                "default: 128"),
    option("--kv-group-size", type=positive_int,
           help="with --kv-bits: tokens per key scale, channels per value scale; default: 32"),
    option("--sink-tokens", type=non_negative_int, default=0, help="attention sinks kept with --window (StreamingLLM)"),
    option("--window", type=positive_int,
           help="keep only the last WINDOW tokens' keys and values (with --sink-tokens); default: keep every token"),
    option("--page-size", type=positive_int,
           help="paged KV cache: keys and values in pages of PAGE_SIZE tokens; default: one contiguous buffer "
                "per layer"),
    option("--compile", nargs="?", const=True, default=False, metavar="MODE",
           help="decode with a static cache and a step compiled by torch.compile (faster per token; the first "
                "token waits for the compile, 10-60 s on a CPU); MODE: a torch.compile mode, e.g. default "
                "(MKL's matmuls on a CPU) or max-autotune-no-cudagraphs (times MKL against inductor's C++ GEMM "
                "templates, a compile about twice as long); default: inductor's default mode with the C++ GEMM "
                "templates on a CPU; without it: eager decoding"),
)
def run_generate(args) -> None:
    if args.prompt is None and not args.ids:
        raise ValueError("give --prompt TEXT or --ids 1,2,3")  # before the weights are loaded
    if args.chat and args.prompt is None:
        raise ValueError("--chat sends --prompt as a chat message: give --prompt")
    model, tokenizer, directory = _model_and_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs tokenizer files in {directory} (this model has "
                             f"{model.config.vocab_size} tokens, so it is not byte-level); give --ids instead")
        prompt_ids = chat_prompt(tokenizer, args.prompt) if args.chat else \
            tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = args.ids
    eos = model.config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)  # the end of a chat turn, where it is not the model's eos
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    from hybridlm.cache.kv.policy import CachePolicy

    quantization = {name: value for name, value in (("kv_group_size", args.kv_group_size),
                                                     ("kv_residual", args.kv_residual)) if value is not None}
    if quantization and args.kv_bits == 16:
        raise ValueError(f"{', '.join('--' + name.replace('_', '-') for name in quantization)} only apply with "
                         "--kv-bits 8, 4 or 2")
    policy = CachePolicy(kv_bits=args.kv_bits, **quantization, sink_tokens=args.sink_tokens, window=args.window,
                         page_size=args.page_size)
    print_stream(model, tokenizer, prompt_ids, stops, settings, args.prefill_chunk,
                 None if policy.is_default else policy, compile=args.compile)


def _model_and_tokenizer(source: str | None):
    """``(model, tokenizer or None, where it came from)`` for ``--model``: a checkpoint directory or hub id
    (default: the bundled hybrid) with its tokenizer files, or a GGUF file with the tokenizer it holds."""
    from pathlib import Path

    from hybridlm.paths import local_directory, split_gguf_path

    gguf = split_gguf_path(source, None) if source else None
    local = local_directory(source) if source and gguf is None else None  # a mistyped path fails before torch
    import torch

    from hybridlm.bundled import bundled_model_dir
    from hybridlm.formats.base import resolve_directory
    from hybridlm.formats.gguf import read_gguf_tokenizer
    from hybridlm.model import load
    from hybridlm.training.tokenizer import check_tokenizer_fits, tokenizer_for

    if gguf is not None:
        model = load(Path(source), dtype=torch.float32)
        tokenizer = read_gguf_tokenizer(*gguf)
        return model, tokenizer and check_tokenizer_fits(tokenizer, model.config.vocab_size, source), source
    directory = local or (resolve_directory(source) if source else bundled_model_dir())
    model = load(directory, dtype=torch.float32)
    return model, tokenizer_for(directory, model.config.vocab_size), directory


def chat_prompt(tokenizer, message: str) -> list[int]:
    """The ids of ``message`` as one user turn in the tokenizer's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: this tokenizer has no chat template (not an instruct model?); drop --chat")
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@command(
    "convert", "Read SRC (any supported format, or a .gguf file) and write DST in the format given by --to.",
    option("src", metavar="SRC", help="checkpoint directory (or hub id in the local cache), or a .gguf file, to read"),
    option("dst", metavar="DST", help="directory to write"),
    option("--to", help="hybridlm, or a model_type such as llama, jamba, mamba2, bamba; default for a .gguf "
                        "file: its own family (llama, qwen2, ...), with its tokenizer; required otherwise"),
)
def run_convert(args) -> None:
    from pathlib import Path

    from hybridlm.paths import local_directory, split_gguf_path

    gguf = split_gguf_path(args.src, None)
    if gguf is None:
        local_directory(args.src)  # a mistyped path fails before torch loads
        if args.to is None:
            raise ValueError("--to is required unless SRC is a .gguf file (say which format to write)")
    from hybridlm.files import save_pretrained_aside
    from hybridlm.model import load

    model = load(Path(args.src) if gguf else args.src)
    if gguf is not None:
        from transformers import AutoConfig

        from hybridlm.formats.gguf import read_gguf_tokenizer

        target = args.to or AutoConfig.from_pretrained(gguf[0], gguf_file=gguf[1]).model_type
        model.save_pretrained(args.dst, format=target)
        tokenizer = read_gguf_tokenizer(*gguf)
    else:
        target = args.to
        model.save_pretrained(args.dst, format=target)
        tokenizer = _carry_companions(args.src, Path(args.dst), model.config.vocab_size)
    if tokenizer is not None:
        save_pretrained_aside(tokenizer, args.dst)
    print(f"wrote {args.dst} ({target}, {'with its tokenizer' if tokenizer else 'no tokenizer in the source'})")


def _carry_companions(source: str, target, vocab_size: int):
    """What a converted checkpoint keeps from ``source`` besides its weights: its ``generation_config.json``
    (written over the default one the export derives from the config) and its tokenizer (returned, checked to
    fit the model, with its chat template), or None when it has none."""
    from transformers import GenerationConfig

    from hybridlm.files import save_pretrained_aside
    from hybridlm.formats.base import resolve_directory
    from hybridlm.training.tokenizer import tokenizer_for

    directory = resolve_directory(source)
    if (directory / "generation_config.json").is_file():
        save_pretrained_aside(GenerationConfig.from_pretrained(directory), target)
    tokenizer = tokenizer_for(directory, vocab_size)
    return tokenizer if hasattr(tokenizer, "save_pretrained") else None  # not the byte-level fallback


@command("train", "Pretrain a model (default: a 1:3 hybrid on the Python standard library); docs/training.md.",
         *PRETRAIN_OPTIONS)
def run_train(args) -> None:
    from hybridlm.training.pretrain import run

    run(args)


@command("finetune", "Fine-tune a checkpoint (full or LoRA) on JSONL prompt/response or chat examples; "
         "docs/training.md.", *FINETUNE_OPTIONS)
def run_finetune(args) -> None:
    from hybridlm.training.finetune import run

    run(args)


@command("distill", "Turn a Transformer into a hybrid: attention layers replaced by Mamba-2 / Gated DeltaNet / Mamba, "
         "initialised from the attention and distilled; docs/distillation.md.", *DISTILL_OPTIONS)
def run_distill(args) -> None:
    from hybridlm.training.distill import run

    run(args)


if __name__ == "__main__":
    main()
