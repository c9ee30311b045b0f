"""Int8 weight-only linears (``hybridlm.model.quantize_weights``, torchao) against fp32 on the CPU, on the same
weights: quality (held-out next-token KL and greedy agreement) and decode speed, eager and compiled.

For each model (the bundled ``hybrid``, hybrid-tiny; ``smollm2``, SmolLM2-135M-Instruct once ``real_model.py
fetch`` has run) it loads the fp32 model twice and quantizes one copy, then

* over ``--tokens`` held-out tokens, the mean next-token KL(fp32 || int8) in nats and the share of positions where
  the two pick the same next token; the greedy continuation of the first 64 for ``--new-tokens`` tokens: how many
  leading tokens agree;
* decode ms/token after a ``--context``-token prefill: fp32 and int8, eager and compiled (static cache), the four
  taking turns step by step (so machine load affects them alike), min and median, and the ratios fp32 / int8
  (> 1: int8 is faster);
* the linear weights' bytes, fp32 against int8 (codes and scales).

    python benchmarks/int8_cpu.py [--models hybrid smollm2] [--threads 1] [--context 256]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hybridlm  # noqa: E402
from hybridlm.model import quantize_weights  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bf16_cpu import decode_times, directory_of, parse_args, quality  # noqa: E402
from real_model import held_out_code  # noqa: E402


def linear_bytes(model: nn.Module) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight
            parts = [weight.qdata, weight.scale] if hasattr(weight, "qdata") else [weight]
            total += sum(t.numel() * t.element_size() for t in parts)
    return total


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    warnings.filterwarnings("ignore", module="torch")  # torchao's notes on tensor subclasses under compile
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, context {args.context}, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    from transformers import AutoTokenizer

    for name in args.models:
        directory = directory_of(name)
        fp32 = hybridlm.HybridForCausalLM.from_pretrained(directory).eval()
        int8 = quantize_weights(hybridlm.HybridForCausalLM.from_pretrained(directory).eval())
        tokenizer = AutoTokenizer.from_pretrained(directory)
        ids = torch.tensor([held_out_code(tokenizer, max(args.tokens, args.context))])
        q = quality({"fp32": fp32, "int8": int8}, ids[:, :args.tokens], args.new_tokens, "fp32", "int8")
        models = {"fp32": fp32, "int8": int8, "fp32 compiled": fp32, "int8 compiled": int8}
        t = decode_times(models, ids[:, :args.context], args.warmup, args.steps,
                         compiled=("fp32 compiled", "int8 compiled"))
        times = ", ".join(f"{label} {low:.2f} / {median:.2f}" for label, (low, median) in t.items())
        print(f"{name}: KL(fp32 || int8) {q['kl']:.2e} nats/token over {args.tokens} held-out tokens, same next "
              f"token {100 * q['top1']:.1f}%, greedy {q['greedy_prefix']}/{args.new_tokens} tokens identical; "
              f"linear weights {linear_bytes(fp32) / 2**20:.1f} MiB fp32, {linear_bytes(int8) / 2**20:.1f} MiB int8; "
              f"decode ms/token min / median: {times}; fp32 / int8 (median) eager x{t['fp32'][1] / t['int8'][1]:.2f}, "
              f"compiled x{t['fp32 compiled'][1] / t['int8 compiled'][1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
