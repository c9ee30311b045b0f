"""The ``hybridlm`` command: the parser and entry point with the subcommands that run, convert and train
checkpoints (:mod:`~.main`), those that try, inspect and measure (:mod:`~.inspection`), what they share
(:mod:`~.common`) and the measurements behind ``bench`` and ``demo`` (:mod:`~.bench`).

The top of the stack: may import anything in hybridlm; nothing in hybridlm imports it. Importing it loads no
torch (each subcommand imports what it needs when it runs), so ``--help`` answers at once.
"""

from hybridlm.cli.common import COMMANDS
from hybridlm.cli.main import build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
