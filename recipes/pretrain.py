"""Pretrain a hybrid (or any model hybridlm builds or loads) on text; the same as ``hybridlm train``.

    python recipes/pretrain.py --model hybrid-tiny --steps 1000 --out runs/tiny
    torchrun --nproc_per_node 2 recipes/pretrain.py --parallel ddp --model hybrid-tiny --out runs/tiny-ddp

Without ``--data`` it trains on the Python standard library shipped with the interpreter (no download).
See docs/training.md for every option, resuming, scale-out and how the bundled models were made.
"""

from hybridlm.options import run_reporting_bad_input
from hybridlm.training.pretrain import main

if __name__ == "__main__":
    run_reporting_bad_input("recipes/pretrain.py", main)  # bad input: one line naming the option, no traceback
