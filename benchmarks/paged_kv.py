"""Paged KV against the contiguous cache, side by side in one run: ``n`` samples of one prompt.

One row prefills a ``--prompt``-token prompt (chunks of 512), the cache is selected ``--samples`` times (what
``num_return_sequences`` and beam expansion do), and every sample decodes ``--steps`` tokens of its own. Printed
per stack and layout: the attention cache bytes after decoding (``nbytes_by_kind``), and decode ms per step for
all samples (``--warmup`` untimed steps, then min / median of the timed ones), with the ratio paged / contiguous.
The paged layout here runs its reference path on CPU: each step gathers every row's pages for SDPA.

    python benchmarks/paged_kv.py [--prompt 2048] [--samples 8] [--page-size 16] [--steps 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import hybridlm
from hybridlm.decoding.bench import Timing
from hybridlm.presets import preset

STACKS = {
    "all-attention": dict(layer_pattern="AAAA"),
    "jamba-small (1:7)": None,
}


def build(name: str) -> hybridlm.HybridForCausalLM:
    torch.manual_seed(0)
    if STACKS[name] is None:
        return hybridlm.HybridForCausalLM(preset("jamba-small")).eval()
    config = hybridlm.HybridConfig(vocab_size=1024, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=512, **STACKS[name])
    return hybridlm.HybridForCausalLM(config).eval()


def run(model, policy, args) -> tuple[int, Timing]:
    ids = torch.randint(1, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    tails = torch.randint(1, model.config.vocab_size, (args.samples, args.warmup + args.steps),
                          generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(1, policy=policy)
    seconds = []
    with torch.no_grad():
        for start in range(0, args.prompt, 512):
            model(ids[:, start:start + 512], cache=cache)
        cache = cache.select(torch.zeros(args.samples, dtype=torch.long))
        for step in range(args.warmup + args.steps):
            begin = time.perf_counter()
            model(tails[:, step:step + 1], cache=cache)
            if step >= args.warmup:
                seconds.append(time.perf_counter() - begin)
    return cache.nbytes_by_kind()["attention"], Timing.of(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.samples} samples of a {args.prompt}-token prompt, page size {args.page_size}, "
          f"{args.threads} thread(s); decode ms per step (all samples): min / median")
    print(f"{'stack':<20} {'layout':<11} {'attention KV bytes':>19} {'decode ms':>15} {'paged/contig':>13}")
    for name in STACKS:
        model = build(name)
        results = {}
        for layout, policy in [("contiguous", None), ("paged", hybridlm.CachePolicy(page_size=args.page_size))]:
            results[layout] = run(model, policy, args)
        for layout, (nbytes, timing) in results.items():
            ratio = timing.median_ms / results["contiguous"][1].median_ms
            print(f"{name:<20} {layout:<11} {nbytes:>19,} {format(timing, '.1f'):>15} {ratio:>12.2f}x")


if __name__ == "__main__":
    main()
