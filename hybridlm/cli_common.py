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

Option = tuple[tuple[str, ...], dict]

@dataclass(frozen=True)
class Command:
    """A subcommand: ``run(args)``, its one-line help, and the ``(flags, settings)`` of its arguments as passed
    to :meth:`argparse.ArgumentParser.add_argument`."""

    run: Callable[[argparse.Namespace], None]
    help: str
    options: tuple[Option, ...]


#: Every subcommand of ``hybridlm``, by name, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {}


def option(*flags: str, **settings) -> Option:
    """One argument of a subcommand, as for ``add_argument``. Every option needs ``help``; a default other than
    None / False is appended to it, so for a default of None say in ``help`` what happens without the option
    (``"...; default: ..."`` or ``"(without it: ...)"``): ``tests/test_cli.py`` checks that every option does."""
    return flags, settings


def add_options(parser: argparse.ArgumentParser, options) -> argparse.ArgumentParser:
    """``parser`` with every :func:`option` of ``options`` added."""
    for flags, settings in options:
        parser.add_argument(*flags, **settings)
    return parser


def run_reporting_bad_input(prog: str, run: Callable, *args):
    """``run(*args)``; bad input (ValueError, TypeError, OSError) or a missing optional extra (ImportError, whose
    message says what to install) ends the program with one line ``prog: message`` on stderr and exit status 2,
    not a traceback (``hybridlm`` and the training recipes)."""
    try:
        return run(*args)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        raise SystemExit(2) from error


#: KV cache bit widths (16: unquantized; 8 / 4 / 2: KIVI), as ``CachePolicy.kv_bits`` takes them.
KV_BITS = (16, 8, 4, 2)


def _integer_at_least(low: int):
    """An argparse ``type``: an integer ``>= low``, else a usage error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive_int = _integer_at_least(1)
non_negative_int = _integer_at_least(0)


def _number_in(low: float, high: float, low_open: bool):
    """An argparse ``type``: a float in ``(low, high]`` (``low_open``) or ``[low, high]``."""
    bounds = f"{'(' if low_open else '['}{low}, {high}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < value <= high if low_open else low <= value <= high):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text}")
        return value

    parse.__name__ = f"number in {bounds}"
    return parse


probability = _number_in(0.0, 1.0, low_open=True)
non_negative_float = _number_in(0.0, float("inf"), low_open=False)


def token_ids(text: str) -> list[int]:
    """An argparse ``type``: comma-separated token ids (``3,1,4``)."""
    try:
        ids = [int(token) for token in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {min(ids)}")
    return ids


def command(name: str, help: str, *options: Option):
    """Register the decorated function as ``hybridlm NAME``."""

    def register(run: Callable[[argparse.Namespace], None]):
        COMMANDS[name] = Command(run, help, options)
        return run

    return register


def print_stream(model, tokenizer, prompt_ids: list[int], stops: list[int], settings: dict, chunk: int = 512,
                 policy=None, compile: bool = False) -> None:
    """Print the continuation of ``prompt_ids`` as it is generated (text with a tokenizer, else token ids),
    stopping at a stop token; ``compile``: through a compiled decode step."""
    from hybridlm.generation import IncrementalDecoder

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
