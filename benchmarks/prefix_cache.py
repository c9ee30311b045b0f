"""Time to first token with and without a prefix-cache hit, side by side in one run.

A Jamba-shaped hybrid (the ``jamba-small`` preset: hidden 256, 8 layers, Mamba-1 with one attention layer, MoE
every other layer; random weights) answers requests made of one shared ``--system``-token system prompt (4096)
and a fresh ``--question``-token question (64). Time to first token is the prefill of the whole request plus the
choice of the first token (``next(decoder.stream(...))``), measured three ways:

* no prefix cache: a plain :class:`~hybridlm.decoding.incremental.IncrementalDecoder`, and the same with prefill chunks
  no longer than a block (the cuts a prefix-caching decoder makes; its cost apart from the snapshots);
* cold: a decoder with an empty :class:`~hybridlm.PrefixCache` (the miss, plus snapshotting every block);
* hit: the system prompt's blocks are cached, so only the question (and the part of the prompt past the last
  whole block) is prefilled.

Every mode runs ``--warmup`` untimed requests, then ``--repeats`` timed ones; it prints min and median and the
ratios to the hit. The modes take turns request by request, so that a change in machine load affects all alike.

    python benchmarks/prefix_cache.py [--system 4096] [--question 64] [--block-size 256] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import hybridlm
from hybridlm.decoding.bench import Timing
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.presets import preset


def first_token_seconds(decoder: IncrementalDecoder, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    next(decoder.stream(ids, max_new_tokens=1))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="jamba-small")
    parser.add_argument("--system", type=int, default=4096, help="tokens of the shared system prompt")
    parser.add_argument("--question", type=int, default=64, help="tokens of each request's own question")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=512, help="prefill_chunk_size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = hybridlm.HybridForCausalLM(preset(args.preset)).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(1, vocab, (1, args.system), generator=generator)

    def request() -> torch.Tensor:
        return torch.cat([system, torch.randint(1, vocab, (1, args.question), generator=generator)], dim=1)

    plain = IncrementalDecoder(model, prefill_chunk_size=args.chunk)
    plain_blocks = IncrementalDecoder(model, prefill_chunk_size=min(args.chunk, args.block_size))
    shared = hybridlm.PrefixCache(block_size=args.block_size)
    warm = IncrementalDecoder(model, prefill_chunk_size=args.chunk, prefix_cache=shared)
    modes = {
        "no prefix cache": lambda ids: first_token_seconds(plain, ids),
        "no cache, block chunks": lambda ids: first_token_seconds(plain_blocks, ids),
        "cold (empty cache)": lambda ids: first_token_seconds(IncrementalDecoder(
            model, prefill_chunk_size=args.chunk, prefix_cache=hybridlm.PrefixCache(block_size=args.block_size)), ids),
        "hit": lambda ids: first_token_seconds(warm, ids),
    }
    first_token_seconds(warm, request())  # an earlier request put the system prompt's blocks in the cache
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    for repeat in range(args.warmup + args.repeats):
        ids = request()
        for name, run in modes.items():
            taken = run(ids)
            if repeat >= args.warmup:
                seconds[name].append(taken)
    assert warm.stats["prefix_hit_tokens"] == args.system // args.block_size * args.block_size

    print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{args.system}-token system prompt + {args.question}-token question, block {args.block_size}, "
          f"prefill chunk {args.chunk}, {args.threads} thread(s), {args.repeats} repeats after {args.warmup} warm-up")
    print(f"hit: {warm.stats['prefix_hit_tokens']} tokens restored, {warm.stats['prefill_tokens']} prefilled; "
          f"the cache holds {len(shared)} snapshots, {shared.nbytes / 2**20:.1f} MiB")
    timings = {name: Timing.of(values) for name, values in seconds.items()}
    print(f"{'time to first token (ms)':<26}{'min / median':>24}")
    for name, timing in timings.items():
        print(f"{name:<26}{timing:>24.1f}")
    hit = timings["hit"]
    for name in ("no prefix cache", "no cache, block chunks", "cold (empty cache)"):
        cold = timings[name]
        print(f"{name} / hit: {cold.min_ms / hit.min_ms:.1f}x (min), {cold.median_ms / hit.median_ms:.1f}x (median)")


if __name__ == "__main__":
    main()
