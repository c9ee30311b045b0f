"""A bf16 decode attention on the CPU without AMX (``hybridlm.ops.attention._fp32_grouped_attention``): its keys and
values copied to fp32 whole against in pieces of ``FP32_KEY_CHUNK`` keys (what it does now), and an fp32 model's
attention over an fp32 cache (SDPA) as the reference, eager and compiled; and our kernel, which reads the bf16
keys and values without copies (``hybridlm.ops.cpu_kernels.grouped_attention``, which ``attention_ref`` calls first
where a compiler builds it), called directly and as its op in a compiled function.

SmolLM2-135M's heads (9 query heads over 3 key/value heads of 64, one query per row) at each ``--batches`` x
``--keys``; every variant takes turns call by call after a warm-up call, and the script prints min / median ms and
the medians' ratios.

    python benchmarks/cpu_attention.py [--batches 1 16] [--keys 2048 8192] [--threads 1] [--calls 30]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
attention = importlib.import_module("hybridlm.ops.attention")
cpu_attention = importlib.import_module("hybridlm.ops.cpu_attention")
cpu_kernels = importlib.import_module("hybridlm.ops.cpu_kernels")

Q_HEADS, KV_HEADS, DIM = 9, 3, 64
WHOLE = 1 << 40  # a piece longer than any cache: the whole copy


def variants(batch: int, keys: int) -> dict:
    """label -> (the ``FP32_KEY_CHUNK`` it runs with, a call). A compiled call guards on that global, so it is set
    to the variant's value before each call (no recompile)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, Q_HEADS, 1, DIM, generator=g).bfloat16()
    k, v = (torch.randn(batch, KV_HEADS, keys, DIM, generator=g).bfloat16() for _ in range(2))
    k32, v32, q32 = k.float(), v.float(), q.float()

    def written_out(q, k, v):
        return attention._fp32_grouped_attention(q, k, v, None, None)

    def fp32_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    # one compiled function: its guard on FP32_KEY_CHUNK picks the whole or the pieces graph
    compiled, compiled_fp32 = torch.compile(written_out, dynamic=False), torch.compile(fp32_sdpa, dynamic=False)
    calls = {"eager whole": (WHOLE, lambda: written_out(q, k, v)),
             "eager pieces": (attention.FP32_KEY_CHUNK, lambda: written_out(q, k, v)),
             "compiled whole": (WHOLE, lambda: compiled(q, k, v)),
             "compiled pieces": (attention.FP32_KEY_CHUNK, lambda: compiled(q, k, v)),
             "fp32 cache, compiled": (attention.FP32_KEY_CHUNK, lambda: compiled_fp32(q32, k32, v32))}
    if cpu_attention.KERNEL_AVAILABLE:
        op = torch.compile(lambda q, k, v: torch.ops.hybridlm.cpu_attention(q, k, v, None, None), dynamic=False)
        calls["kernel"] = (attention.FP32_KEY_CHUNK, lambda: cpu_kernels.grouped_attention(q, k, v))
        calls["kernel, compiled"] = (attention.FP32_KEY_CHUNK, lambda: op(q, k, v))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--keys", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pieces = attention.FP32_KEY_CHUNK
    print(f"torch {torch.__version__}, {args.threads} thread(s), pieces of {pieces} keys; ms min / median")
    for batch in args.batches:
        for keys in args.keys:
            calls = variants(batch, keys)
            times = {label: [] for label in calls}
            for index in range(args.calls + 1):  # the first call compiles and warms up
                for label, (chunk, call) in calls.items():
                    attention.FP32_KEY_CHUNK = chunk
                    start = time.perf_counter()
                    call()
                    if index:
                        times[label].append(1000 * (time.perf_counter() - start))
            attention.FP32_KEY_CHUNK = pieces
            median = {label: statistics.median(t) for label, t in times.items()}
            cells = ", ".join(f"{label} {min(t):.2f} / {median[label]:.2f}" for label, t in times.items())
            print(f"batch {batch}, {keys} keys: {cells}; whole / pieces (medians): eager "
                  f"{median['eager whole'] / median['eager pieces']:.2f}, compiled "
                  f"{median['compiled whole'] / median['compiled pieces']:.2f}; compiled pieces / fp32 cache "
                  f"{median['compiled pieces'] / median['fp32 cache, compiled']:.2f}" + (
                      f"; eager pieces / kernel {median['eager pieces'] / median['kernel']:.2f}, compiled pieces / "
                      f"kernel compiled {median['compiled pieces'] / median['kernel, compiled']:.2f}"
                      if "kernel" in median else ""), flush=True)


if __name__ == "__main__":
    main()
