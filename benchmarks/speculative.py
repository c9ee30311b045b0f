"""Speculative decoding on the bundled models: acceptance rate and decode time against plain decoding, side by side.

The target is a bundled model (``--target hybrid``, the default: ``hybrid-tiny``, Mamba-2 with attention every
fourth layer, trained on the Python standard library; or ``--target attention``, its all-attention twin); the
drafters are the other bundled model (same tokenizer and size: it shows the acceptance rate, not a speed-up, since
drafting costs as much as verifying) and prompt lookup. Prompts are the first
``--prompt`` tokens of held-out standard-library files (code repeats itself: prompt lookup has something to find).

Each mode generates ``--new`` tokens greedily from every prompt, ``--warmup`` untimed runs then ``--repeats`` timed
ones, modes taking turns so that machine load affects all alike; it prints min and median per prompt, each mode's
ratio to plain decoding, and the acceptance rates (greedy, and sampling at temperature 1 for the draft model).
Both routes: hybridlm's ``IncrementalDecoder(speculative=...)`` and transformers' ``generate(assistant_model=...)``
/ ``generate(prompt_lookup_num_tokens=...)``; greedy outputs are checked equal to plain greedy decoding.

    python benchmarks/speculative.py [--prompt 256] [--new 96] [--k 4] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch

from hybridlm import SpeculativeDecoding
from hybridlm.bundled import load_bundled
from hybridlm.decoding.bench import Timing
from hybridlm.decoding.incremental import IncrementalDecoder

FILES = ("textwrap.py", "csv.py", "statistics.py")  # held out of the bundled models' training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--new", type=int, default=96, help="new tokens")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--ngram", type=int, default=3, help="prompt lookup's longest n-gram")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", choices=("hybrid", "attention"), default="hybrid",
                        help="the bundled model verified against; the other one drafts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    other = {"hybrid": "attention", "attention": "hybrid"}[args.target]
    target, tokenizer = load_bundled(args.target)
    draft, _ = load_bundled(other)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = [tokenizer((stdlib / name).read_text())["input_ids"][: args.prompt] for name in FILES]
    by_draft = SpeculativeDecoding(draft_model=draft, num_draft_tokens=args.k)
    by_lookup = SpeculativeDecoding(prompt_lookup=args.ngram, num_draft_tokens=args.k)
    decoders = {"decoder: plain": IncrementalDecoder(target),
                "decoder: draft model": IncrementalDecoder(target, speculative=by_draft),
                "decoder: prompt lookup": IncrementalDecoder(target, speculative=by_lookup)}
    hf = {"transformers: plain": {}, "transformers: assistant_model": {"assistant_model": draft},
          "transformers: prompt lookup": {"prompt_lookup_num_tokens": args.k}}

    def run(name: str, ids: list[int]) -> torch.Tensor:
        if name in decoders:
            return decoders[name].generate([ids], max_new_tokens=args.new)
        return target.generate(torch.tensor([ids]), max_new_tokens=args.new, min_new_tokens=args.new,
                               do_sample=False, **hf[name])

    modes = [*decoders, *hf]
    seconds: dict[tuple[str, int], list[float]] = {}
    rates: dict[tuple[str, int], str] = {}
    for index, ids in enumerate(prompts):
        reference = {route: run(f"{route}: plain", ids)[0, -args.new:] for route in ("decoder", "transformers")}
        for repeat in range(args.warmup + args.repeats):
            for name in modes:
                start = time.perf_counter()
                out = run(name, ids)
                taken = time.perf_counter() - start
                assert torch.equal(out[0, -args.new:], reference[name.split(":")[0]]), f"{name}: not greedy's output"
                if repeat >= args.warmup:
                    seconds.setdefault((name, index), []).append(taken)
                if name in decoders and name != "decoder: plain":
                    stats = decoders[name].stats
                    rates[name, index] = (f"acceptance {stats['acceptance_rate']:.2f}, "
                                          f"{args.new / (stats['target_forwards'] + 1):.2f} tokens per target forward")
        sampler = decoders["decoder: draft model"]
        sampler.generate([ids], max_new_tokens=args.new, do_sample=True, seed=0)
        rates["sampling, draft model", index] = f"acceptance {sampler.stats['acceptance_rate']:.2f}"

    print(f"target {args.target}-tiny, draft {other}-tiny / prompt lookup (n <= {args.ngram}); "
          f"{args.prompt}-token prompts, {args.new} new tokens, k = {args.k}, {args.threads} thread(s), "
          f"{args.repeats} repeats after {args.warmup} warm-up; greedy outputs equal plain greedy decoding")
    for index, name in enumerate(FILES):
        print(f"\nprompt: {name}")
        plain = {route: Timing.of(seconds[f"{route}: plain", index]) for route in ("decoder", "transformers")}
        print(f"{'mode':<32}{'ms min / median':>22}{'plain / this (min)':>20}")
        for mode in modes:
            timing = Timing.of(seconds[mode, index])
            base = plain[mode.split(":")[0]]
            print(f"{mode:<32}{timing:>22.0f}{base.min_ms / timing.min_ms:>19.2f}x  {rates.get((mode, index), '')}")
        print(f"{'sampling, draft model':<32}{'':>42}  {rates['sampling, draft model', index]}")


if __name__ == "__main__":
    main()
