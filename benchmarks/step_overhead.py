"""What skipping dynamo saves a compiled decode step: a trusted layout's step run through dynamo with its guards
skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, what ``DecodeStep`` did before) against
dynamo's code for it called directly (``hybridlm.decoding.decode_step.guarded_code``, what it does now).

One compiled step of the bundled hybrid, batch 1, after a 256-token prompt; the two ways take turns in blocks of
8 steps on the same step and cache (rewound to the prompt when it fills), after 3 warm-up steps; it prints min
and median ms per step and the ratios.

    python benchmarks/step_overhead.py [--threads 1] [--capacity 512] [--blocks 360]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hybridlm  # noqa: E402
from hybridlm.decoding.decode_step import DecodeStep  # noqa: E402

PROMPT, BLOCK = 256, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=512, help="static cache slots (a step attends over all)")
    parser.add_argument("--blocks", type=int, default=360)
    args = parser.parse_args()
    if args.capacity < PROMPT + 4 + BLOCK:
        parser.error(f"--capacity must hold the {PROMPT}-token prompt and a block of steps")
    torch.set_num_threads(args.threads)
    model = hybridlm.HybridForCausalLM.from_pretrained(hybridlm.bundled_model_dir("hybrid")).eval()
    ids = torch.randint(5, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model.new_cache(1, max_length=args.capacity, static=True)
        token = model(ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
        prompt = cache.snapshot()
        step = DecodeStep(model, compile=True)
        for _ in range(3):  # compiles, then trusts the layout
            step(token, cache)
        (layout, direct), = step._direct.items()

        def through_dynamo(*inputs):
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return step._logits(*inputs)

        ways = {"through dynamo": through_dynamo, "direct": direct}
        times = {name: [] for name in ways}
        for block in range(args.blocks):
            name = list(ways)[block % 2]
            step._direct[layout] = ways[name]
            step._last = (layout, ways[name])  # the step reads its last layout's code before the lookup
            if cache.seen + BLOCK > args.capacity:
                cache.restore(prompt)
            for _ in range(BLOCK):
                start = time.perf_counter()
                token = step(token, cache).argmax(-1)
                times[name].append(1e3 * (time.perf_counter() - start))
    print(f"torch {torch.__version__}, {args.threads} thread(s), capacity {args.capacity}, "
          f"{args.blocks // 2} blocks of {BLOCK} steps each way")
    for name, values in times.items():
        print(f"  {name:15s} ms/step min {min(values):.3f}  median {statistics.median(values):.3f}")
    before, now = times["through dynamo"], times["direct"]
    print(f"  through dynamo / direct: min x{min(before) / min(now):.2f}, "
          f"median x{statistics.median(before) / statistics.median(now):.2f}")


if __name__ == "__main__":
    main()
