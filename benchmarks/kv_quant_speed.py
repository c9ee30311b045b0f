"""Decode with quantized KV (KIVI) against the full-precision cache, side by side in one run.

For each stack and context: decode ms per token (``--warmup`` untimed rounds, then min / median of ``--steps``;
the policies take turns step by step) with the fp cache, with 8/4/2-bit KV read from the codes (the default
decode path), and with 4-bit KV through the reference path (dequantize the whole history every step, then
SDPA), each with its ratio to fp. The caches are filled through each layout's own update
(``hybridlm.decoding.bench.fill_cache``), so a quantized cache holds what it would after ``context`` tokens: all but the
last ``kv_residual`` (up to + group) as codes.

    python benchmarks/kv_quant_speed.py [--context 2048 8192] [--steps 15] [--warmup 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import hybridlm
from hybridlm.cache.kv import QuantizedKV
from hybridlm.decoding.bench import Timing, fill_cache
from hybridlm.presets import preset

STACKS = ("attention-small", "jamba-small")
#: label -> (policy, read from the codes)
POLICIES = {
    "fp32": (None, True),
    "8-bit": (hybridlm.CachePolicy(kv_bits=8), True),
    "4-bit": (hybridlm.CachePolicy(kv_bits=4), True),
    "2-bit": (hybridlm.CachePolicy(kv_bits=2), True),
    "4-bit, reference (dequantize)": (hybridlm.CachePolicy(kv_bits=4), False),
}


@torch.no_grad()
def interleaved_timings(model, context: int, steps: int, warmup: int) -> dict[str, Timing]:
    """One decode step per policy in turn, ``warmup + steps`` rounds, so that load on the machine falls on all
    policies alike; each policy's own cache, filled to ``context`` tokens."""
    caches = {}
    for label, (policy, _) in POLICIES.items():
        caches[label] = model.new_cache(1, max_length=context + warmup + steps + 1, policy=policy)
        fill_cache(caches[label], context, torch.Generator().manual_seed(0))
    token = torch.zeros(1, 1, dtype=torch.long)
    seconds = {label: [] for label in POLICIES}
    try:
        for round_ in range(warmup + steps):
            for label, (_, fused) in POLICIES.items():
                QuantizedKV.fused_decode = fused
                start = time.perf_counter()
                model(token, cache=caches[label])
                if round_ >= warmup:
                    seconds[label].append(time.perf_counter() - start)
    finally:
        QuantizedKV.fused_decode = True
    return {label: Timing.of(values) for label, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); decode ms/token as min / median "
          f"({args.warmup} warm-up, {args.steps} timed, policies interleaved); ratio = this policy / fp32")
    print(f"{'stack':16} {'context':>7}  {'KV':30} {'ms/token':>13}  {'ratio (min / median)':>20}")
    for stack in STACKS:
        torch.manual_seed(0)
        model = hybridlm.HybridForCausalLM(preset(stack)).eval()
        for context in args.context:
            timings = interleaved_timings(model, context, args.steps, args.warmup)
            base = timings["fp32"]
            for label, timing in timings.items():
                ratio = f"{timing.min_ms / base.min_ms:.2f} / {timing.median_ms / base.median_ms:.2f}"
                print(f"{stack:16} {context:7}  {label:30} {format(timing, '.1f'):>13}  {ratio:>20}", flush=True)


if __name__ == "__main__":
    main()
