"""Supervised fine-tuning (full or LoRA) of any checkpoint hybridlm loads, on JSONL prompt/response or chat
examples, or on the built-in offline task (docstring -> function from the standard library):

    python recipes/finetune.py --model runs/tiny --data docstrings --lora 8 --steps 200 --out runs/tiny-sft
    python recipes/finetune.py --model jamba-dir --data chats.jsonl --lora 16 --merge --out jamba-sft  # Jamba out

See docs/training.md ("Fine-tuning") for every option.
"""

from hybridlm.options import run_reporting_bad_input
from hybridlm.training.finetune import main

if __name__ == "__main__":
    run_reporting_bad_input("recipes/finetune.py", main)  # bad input: one line naming the option, no traceback
