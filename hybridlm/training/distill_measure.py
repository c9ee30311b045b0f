"""Measurements of a distilled student beside its teacher, for docs/distillation.md:

    python -m hybridlm.training.distill_measure decode --teacher DIR --student OUT [--contexts 4096 16384]

``decode``: ms per decoded token with a cache already holding each context, teacher and student interleaved step
by step in one process (:func:`hybridlm.bench.compare_stacks`: the cache is filled with random keys, values and
states, which costs what a prefill's would at decode time without paying for the prefill), min and median, with
each model's cache bytes. Both models may be asked for contexts beyond their ``max_position_embeddings`` (what
RoPE was trained to): that limit is lifted for the timing, which does not depend on what the positions mean.
"""

from __future__ import annotations

import argparse
import json


def decode_rows(teacher_dir: str, student_dir: str, contexts: list[int], steps: int, warmup: int,
                threads: int | None) -> list[dict]:
    """One row per model: KV bytes per token, fixed bytes and min / median ms per token at each context."""
    import torch

    from .. import load
    from ..bench import compare_stacks

    models = {"teacher": load(teacher_dir, dtype=torch.float32).eval(),
              "student": load(student_dir, dtype=torch.float32).eval()}
    for model in models.values():
        limit = model.config.max_position_embeddings
        if limit is not None and limit < max(contexts) + warmup + steps + 1:
            model.config.max_position_embeddings = max(contexts) + warmup + steps + 1
    rows = compare_stacks(models, contexts, steps=steps, warmup=warmup, threads=threads)
    return [{"model": row["stack"], "bytes_per_token": row["bytes_per_token"], "fixed_bytes": row["fixed_bytes"],
             **{f"{context}": {"min_ms": row[context].min_ms, "median_ms": row[context].median_ms}
                for context in contexts}} for row in rows]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    decode = commands.add_parser("decode", help="decode ms/token at long contexts, teacher beside student")
    decode.add_argument("--teacher", required=True)
    decode.add_argument("--student", required=True)
    decode.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    decode.add_argument("--steps", type=int, default=8, help="timed decode steps per model and context")
    decode.add_argument("--warmup", type=int, default=2)
    decode.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    rows = decode_rows(args.teacher, args.student, args.contexts, args.steps, args.warmup, args.threads)
    for row in rows:
        timings = ", ".join(f"{c // 1024}K: min {row[str(c)]['min_ms']:.1f} / median {row[str(c)]['median_ms']:.1f} ms"
                            for c in args.contexts)
        print(f"{row['model']:<8} {row['bytes_per_token']:>9,.0f} KV B/token, {row['fixed_bytes']:>12,} fixed B; "
              f"{timings}")
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
