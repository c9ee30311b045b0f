"""What the modules of the ``hybridlm`` command share: the registry of subcommands and the printing of a stream
of generated tokens.

A subcommand is one function registered in :data:`COMMANDS` with :func:`command`; it imports what it needs when
it runs, so ``hybridlm --help`` and argument errors answer without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hybridlm.options import Option


@dataclass(frozen=True)
class Command:
    """A subcommand: ``run(args)``, its one-line help, and the ``(flags, settings)`` of its arguments as passed
    to :meth:`argparse.ArgumentParser.add_argument`."""

    run: Callable[[argparse.Namespace], None]
    help: str
    options: tuple[Option, ...]


#: Every subcommand of ``hybridlm``, by name, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {}


#: KV cache bit widths (16: unquantized; 8 / 4 / 2: KIVI), as ``CachePolicy.kv_bits`` takes them.
KV_BITS = (16, 8, 4, 2)


def command(name: str, help: str, *options: Option):
    """Register the decorated function as ``hybridlm NAME``."""

    def register(run: Callable[[argparse.Namespace], None]):
        COMMANDS[name] = Command(run, help, options)
        return run

    return register


def print_stream(model, tokenizer, prompt_ids: list[int], stops: list[int], settings: dict, chunk: int = 512,
                 policy=None, compile: bool | str = False) -> None:
    """Print the continuation of ``prompt_ids`` as it is generated (text with a tokenizer, else token ids),
    stopping at a stop token; ``compile``: through a compiled decode step (a string: its torch.compile mode)."""
    from hybridlm.decoding.incremental import IncrementalDecoder

    generated, shown = [], ""
    if compile:
        print("compiling the decode step with torch.compile (10-60 s on a CPU; the first token waits for it) ...",
              file=sys.stderr, flush=True)
    decoder = IncrementalDecoder(model, prefill_chunk_size=chunk, cache_policy=policy, compile=compile)
    for step in decoder.stream([prompt_ids], stop_tokens=stops, **settings):
        token = step[0].item()
        if token in stops:
            break
        generated.append(token)
        if tokenizer is None:
            print(token, end=" ", flush=True)
            continue
        text = tokenizer.decode(generated, skip_special_tokens=True)  # whole text: multi-token characters
        print(text[len(shown):], end="", flush=True)
        shown = text
    print()
