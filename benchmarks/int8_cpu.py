"""Int8 linears (``hybridlm.model.quantize_weights``, torchao) against fp32 on the CPU, on the same weights:
quality (held-out next-token KL and greedy agreement) and decode speed, eager and compiled, with int8 weights on
the fp32 model (``int8``) and on the bf16 model (``int8 bf16``: compiled, the codes meet bf16 inputs in inductor's
weight-only GEMM; on the fp32 model inductor folds them back into fp32 weights).

For each model (the bundled ``hybrid``, hybrid-tiny; ``smollm2``, SmolLM2-135M-Instruct once ``real_model.py
fetch`` has run) it loads the fp32 model, and once per scheme the model in the scheme's dtype, quantized, then

* over ``--tokens`` held-out tokens, the mean next-token KL(fp32 || scheme) in nats and the share of positions
  where the two pick the same next token; the greedy continuation of the first 64 for ``--new-tokens`` tokens:
  how many leading tokens agree;
* decode ms/token after a ``--context``-token prefill: fp32 and each scheme, eager and compiled (static cache, with
  ``--compiled-only`` compiled alone), all taking turns step by step (so machine load affects them alike), min and
  median, and the ratios fp32 / scheme (> 1: the scheme is faster);
* the linear weights' bytes, fp32 against int8 (codes and scales).

    python benchmarks/int8_cpu.py [--models hybrid smollm2] [--threads 1] [--context 256] [--compiled-only]
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


#: scheme label -> the dtype of the model whose linears get int8 weights
SCHEMES = {"int8": torch.float32, "int8 bf16": torch.bfloat16}


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], compiled_only=True)
    warnings.filterwarnings("ignore", module="torch")  # torchao's notes on tensor subclasses under compile
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, context {args.context}, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    from transformers import AutoTokenizer

    for name in args.models:
        directory = directory_of(name)
        models = {"fp32": hybridlm.HybridForCausalLM.from_pretrained(directory).eval()}
        for label, dtype in SCHEMES.items():
            models[label] = quantize_weights(hybridlm.HybridForCausalLM.from_pretrained(directory, dtype=dtype).eval())
        tokenizer = AutoTokenizer.from_pretrained(directory)
        ids = torch.tensor([held_out_code(tokenizer, max(args.tokens, args.context))])
        for label in SCHEMES:
            q = quality(models, ids[:, :args.tokens], args.new_tokens, "fp32", label)
            print(f"{name} {label}: KL(fp32 || {label}) {q['kl']:.2e} nats/token over {args.tokens} held-out tokens, "
                  f"same next token {100 * q['top1']:.1f}%, greedy {q['greedy_prefix']}/{args.new_tokens} tokens "
                  f"identical; linear weights {linear_bytes(models['fp32']) / 2**20:.1f} MiB fp32, "
                  f"{linear_bytes(models[label]) / 2**20:.1f} MiB {label}", flush=True)
        timed = {f"{label} compiled": model for label, model in models.items()}
        if not args.compiled_only:
            timed = models | timed
        t = decode_times(timed, ids[:, :args.context], args.warmup, args.steps,
                         compiled=tuple(label for label in timed if label.endswith("compiled")))
        times = ", ".join(f"{label} {low:.2f} / {median:.2f}" for label, (low, median) in t.items())
        ratios = ", ".join(f"{label}{kind} x{t[f'fp32{kind}'][1] / t[f'{label}{kind}'][1]:.2f}"
                           for kind in ("", " compiled") for label in SCHEMES if f"fp32{kind}" in t)
        print(f"{name}: decode ms/token min / median: {times}; fp32 / scheme (medians): {ratios}", flush=True)


if __name__ == "__main__":
    main()
