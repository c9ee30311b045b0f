"""Decode ms/token at long context: hybridlm eager, hybridlm compiled, and transformers, on the same weights.

For the Jamba-, Mamba-2- and Bamba-shaped models of ``hf_speed.py`` (hidden 256, 8 layers; built by transformers
with a fixed seed, loaded by hybridlm from the directory transformers wrote) and each batch size, it prefills a
``--context``-token prompt (4096), then times single-token decode steps:

* ``transformers``: ``model(token, cache=..., use_cache=True)``, as its ``generate`` does;
* ``eager``: :class:`hybridlm.decoding.decode_step.DecodeStep` on the cache ``IncrementalDecoder`` makes (no host sync);
* ``compiled``: the same step through ``torch.compile`` on a static cache (``IncrementalDecoder(compile=True)``).

The three take turns step by step (so machine load affects all alike) after ``--warmup`` steps each (the compile
happens there); it prints min and median ms per token and the ratios transformers / hybridlm (> 1: hybridlm is
faster), and checks that the three agree on the first step's logits. A batch of B rows is the one-row prompt's
cache repeated B times (a batch-16 prefill of 4096 tokens takes transformers' CPU path about five minutes; the
decode cost does not depend on what the rows hold).

    python benchmarks/decode_speed.py [--models jamba mamba2 bamba] [--batch 1 16] [--context 4096] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hybridlm  # noqa: E402
from hybridlm.decoding.decode_step import DecodeStep  # noqa: E402
from hybridlm.decoding.incremental import STATIC_CAPACITY_STEP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_speed import MODELS, VOCAB  # noqa: E402


def repeat_transformers_cache(cache, repeats: int) -> None:
    """Every row of a transformers cache repeated ``repeats`` times, in place (key/value, conv and recurrent
    states alike: ``Cache.batch_repeat_interleave`` skips the linear-attention layers' states)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                setattr(layer, name, tensor.repeat_interleave(repeats, dim=0))
        for name in ("conv_states", "recurrent_states"):
            for key, tensor in (getattr(layer, name, None) or {}).items():
                if tensor is not None:
                    getattr(layer, name)[key] = tensor.repeat_interleave(repeats, dim=0)


class Timed:
    """One decoder: ``step()`` runs and times one token, feeding back its greedy choice."""

    def __init__(self, run, token: torch.Tensor):
        self.run, self.token, self.times, self.first = run, token, [], None

    def step(self, record: bool) -> None:
        start = time.perf_counter()
        logits = self.run(self.token)  # [batch, vocab]
        elapsed = time.perf_counter() - start
        if self.first is None:
            self.first = logits.clone()
        if record:
            self.times.append(elapsed)
        self.token = logits.argmax(-1)


def decoders(theirs, ours, prompt: torch.Tensor, batch: int, steps: int) -> dict[str, Timed]:
    """The three decoders, each continuing the same prompt repeated ``batch`` times."""
    rows = torch.zeros(batch, dtype=torch.long)
    out = theirs(prompt, use_cache=True, logits_to_keep=1)
    their_cache = out.cache
    repeat_transformers_cache(their_cache, batch)
    first = out.logits[:, -1].argmax(-1).repeat(batch)

    def transformers_step(token):
        return theirs(token[:, None], cache=their_cache, use_cache=True).logits[:, -1]

    capacity = -(-(prompt.shape[1] + steps) // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP
    made = {}
    for label, static in (("eager", False), ("compiled", True)):
        cache = ours.new_cache(1, max_length=prompt.shape[1] + steps if not static else capacity, static=static)
        ours(prompt, cache=cache, logits_to_keep=1)
        made[label] = (cache.select(rows), DecodeStep(ours, compile=static))
    result = {"transformers": Timed(transformers_step, first)}
    for label, (cache, step) in made.items():
        result[label] = Timed(lambda token, cache=cache, step=step: step(token, cache), first)
    return result


def measure(name: str, batch: int, context: int, warmup: int, steps: int) -> dict:
    torch.manual_seed(0)
    theirs = MODELS[name]().eval()
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        ours = hybridlm.HybridForCausalLM.from_pretrained(directory).eval()
    prompt = torch.randint(1, VOCAB, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        runs = decoders(theirs, ours, prompt, batch, warmup + steps)
        for index in range(warmup + steps):
            for run in runs.values():
                run.step(record=index >= warmup)
    reference = runs["transformers"].first
    assert bool(reference.abs().max() > 0)
    diffs = {label: float((run.first - reference).abs().max()) for label, run in runs.items() if run.first is not None}
    times = {label: (1000 * min(run.times), 1000 * statistics.median(run.times)) for label, run in runs.items()}
    return {"model": name, "batch": batch, "times": times, "diffs": diffs}


def report(row: dict) -> None:
    t = row["times"]
    hf_median = t["transformers"][1]
    cells = "  ".join(f"{label} {low:7.2f} / {mid:7.2f}" for label, (low, mid) in t.items())
    ratios = "  ".join(f"x{hf_median / t[label][1]:.2f} {label}" for label in ("eager", "compiled"))
    diffs = ", ".join(f"{label} {row['diffs'][label]:.1e}" for label in ("eager", "compiled"))
    print(f"{row['model']:>7} batch {row['batch']:>2}  ms/token min / median:  {cells}   transformers / hybridlm: "
          f"{ratios}   (first step's max |logits - transformers'|: {diffs})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per decoder (the compile runs here)")
    parser.add_argument("--steps", type=int, default=24, help="timed steps per decoder")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"context {args.context}, {args.warmup} warm-up + {args.steps} timed steps", flush=True)
    for name in args.models:
        for batch in args.batch:
            report(measure(name, batch, args.context, args.warmup, args.steps))


if __name__ == "__main__":
    main()
