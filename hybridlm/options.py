"""Command-line options as data, shared by the ``hybridlm`` command and the recipes (``recipes/*.py``, whose
options the subcommands reuse): declared with :func:`option`, added with :func:`add_options`, typed by the
validators below, and run with :func:`run_reporting_bad_input` so that bad input is one line, not a traceback.
Imports nothing heavy (``--help`` answers without torch) and nothing of hybridlm."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Option = tuple[tuple[str, ...], dict]


def option(*flags: str, **settings) -> Option:
    """One argument of a subcommand, as for ``add_argument``. Every option needs ``help``; a default other than
    None / False is appended to it, so for a default of None say in ``help`` what happens without the option
    (``"...; default: ..."`` or ``"(without it: ...)"``): ``tests/cli/test_cli.py`` checks that every option does."""
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
