"""What keeping rollback checkpoints costs, side by side in one run, on the small presets.

Per stack, after a ``--prompt``-token prefill: (1) a verification forward of ``--block`` tokens on the warm cache,
which keeps the state after each token (the default), then a crop back, against the same forward with
checkpoints paused (taken back by a restore); (2) a one-token decode step with ``cache.keep_checkpoints(64)``
(what a draft model runs with) then a crop back, against a plain step. Only the forwards are timed: ``--warmup``
untimed rounds, then min / median of ``--repeats`` (ms; the two sides alternate round by round), the ratio of
medians, and the bytes ``reserved_nbytes`` counts for the checkpoints.

    python benchmarks/rollback.py [--prompt 256] [--block 8] [--repeats 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import hybridlm
from hybridlm.cache import RecurrentState, StateGroup, rollback
from hybridlm.decoding.bench import Timing
from hybridlm.presets import preset

STACKS = ("jamba-small", "mamba2-small", "bamba-small")


def recurrent(cache) -> list[RecurrentState]:
    parts = [p for s in cache.states for p in (s.parts.values() if isinstance(s, StateGroup) else [s])]
    return [p for p in parts if isinstance(p, RecurrentState)]


def variant(cache, *, paused: bool = False, keep: int = 0, crop: bool = True) -> tuple:
    """A cache of its own for one side of a comparison, and how to take it back after each timed forward: a
    crop (what speculative decoding does, so kept buffers are reused) or a restore of the starting point."""
    start = cache.snapshot()
    for state in recurrent(start):
        state.paused = paused
    start.keep_checkpoints(keep)
    own = start.snapshot()
    return own, (lambda tokens: own.crop(-tokens)) if crop else (lambda tokens: own.restore(start))


def timed_pair(model, ids, sides, args) -> tuple[Timing, Timing]:
    """``ids`` forwarded through each side's cache, taken back after each run; the two sides alternate, so
    that both see the same load on a shared machine."""
    seconds = ([], [])
    with torch.no_grad():
        for repeat in range(args.warmup + args.repeats):
            for which, (cache, back) in enumerate(sides):
                begin = time.perf_counter()
                model(ids, cache=cache)
                if repeat >= args.warmup:
                    seconds[which].append(time.perf_counter() - begin)
                back(ids.shape[1])
    return Timing.of(seconds[0]), Timing.of(seconds[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"prompt {args.prompt}, block {args.block}, {args.threads} thread(s); ms min / median, batch 1")
    print(f"{'stack':<14} {'forward':<22} {'without':>13} {'with':>13} {'ratio':>7} {'checkpoint bytes':>17}")
    for name in STACKS:
        torch.manual_seed(0)
        model = hybridlm.HybridForCausalLM(preset(name)).eval()
        vocab = model.config.vocab_size
        ids = torch.randint(1, vocab, (1, args.prompt + args.block + 1), generator=torch.Generator().manual_seed(1))
        cache = model.new_cache(1)
        with torch.no_grad():
            model(ids[:, : args.prompt], cache=cache)
        block, step = ids[:, args.prompt : args.prompt + args.block], ids[:, -1:]
        rows = [(f"verify {args.block} tokens", block, 0), ("decode 1 token", step, rollback.AUTO_CHECKPOINT_TOKENS)]
        for label, tokens, keep in rows:
            plain = variant(cache, paused=True, crop=False)
            kept = variant(cache, keep=keep)
            without, with_ = timed_pair(model, tokens, [plain, kept], args)
            nbytes = kept[0].reserved_nbytes() - kept[0].nbytes()
            ratio = with_.median_ms / without.median_ms
            print(f"{name:<14} {label:<22} {format(without, '.2f'):>13} {format(with_, '.2f'):>13} "
                  f"{ratio:>6.2f}x {nbytes:>17,}")


if __name__ == "__main__":
    main()
