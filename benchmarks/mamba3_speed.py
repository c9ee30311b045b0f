"""Mamba-3 against Mamba-2 on the CPU at the same width and half the state size (the paper's comparison).

``mamba2-small`` (8 Mamba-2 layers, hidden 256, d_state 64) and ``mamba3-small`` (8 Mamba-3 layers, hidden 256,
d_state 32, SISO, rope fraction 0.5), random weights, batch 1:

* chunked forward (the parallel form, no gradient) over ``--lengths`` tokens (2048 and 8192);
* decode ms/token after a short prompt: :class:`hybridlm.decoding.decode_step.DecodeStep` eager and through
``torch.compile``
  (a static cache), as ``benchmarks/decode_speed.py`` times it.

The two models take turns call by call after a warm-up (the compile happens there), so machine load affects both
alike; it prints min and median and the ratio Mamba-2 / Mamba-3 (> 1: Mamba-3 is faster).

    python benchmarks/mamba3_speed.py [--lengths 2048 8192] [--repeats 3] [--steps 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from hybridlm import HybridForCausalLM  # noqa: E402
from hybridlm.decoding.decode_step import DecodeStep  # noqa: E402
from hybridlm.decoding.incremental import STATIC_CAPACITY_STEP  # noqa: E402
from hybridlm.presets import preset  # noqa: E402

MODELS = {"mamba2": "mamba2-small", "mamba3": "mamba3-small"}


def _once(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def alternate(runs: dict, warmup: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Each run called in turn, ``warmup`` untimed rounds then ``repeats`` timed: ``{name: (min, median)}`` ms."""
    times = {name: [] for name in runs}
    for index in range(warmup + repeats):
        for name, run in runs.items():
            elapsed = _once(run)
            if index >= warmup:
                times[name].append(1000 * elapsed)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def row(label: str, result: dict) -> None:
    (low2, mid2), (low3, mid3) = result["mamba2"], result["mamba3"]
    print(f"{label:28s} mamba2 {low2:9.2f} / {mid2:9.2f}   mamba3 {low3:9.2f} / {mid3:9.2f}   "
          f"mamba2 / mamba3: x{low2 / low3:.2f} min, x{mid2 / mid3:.2f} median", flush=True)


def decode_runs(models: dict, prompt: torch.Tensor, steps: int, compiled: bool) -> dict:
    runs = {}
    for name, model in models.items():
        capacity = -(-(prompt.shape[1] + steps) // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP
        cache = model.new_cache(1, max_length=capacity, static=compiled)
        model(prompt, cache=cache, logits_to_keep=1)
        step, token = DecodeStep(model, compile=compiled), prompt[:, -1]

        def run(step=step, cache=cache, token=[token]):  # noqa: B006  (the token carried between calls)
            token[0] = step(token[0], cache).argmax(-1)

        runs[name] = run
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {name: HybridForCausalLM(preset(p)).eval() for name, p in MODELS.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; parameters: "
          + ", ".join(f"{n} {sum(p.numel() for p in m.parameters()) / 1e6:.2f} M" for n, m in models.items())
          + "; ms, min / median", flush=True)
    with torch.inference_mode():
        for length in args.lengths:
            ids = torch.randint(1, 4096, (1, length), generator=torch.Generator().manual_seed(length))
            runs = {name: (lambda m=m, ids=ids: m(ids, logits_to_keep=1)) for name, m in models.items()}
            row(f"forward {length} tokens", alternate(runs, 1, args.repeats))
        prompt = torch.randint(1, 4096, (1, 64), generator=torch.Generator().manual_seed(1))
        for compiled in (False, True):
            label = "decode ms/token " + ("compiled" if compiled else "eager")
            row(label, alternate(decode_runs(models, prompt, args.steps + 8, compiled), 8, args.steps))


if __name__ == "__main__":
    main()
