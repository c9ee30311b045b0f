"""Distillation of a pretrained Transformer into a hybrid (attention layers replaced by Mamba-2, Gated DeltaNet or
Mamba, initialised from the attention weights, then attention transfer and KL distillation):

    python recipes/distill.py --teacher DIR --attention-every 4 --mixer mamba2 --stage both --out runs/student
    torchrun --nproc_per_node 2 recipes/distill.py --parallel ddp --teacher DIR --keep-attention 3,7 --out ...

See docs/distillation.md for every option and the SmolLM2-135M conversion measured with it.
"""

from hybridlm.options import run_reporting_bad_input
from hybridlm.training.distill import main

if __name__ == "__main__":
    run_reporting_bad_input("recipes/distill.py", main)  # bad input: one line naming the option, no traceback
