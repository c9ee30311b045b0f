"""Prefill and training against this CPU's matmul peak, hybridlm beside transformers, in one run.

It first measures the peak: the fastest of ``--repeats`` fp32 (and bf16, where the CPU has bf16 products)
``n x n @ n x n`` products (``--peak-n``, 2048) at the thread count printed. Then, for the Jamba-, Mamba-2- and
Bamba-shaped models of ``hf_speed.py`` (hidden 256, 8 layers; transformers builds them with a fixed seed, hybridlm
loads the directory it wrote):

* the FLOPs of a prefill of ``--prefill`` tokens (2048) and of a training step (forward + backward of the
  next-token loss over ``--batch`` x ``--length``, 4 x 512), as torch's ``FlopCounterMode`` counts them (matrix
  products and attention; elementwise work, the scans' cumulative sums and the optimizer are not FLOPs it counts),
  for each library;
* their times, the libraries taking turns run by run after a warm-up, min and median; a training step includes
  AdamW;
* the fraction of peak: model FLOPs / peak / time (the time the model's FLOPs would take at the peak, over the
  time taken), where the model FLOPs are the smaller of the two libraries' counts (their algorithms count
  differently, a chunked scan's matrix products more than a sequential one's: each library's own count is printed
  beside; the C++ CPU scans, which a prefill runs, count none), and transformers / hybridlm time (> 1: hybridlm is
  faster);
* with ``--profile``, hybridlm's ten costliest operators in each, by self CPU time.

    python benchmarks/roofline.py [--models jamba mamba2 bamba] [--tasks prefill train] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers
from hf_speed import MODELS, VOCAB
from torch.utils.flop_counter import FlopCounterMode

import hybridlm
from hybridlm.ops.cpu_features import dtypes_without_cpu_products


def peak_flops(n: int, dtype: torch.dtype, repeats: int) -> float:
    """The fastest ``n x n @ n x n`` product in ``dtype``, in FLOP/s."""
    a, b = (torch.randn(n, n, dtype=dtype) for _ in range(2))
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prefill(model, ids: torch.Tensor):
    with torch.no_grad():
        return model(ids, use_cache=True, logits_to_keep=1)


def counted_prefill(model, ids: torch.Tensor):
    """The prefill as FLOPs are counted: with autograd on (FlopCounterMode's module tracker fails under no_grad on
    transformers' hub-kernel wrappers, which take parameters as arguments), so hybridlm's C++ scans decline to the
    chunked references, whose products count; the smaller count, transformers', is the model's."""
    return model(ids, use_cache=True, logits_to_keep=1)


def train_step(model, optimizer, ids: torch.Tensor) -> None:
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def top_ops(fn, rows: int = 10) -> str:
    with torch.profiler.profile() as profile:
        fn()
    return profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def measure(name: str, args, peak: float) -> None:
    torch.manual_seed(0)
    theirs = MODELS[name]()
    theirs.config.output_router_logits = False  # hybridlm's loss adds the aux loss itself
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        ours = hybridlm.HybridForCausalLM.from_pretrained(directory)
    models = {"hybridlm": ours, "transformers": theirs}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, VOCAB, (1, args.prefill), generator=generator)
    batch = torch.randint(1, VOCAB, (args.batch, args.length), generator=generator)
    optimizers = {label: torch.optim.AdamW(model.parameters(), lr=1e-4) for label, model in models.items()}
    work = {
        ("prefill", f"prefill {args.prefill}"): {label: (lambda m=model: prefill(m.eval(), prompt))
                                                 for label, model in models.items()},
        ("train", f"train {args.batch}x{args.length}"): {
            label: (lambda m=model, o=optimizers[label]: train_step(m.train(), o, batch))
            for label, model in models.items()},
    }
    counted = {"prefill": {label: (lambda m=model: counted_prefill(m.eval(), prompt))
                           for label, model in models.items()}}  # how a task's FLOPs are counted, if not as timed
    for (kind, task), runs in work.items():
        if kind not in args.tasks:
            continue
        flops = {label: counted_flops(fn) for label, fn in counted.get(kind, runs).items()}
        times = {label: [] for label in runs}
        for index in range(args.warmup + args.repeats):
            for label, fn in runs.items():
                seconds = _seconds(fn)
                if index >= args.warmup:
                    times[label].append(seconds)
        cells = []
        for label in runs:
            low, median = min(times[label]), statistics.median(times[label])
            share = min(flops.values()) / peak
            cells.append(f"{label} {1000 * low:.0f} / {1000 * median:.0f} ms ({flops[label] / 1e9:.2f} GFLOP counted), "
                         f"{100 * share / median:.1f}% of peak (median; {100 * share / low:.1f}% at the min)")
        ratio = statistics.median(times["transformers"]) / statistics.median(times["hybridlm"])
        print(f"{name} {task}, {min(flops.values()) / 1e9:.2f} GFLOP: " + "; ".join(cells)
              + f"; transformers / hybridlm x{ratio:.2f} (medians)", flush=True)
        if args.profile:
            print(top_ops(runs["hybridlm"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes = ["jamba", "mamba2", "bamba"]
    parser.add_argument("--models", nargs="+", choices=shapes, default=shapes)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-n", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="hybridlm's costliest operators in each task")
    parser.add_argument("--tasks", nargs="+", choices=["prefill", "train"], default=["prefill", "train"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peak = peak_flops(args.peak_n, torch.float32, args.repeats)
    if torch.bfloat16 in dtypes_without_cpu_products():  # a scalar fallback: minutes for one product, and moot
        bf16 = "not measured (no bf16 products on this CPU)"
    else:
        bf16 = f"{peak_flops(args.peak_n, torch.bfloat16, max(1, args.repeats // 2)) / 1e9:.1f} GFLOP/s"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"matmul peak ({args.peak_n}^3): fp32 {peak / 1e9:.1f} GFLOP/s, bf16 {bf16}", flush=True)
    for name in args.models:
        measure(name, args, peak)


if __name__ == "__main__":
    main()
