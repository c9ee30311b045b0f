"""bf16 products on a CPU without bf16 products of its own (``hybridlm.layers.linear.Linear``): torch's own bf16
product against the fp32 copy that ``Linear`` makes from ``MIN_FP32_ROWS`` rows, our kernel
(``hybridlm.ops.cpu_kernels.linear_rows``, which ``Linear`` calls first up to ``cpu_linear.MAX_ROWS`` rows; it is
off for the other variants), and fp32 weights as the reference; then SmolLM2-135M's eager prefill in bf16 with
the rule on and off, in fp32, and with int8 weight-only codes on the bf16 model (``quantize_weights``, torchao)
with the rule on (dequantized to fp32) and off (torchao's own product, in bf16).

Every variant takes turns call by call after a warm-up call; the script prints min / median and the medians'
ratios (torch's bf16 product over the fp32 copy: > 1, the copy is faster).

    python benchmarks/cpu_linear.py [--rows 1 2 3 4 16 256] [--prefill 256 2048] [--threads 1] [--calls 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hybridlm  # noqa: E402
from hybridlm.layers import linear  # noqa: E402
from hybridlm.ops import cpu_kernels, cpu_linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import held_out_code, require_model  # noqa: E402

#: SmolLM2-135M's products: (out, in) of the MLP's up and down projections and the query projection
SHAPES = [(1536, 576), (576, 1536), (576, 576)]
RULE_OFF = frozenset()


def interleaved(calls: dict, rounds: int) -> dict:
    """label -> (min, median) seconds, the calls taking turns (order reversed every other round) after one
    warm-up round. A call is ``(rule, fn)``: the rule's dtypes are set before it runs."""
    times = {label: [] for label in calls}
    for round_ in range(rounds + 1):
        for label in (list(calls) if round_ % 2 == 0 else list(reversed(calls))):
            rule, fn = calls[label]
            linear.DTYPES_WITHOUT_CPU_PRODUCTS = rule
            start = time.perf_counter()
            fn()
            if round_:
                times[label].append(time.perf_counter() - start)
    return {label: (min(t), statistics.median(t)) for label, t in times.items()}


def report(head: str, times: dict, unit: float, name: str) -> None:
    base = times["bf16, fp32 copy"][1]
    ratios = f"torch bf16 / fp32 copy x{times['bf16, torch'][1] / base:.2f}, fp32 weights / fp32 copy " \
             f"x{times['fp32 weights'][1] / base:.2f}"
    if "bf16, kernel" in times:
        ratios += f", kernel / fp32 copy x{times['bf16, kernel'][1] / base:.2f}"
    if "int8, torchao" in times:
        int8 = times["int8, torchao"][1] / times["int8, fp32 dequantized"][1]
        ratios += f", int8 torchao / int8 dequantized x{int8:.2f}"
    print(f"{head}: " + ", ".join(f"{label} {t[0] * unit:.2f} / {t[1] * unit:.2f}" for label, t in times.items())
          + f" {name} min / median; {ratios}", flush=True)


def fp32_copy(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float()).to(x.dtype)


@torch.inference_mode()
def products(rows: list[int], calls: int, with_kernel: bool) -> None:
    rule_on = frozenset({torch.bfloat16})
    for out_features, in_features in SHAPES:
        layer = linear.Linear(in_features, out_features, bias=False)
        bf16, fp32 = layer.to(torch.bfloat16), linear.Linear(in_features, out_features, bias=False)
        fp32.weight.copy_(bf16.weight.float())
        for n in rows:
            x = torch.randn(n, in_features)
            xb = x.bfloat16()
            variants = {"bf16, torch": (RULE_OFF, partial(bf16, xb)), "bf16, fp32 copy": (rule_on, partial(bf16, xb)),
                        "fp32 weights": (RULE_OFF, partial(fp32, x))}
            if with_kernel and n <= cpu_linear.MAX_ROWS:
                variants["bf16, kernel"] = (RULE_OFF, partial(cpu_kernels.linear_rows, xb, bf16.weight))
            if n < linear.MIN_FP32_ROWS:  # below the rule's rows, the copy is forced for the comparison
                variants["bf16, fp32 copy"] = (RULE_OFF, partial(fp32_copy, bf16.weight, xb))
            report(f"{out_features} x {in_features} at {n} rows", interleaved(variants, calls), 1e6, "us")


@torch.inference_mode()
def prefill(lengths: list[int], calls: int) -> None:
    _, directory = require_model()
    models = {dtype: hybridlm.HybridForCausalLM.from_pretrained(directory, dtype=dtype).eval()
              for dtype in (torch.bfloat16, torch.float32)}
    models["int8"] = hybridlm.model.quantize_weights(
        hybridlm.HybridForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval())
    from transformers import AutoTokenizer

    ids = held_out_code(AutoTokenizer.from_pretrained(directory), max(lengths))
    rule_on = frozenset({torch.bfloat16})
    for length in lengths:
        x = torch.tensor([ids[:length]])

        bf16, fp32, int8 = (partial(models[key], x, logits_to_keep=1)
                            for key in (torch.bfloat16, torch.float32, "int8"))
        variants = {"bf16, torch": (RULE_OFF, bf16), "bf16, fp32 copy": (rule_on, bf16),
                    "fp32 weights": (RULE_OFF, fp32), "int8, torchao": (RULE_OFF, int8),
                    "int8, fp32 dequantized": (rule_on, int8)}
        report(f"SmolLM2-135M prefill {length}", interleaved(variants, calls), 1.0, "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 16, 256])
    parser.add_argument("--prefill", nargs="*", type=int, default=[256, 2048], help="SmolLM2 prefill lengths "
                        "(none: products only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; bf16 without CPU products here: "
          f"{torch.bfloat16 in linear.DTYPES_WITHOUT_CPU_PRODUCTS}", flush=True)
    with_kernel, cpu_linear.SERVES_THIS_CPU = cpu_linear.SERVES_THIS_CPU, False  # Linear's torch paths only
    products(args.rows, args.calls, with_kernel)
    if args.prefill:
        prefill(args.prefill, max(3, args.calls // 3))


if __name__ == "__main__":
    main()
