"""The ``passkey`` item: a number hidden in filler text, retrieved under each cache policy."""

from __future__ import annotations

import random
import re
import statistics
import time
from pathlib import Path

import torch

from hybridlm import CachePolicy
from remedies.common import (
    Bench,
    eviction_policies,
    prefill,
    pyplot,
    quantized_copy,
    save_plot,
)

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompts(bench: Bench, length: int, depths: list[float], keys: list[int]) -> torch.Tensor:
    """``[len(depths), length]``: intro, filler with the key's sentence at each depth, the question."""
    intro, filler, question = bench.encode(INTRO), bench.encode(FILLER), bench.encode(QUESTION)
    rows = []
    for depth, key in zip(depths, keys):
        needle = bench.encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
        room = length - len(intro) - len(needle) - len(question)
        fill = (filler * (room // len(filler) + 1))[:room]
        cut = round(depth * room / len(filler)) * len(filler)  # at a sentence group's boundary
        rows.append(intro + fill[:cut] + needle + fill[cut:] + question)
    return torch.tensor(rows)


@torch.no_grad()
def greedy(model, cache, logits: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy tokens ``[batch, steps]`` from the last logits and a cache."""
    out = [logits.argmax(-1)]
    for _ in range(steps - 1):
        out.append(model(out[-1][:, None], cache=cache).logits[:, -1].argmax(-1))
    return torch.stack(out, 1)


def first_number(text: str) -> int | None:
    found = re.search(r"\d+", text)
    return int(found.group()) if found else None


def item_passkey(bench: Bench) -> dict:
    args, model = bench.args, bench.model
    depths = [0.1, 0.5, 0.9]
    window = args.window_passkey
    policies = {**eviction_policies(window), "KIVI 4-bit": CachePolicy(kv_bits=4), "KIVI 2-bit": CachePolicy(kv_bits=2)}
    rng = random.Random(0)
    result = {"depths": depths, "window": window, "new_tokens": 8, "lengths": args.passkey_lengths, "cells": []}
    for length in args.passkey_lengths:
        keys = [rng.randrange(10_000, 100_000) for _ in depths]
        ids = passkey_prompts(bench, length, depths, keys)
        full = None
        for name, policy in policies.items():
            started = time.perf_counter()
            if policy is not None and policy.kv_bits != 16:
                cache = quantized_copy(model, full[0], policy)
                logits = full[1]
            else:
                cache = model.new_cache(len(depths), policy=policy)
                logits = prefill(model, cache, ids, 512)
                if policy is None:  # the KIVI caches are written from it, before its decode steps
                    full = (cache.snapshot(), logits)
            answers = greedy(model, cache, logits, 8)
            for depth, key, answer in zip(depths, keys, answers):
                text = bench.tokenizer.decode(answer)
                result["cells"].append({"policy": name, "length": length, "depth": depth, "key": key,
                                        "answer": text, "correct": first_number(text) == key})
            marks = "".join("+" if c["correct"] else "-" for c in result["cells"][-len(depths):])
            print(f"  L={length:>5} {name:<24} {marks}  ({time.perf_counter() - started:.0f} s)", flush=True)
            del cache
    result["accuracy"] = {name: {str(length): statistics.mean(c["correct"] for c in result["cells"]
                                                              if c["policy"] == name and c["length"] == length)
                                 for length in args.passkey_lengths} for name in policies}
    return result


def plot_passkey(result: dict, out: Path) -> str:
    plt = pyplot()
    names = list(result["accuracy"])
    lengths = result["lengths"]
    figure, axis = plt.subplots(figsize=(7, 3.4))
    grid = [[result["accuracy"][n][str(length)] for length in lengths] for n in names]
    image = axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    axis.set_xticks(range(len(lengths)), [f"{length // 1024}K" if length % 1024 == 0 else str(length)
                                          for length in lengths])
    axis.set_yticks(range(len(names)), names, fontsize=7)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    axis.set_xlabel("prompt length L")
    axis.set_title(f"passkey accuracy over depths {result['depths']} (window {result['window']})", fontsize=9)
    figure.colorbar(image, ax=axis, fraction=0.03)
    figure.tight_layout()
    return save_plot(figure, out / "real_model_passkey.png")
