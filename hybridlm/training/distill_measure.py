"""Measurements of a distilled student beside its teacher, for docs/distillation.md:

    python -m hybridlm.training.distill_measure decode --teacher DIR --student OUT [--contexts 4096 16384]
    python -m hybridlm.training.distill_measure recall --teacher DIR --student OUT [--lengths 1024 2048]

``decode``: ms per decoded token with a cache already holding each context, teacher and student interleaved step
by step in one process (:func:`hybridlm.decoding.bench.compare_stacks`: the cache is filled with random keys, values and
states, which costs what a prefill's would at decode time without paying for the prefill), min and median, with
each model's cache bytes. Both models may be asked for contexts beyond their ``max_position_embeddings`` (what
RoPE was trained to): that limit is lifted for the timing, which does not depend on what the positions mean.

``recall``: two in-context recall probes, greedy, teacher and student on the same prompts:

* passkey retrieval, the prompt of ``benchmarks/remedies/passkey.py`` (an instruction, filler sentences, "The
  pass key is N. Remember it. N is the pass key." at depths 0.1 / 0.5 / 0.9, then "What is the pass key? The pass
  key is"): correct when the first number generated is N;
* key-value recall in the manner of MQAR: ``pairs`` lines ``key: value`` (random lower-case words of 4 letters,
  3-digit numbers), a separator, then every key asked once in a shuffled order as ``key:``; correct when the
  first number after a query is its value. Each query is answered with the pairs and the earlier queries and
  answers in context (the true answers are fed back, teacher-forced), so the probe scores recall, not a
  cascade of its own errors.
"""

from __future__ import annotations

import argparse
import json


def decode_rows(teacher_dir: str, student_dir: str, contexts: list[int], steps: int, warmup: int,
                threads: int | None) -> list[dict]:
    """One row per model: KV bytes per token, fixed bytes and min / median ms per token at each context."""
    import torch

    from hybridlm.decoding.bench import compare_stacks
    from hybridlm.model import load

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


INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """About ``length`` tokens: the intro, filler with the key's sentence at ``depth``, the question."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    intro, filler, question = encode(INTRO), encode(FILLER), encode(QUESTION)
    needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
    room = max(length - len(intro) - len(needle) - len(question), 0)
    fill = (filler * (room // len(filler) + 1))[:room]
    cut = round(depth * room / len(filler)) * len(filler)  # at a sentence group's boundary
    return intro + fill[:cut] + needle + fill[cut:] + question


def _first_number(text: str) -> int | None:
    import re

    found = re.search(r"\d+", text)
    return int(found.group()) if found else None


def _greedy(model, ids: list[int], new_tokens: int, chunk: int = 512) -> list[int]:
    """``new_tokens`` greedy tokens after ``ids``, through a cache (prefilled in chunks)."""
    import torch

    cache, prompt = model.new_cache(1), torch.tensor([ids])
    with torch.no_grad():
        for start in range(0, prompt.shape[1], chunk):
            logits = model(prompt[:, start:start + chunk], cache=cache, logits_to_keep=1).logits[:, -1]
        out = [int(logits.argmax(-1))]
        for _ in range(new_tokens - 1):
            out.append(int(model(torch.tensor([[out[-1]]]), cache=cache).logits[0, -1].argmax()))
    return out


def passkey_cells(models: dict, tokenizer, lengths: list[int], depths=(0.1, 0.5, 0.9), seed: int = 0) -> list[dict]:
    import random

    rng, cells = random.Random(seed), []
    for length in lengths:
        for depth in depths:
            key = rng.randrange(10_000, 100_000)
            ids = passkey_prompt(tokenizer, length, depth, key)
            for name, model in models.items():
                answer = tokenizer.decode(_greedy(model, ids, 8))
                cells.append({"model": name, "length": len(ids), "depth": depth, "key": key, "answer": answer,
                              "correct": _first_number(answer) == key})
    return cells


def kv_recall(models: dict, tokenizer, pairs: int, seed: int = 0) -> dict[str, float]:
    """Accuracy of each model on one key-value recall prompt of ``pairs`` pairs (see the module docstring)."""
    import random
    import string

    import torch

    rng = random.Random(seed)
    keys = []
    while len(keys) < pairs:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(4))
        if word not in keys:
            keys.append(word)
    values = {key: rng.randrange(100, 1000) for key in keys}
    context = "".join(f"{key}: {values[key]}\n" for key in keys) + "\n"
    order = rng.sample(keys, len(keys))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    scores = {}
    for name, model in models.items():
        cache, correct = model.new_cache(1), 0
        with torch.no_grad():
            model(torch.tensor([encode(context)]), cache=cache)
            for key in order:
                logits = model(torch.tensor([encode(f"{key}:")]), cache=cache).logits[:, -1]
                answer = [int(logits.argmax(-1))]
                for _ in range(3):
                    answer.append(int(model(torch.tensor([[answer[-1]]]), cache=cache).logits[0, -1].argmax()))
                correct += _first_number(tokenizer.decode(answer)) == values[key]
                # the generated tokens are in the cache; the true answer follows them on a new line
                model(torch.tensor([encode(f"\n{key}: {values[key]}\n")]), cache=cache)
        scores[name] = correct / len(order)
    return scores


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
    recall = commands.add_parser("recall", help="passkey retrieval and key-value recall, teacher beside student")
    recall.add_argument("--teacher", required=True)
    recall.add_argument("--student", required=True)
    recall.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="passkey prompt lengths")
    recall.add_argument("--pairs", type=int, nargs="+", default=[8, 32], help="key-value pairs per recall prompt")
    recall.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "recall":
        return recall_report(args)
    rows = decode_rows(args.teacher, args.student, args.contexts, args.steps, args.warmup, args.threads)
    for row in rows:
        timings = ", ".join(f"{c // 1024}K: min {row[str(c)]['min_ms']:.1f} / median {row[str(c)]['median_ms']:.1f} ms"
                            for c in args.contexts)
        print(f"{row['model']:<8} {row['bytes_per_token']:>9,.0f} KV B/token, {row['fixed_bytes']:>12,} fixed B; "
              f"{timings}")
    print(json.dumps(rows))
    return rows



def recall_report(args) -> dict:
    import torch

    from hybridlm.model import load
    from hybridlm.training.distill import teacher_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    models = {"teacher": load(args.teacher, dtype=torch.float32).eval(),
              "student": load(args.student, dtype=torch.float32).eval()}
    tokenizer = teacher_tokenizer(args.teacher, models["teacher"].config.vocab_size)
    cells = passkey_cells(models, tokenizer, args.lengths)
    result = {"passkey": cells, "kv_recall": {str(n): kv_recall(models, tokenizer, n) for n in args.pairs}}
    for name in models:
        marks = " ".join(f"L={c['length']}:{'+' if c['correct'] else '-'}" for c in cells if c["model"] == name)
        recall_scores = ", ".join(f"{n} pairs {result['kv_recall'][n][name]:.2f}" for n in result["kv_recall"])
        print(f"{name:<8} passkey {marks}; key-value recall {recall_scores}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
