"""The seed's remedies measured on a real pretrained model: SmolLM2-135M-Instruct (30 attention layers, 9 query and
3 KV heads of 64, a context of 8,192 tokens), fetched by ``python benchmarks/real_model.py fetch``.

    python benchmarks/real_model_remedies.py --out docs/real_model            # the full run
    python benchmarks/real_model_remedies.py --out docs/real_model --quick    # shorter stream/passkey; ~38 min idle
    python benchmarks/real_model_remedies.py --only kivi stream --out /tmp/r  # some items only

``--out DIR`` gets ``results.json`` (every number below, the settings, each item's wall time and the load average
around it; rewritten crash-safely after every item, and an ``--only`` run keeps the other items already there) and
one PNG per item. Items, in run order:

``blocks``
    The check that makes the rest affordable on two cores. A 2-64-token forward on a warm cache is read as the
    one-token decode steps it stands for (``hybridlm.cache.kv.stepwise``: KIVI's aging, the sinks' positions; the
    contiguous and window-only layouts need nothing), so "decoded token by token" is run as 64-token blocks.
    Reported: max |logits(one block of 64) - logits(64 one-token steps)| for sinks 4 + window 28 and 2-bit KIVI
    (group 32, residual 32); and max |logits| difference between a KIVI cache prefilled in one chunk and one
    written from the full-precision cache's keys and values (:func:`quantized_copy`, used by ``kivi`` and
    ``passkey`` to save a prefill per bit width).
``kivi``
    KIVI (group 32, residual 128, its defaults). Rows of held-out standard-library code, each prefilled in one
    chunk (the prompt attends in full precision, as in KIVI) then ``--kivi-decode`` tokens decoded teacher-forced.
    Per bit width: mean next-token KL(fp || quantized) in nats over the decoded tokens, the share of tokens whose
    greedy choice agrees with full precision, and the perplexity of the decoded tokens (and its change).
``stream``
    StreamingLLM's claim past the context: perplexity of each ``--segment``-token stretch of a ``--stream``-token
    stream of held-out code (16,384 = 2x the context), decoded teacher-forced under full attention, window only,
    sinks 4 + window and H2O. ``max_position_embeddings`` is set to None for this item only (hybridlm refuses
    positions past it; full attention and H2O, which keep absolute positions, then run past the trained context
    on purpose). Full attention is run in 512-token chunks (exactly its decode), window and sinks in 64-token
    blocks (exactly their decode, see ``blocks``); H2O cannot be replayed (a block's queries see every held key
    and it cannot roll back), so it is fed ``--h2o-block``-token blocks: nothing is evicted inside a block.
``passkey``
    A 5-digit number hidden at depth 10% / 50% / 90% of filler text ("The grass is green. ..."), total prompt
    length L, then "What is the pass key? The pass key is"; 8 tokens generated greedily. Accuracy: the first
    number generated equals the key. Prompts prefilled in 512-token chunks (``IncrementalDecoder``'s default);
    KIVI caches are written from the full-precision prefill (KIVI's reading: the prompt in full precision).
``speculative``
    Prompt lookup on an edit task: the chat template around "Rename the variable X to Y in this function:" and a
    function of the held-out standard library; the answer starts with "```python" (``--unprimed``: it does not,
    and the 135M model tends to describe the function instead of rewriting it). hybridlm's
    ``SpeculativeDecoding(prompt_lookup=3)`` and transformers' ``generate(prompt_lookup_num_tokens=k)`` (on its
    ``LlamaForCausalLM`` of the same directory) against plain greedy decoding of each library, taking turns;
    greedy stops at ``<|im_end|>``. Reported: min / median seconds, speed-up (plain / lookup), acceptance rate
    (accepted / drafted tokens), tokens per target forward (the prefill counted: 1.0 for plain decoding); the
    tokens are asserted identical to plain greedy decoding.
``prefix``
    A shared 2,048-token system message (held-out code) and 8 questions in the chat template. Time to first token
    (prefill + first choice) without a prefix cache and with a hit in ``PrefixCache(block_size=256)`` (the
    decoders take turns, question by question), and max |logits| difference between the two (the prefix cache
    cuts chunks at block boundaries, so the plain decoder uses 256-token chunks too: identical is expected).
``speed``
    hybridlm against transformers on the same weights (``benchmarks/hf_speed.py`` style, side by side, taking
    turns, after warm-up): prefill of 2,048 tokens (logits of the last only), and decode ms per token at a
    4,096-token context, batch 1 and 16 (the batch-1 prompt's cache repeated), hybridlm eager and compiled
    (``IncrementalDecoder(compile=True)``: static cache, ``torch.compile``; the first step's compile time is
    reported apart) against transformers' ``DynamicCache``. Min and median; ratios > 1 mean hybridlm is faster.

Every number is computed in the run; ``--quick`` shortens only ``stream`` (4,096 tokens, window 256, 512-token
stretches: full attention then stays inside the context), ``passkey`` (L up to 4K) and ``speculative`` (one
function). SmolLM2 was pretrained on web data that may include the standard library: the perplexities are of
code the model may have seen; the comparisons between policies are what this measures.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import json
import math
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hybridlm
from hybridlm import CachePolicy, PrefixCache, SpeculativeDecoding
from hybridlm.cache.kv.base import KVState
from hybridlm.decoding.bench import Timing
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.files import write_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import held_out_code, require_model  # noqa: E402

ITEMS = ("blocks", "kivi", "stream", "passkey", "speculative", "prefix", "speed")
BLOCK = 64  # the longest forward read as decode steps (hybridlm.cache.rollback.AUTO_CHECKPOINT_TOKENS)


# --- shared helpers ----------------------------------------------------------------------------------------------


class Bench:
    """What every item gets: the models, the tokenizer, the settings."""

    def __init__(self, args):
        from transformers import AutoTokenizer

        _, self.directory = require_model()
        self.args = args
        self.model = hybridlm.load(self.directory).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory)
        self._hf = None

    @property
    def hf(self):
        """transformers' ``LlamaForCausalLM`` of the same directory (loaded on first use)."""
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32).eval()
        return self._hf

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)


def quantized_copy(model, source, policy: CachePolicy):
    """A cache under the KIVI ``policy`` holding what prefilling ``source``'s tokens in one chunk would: each
    contiguous state's keys (stored rotated) and values written through the quantized layout's own update."""
    target = model.new_cache(source.batch_size, policy=policy)
    seen = source.seen
    positions = torch.arange(seen).expand(source.batch_size, seen)
    for state, copy in zip(source.states, target.states):
        if not isinstance(state, KVState):
            raise TypeError(f"quantized_copy expects contiguous KV states, got {type(state).__name__}")
        copy.update(state.keys[:, :, :seen], state.values[:, :, :seen], positions, None, None)
    target.seen = seen
    target.positions.copy_(source.positions)
    return target


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids [batch, n]`` in ``chunk``-token forwards; the last position's logits ``[batch, vocab]``."""
    for start in range(0, ids.shape[1], chunk):
        logits = model(ids[:, start:start + chunk], cache=cache, logits_to_keep=1).logits
    return logits[:, -1]


@torch.no_grad()
def teacher_forced(model, cache, ids: torch.Tensor, block: int):
    """Feed ``ids [batch, n]`` in ``block``-token forwards; yields ``(start, logits [batch, block, vocab])``, the
    logits at positions ``start..``, i.e. of the tokens after them."""
    for start in range(0, ids.shape[1], block):
        yield start, model(ids[:, start:start + block], cache=cache).logits


def save_plot(figure, path: Path) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    write_file(path, buffer.getvalue())
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path.name


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def policy_label(policy: CachePolicy | None) -> str:
    if policy is None:
        return "full attention"
    if policy.kv_bits != 16:
        return f"KIVI {policy.kv_bits}-bit"
    if policy.heavy_hitters:
        return f"H2O {policy.heavy_hitters} + window {policy.window}"
    if policy.sink_tokens:
        return f"sinks {policy.sink_tokens} + window {policy.window}"
    return f"window {policy.window}"


def eviction_policies(window: int) -> dict[str, CachePolicy | None]:
    """Full attention and the three bounded policies, each holding ``window`` tokens."""
    policies = [None, CachePolicy(window=window), CachePolicy(sink_tokens=4, window=window - 4),
                CachePolicy(heavy_hitters=window // 2, window=window // 2)]
    return {policy_label(p): p for p in policies}


# --- blocks: 64-token forwards are decode steps ------------------------------------------------------------------


@torch.no_grad()
def item_blocks(bench: Bench) -> dict:
    model = bench.model
    ids = torch.tensor([held_out_code(bench.tokenizer, 48 + BLOCK, skip=50_000)])
    rows = {}
    for name, policy in {"sinks 4 + window 28": CachePolicy(sink_tokens=4, window=28),
                         "KIVI 2-bit (group 32, residual 32)": CachePolicy(kv_bits=2, kv_residual=32)}.items():
        stepped, blocked = model.new_cache(1, policy=policy), model.new_cache(1, policy=policy)
        prefill(model, stepped, ids[:, :48], 48)
        prefill(model, blocked, ids[:, :48], 48)
        steps = torch.cat([model(ids[:, t:t + 1], cache=stepped).logits for t in range(48, 48 + BLOCK)], 1)
        block = model(ids[:, 48:48 + BLOCK], cache=blocked).logits
        rows[name] = (steps - block).abs().max().item()
    prompt = torch.tensor([held_out_code(bench.tokenizer, 256 + BLOCK, skip=60_000)])
    kivi = CachePolicy(kv_bits=4)
    direct, full = model.new_cache(1, policy=kivi), model.new_cache(1)
    prefill(model, direct, prompt[:, :256], 256)
    prefill(model, full, prompt[:, :256], 256)
    written = quantized_copy(model, full, kivi)
    copy_diff = (model(prompt[:, 256:], cache=direct).logits - model(prompt[:, 256:], cache=written).logits)
    result = {"block_vs_steps_max_abs_logit_diff": rows, "block": BLOCK, "prefix": 48,
              "kivi4_one_chunk_vs_written_max_abs_logit_diff": copy_diff.abs().max().item()}
    for name, diff in rows.items():
        print(f"  {name}: max |block - steps| {diff:.2e}")
    print(f"  KIVI 4-bit written from the fp cache vs prefilled in one chunk: {result[next(reversed(result))]:.2e}")
    return result


# --- kivi --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def item_kivi(bench: Bench) -> dict:
    args, model = bench.args, bench.model
    rows, context, decode = args.kivi_rows, args.kivi_prefill, args.kivi_decode
    tokens = held_out_code(bench.tokenizer, rows * (context + decode + 1))
    ids = torch.tensor(tokens).view(rows, -1)[:, :context + decode + 1]
    full = model.new_cache(rows)
    prefill(model, full, ids[:, :context], context)  # one chunk: the prompt attends in full precision
    caches = {16: full, **{bits: quantized_copy(model, full, CachePolicy(kv_bits=bits)) for bits in args.kivi_bits}}
    targets = ids[:, context + 1:]  # the decoded tokens: logits at context..context+decode-1 predict them
    feed = ids[:, context:context + decode]
    kl = {bits: 0.0 for bits in caches}
    nll = {bits: 0.0 for bits in caches}
    agree = {bits: 0 for bits in caches}
    kl_by_block = {bits: [] for bits in args.kivi_bits}
    # the first decoded token's logits are the prefill's own (full precision for every cache): not counted
    for start in range(0, decode, BLOCK):
        block = {bits: logprobs(model(feed[:, start:start + BLOCK], cache=cache).logits)
                 for bits, cache in caches.items()}
        reference = block[16]
        want = targets[:, start:start + BLOCK]
        for bits, lp in block.items():
            nll[bits] += -lp.gather(-1, want[..., None]).sum().item()
            agree[bits] += (lp.argmax(-1) == reference.argmax(-1)).sum().item()
            if bits != 16:
                step_kl = F.kl_div(lp, reference, log_target=True, reduction="none").sum(-1)  # [rows, block]
                kl[bits] += step_kl.sum().item()
                kl_by_block[bits].append(step_kl.mean().item())
    count = rows * decode
    out = {"rows": rows, "prefill": context, "decoded_per_row": decode, "tokens": count,
           "kv_group_size": 32, "kv_residual": 128, "by_bits": {}}
    ppl_fp = math.exp(nll[16] / count)
    for bits in caches:
        ppl = math.exp(nll[bits] / count)
        out["by_bits"][str(bits)] = {"kl": kl[bits] / count if bits != 16 else 0.0, "perplexity": ppl,
                                     "perplexity_delta": ppl - ppl_fp, "top1_agreement": agree[bits] / count,
                                     "kl_by_block": kl_by_block.get(bits, [])}
        print(f"  {'fp32' if bits == 16 else f'{bits}-bit':>5}: KL {out['by_bits'][str(bits)]['kl']:.2e}  "
              f"ppl {ppl:.3f} ({ppl - ppl_fp:+.3f})  top-1 agreement {agree[bits] / count:.4f}")
    return out


def plot_kivi(result: dict, out: Path) -> str:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    bits = [b for b in result["by_bits"] if b != "16"]
    left.bar([f"{b}-bit" for b in bits], [result["by_bits"][b]["kl"] for b in bits], color="tab:blue")
    left.set_yscale("log")
    left.set_ylabel("mean KL(fp || quantized), nats")
    for b in bits:
        series = result["by_bits"][b]["kl_by_block"]
        right.plot([result["prefill"] + BLOCK * (i + 0.5) for i in range(len(series))], series, marker="o",
                   label=f"{b}-bit")
    right.set_yscale("log")
    right.set_xlabel("context (tokens)")
    right.set_ylabel("KL per 64-token block")
    right.legend(fontsize=7)
    figure.suptitle(f"KIVI on SmolLM2-135M: {result['tokens']} decoded tokens", fontsize=9)
    figure.tight_layout()
    return save_plot(figure, out / "real_model_kivi.png")


# --- stream: perplexity past the context -------------------------------------------------------------------------


@torch.no_grad()
def stream_nll(model, ids: torch.Tensor, policy: CachePolicy | None, block: int) -> torch.Tensor:
    """Negative log-likelihood ``[time - 1]`` of tokens ``1..`` of ``ids [1, time]``, fed in ``block``-token
    forwards after a first forward of ``block`` tokens."""
    cache = model.new_cache(1, policy=policy)
    targets = ids[0, 1:]
    out = []
    for start, logits in teacher_forced(model, cache, ids[:, :-1], block):
        lp = logprobs(logits[0])
        out.append(-lp.gather(-1, targets[start:start + lp.shape[0], None])[:, 0])
    return torch.cat(out)


def item_stream(bench: Bench) -> dict:
    args, model = bench.args, bench.model
    length, window, segment = args.stream, args.window_stream, args.segment
    ids = torch.tensor([held_out_code(bench.tokenizer, length)])
    limit = model.config.max_position_embeddings
    model.config.max_position_embeddings = None  # deliberately: full attention and H2O run past the context
    result = {"tokens": length, "segment": segment, "window": window, "context": limit, "policies": {}}
    try:
        for name, policy in eviction_policies(window).items():
            block = 512 if policy is None else args.h2o_block if policy.heavy_hitters else BLOCK
            started = time.perf_counter()
            nll = stream_nll(model, ids, policy, block)
            ppl = [math.exp(nll[s:s + segment].mean().item()) for s in range(0, nll.shape[0], segment)]
            result["policies"][name] = {"block": block, "perplexity": ppl,
                                        "seconds": time.perf_counter() - started}
            print(f"  {name:<24} (blocks of {block:>3}): " + " ".join(f"{p:.2f}" for p in ppl), flush=True)
    finally:
        model.config.max_position_embeddings = limit
    return result


def plot_stream(result: dict, out: Path) -> str:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 3.6))
    segment = result["segment"]
    for name, row in result["policies"].items():
        ppl = row["perplexity"]
        axis.plot([segment * (i + 0.5) for i in range(len(ppl))], ppl, marker="o", label=name)
    if result["context"] and result["context"] < result["tokens"]:
        axis.axvline(result["context"], color="gray", linestyle="--", linewidth=1)
        axis.text(result["context"], axis.get_ylim()[1], " trained context", fontsize=7, va="top")
    axis.axvline(result["window"], color="gray", linestyle=":", linewidth=1)
    axis.set_yscale("log")
    axis.set_xlabel("position in the stream (tokens)")
    axis.set_ylabel(f"perplexity per {segment} tokens")
    axis.legend(fontsize=7)
    axis.set_title(f"SmolLM2-135M on a {result['tokens']}-token stream of held-out code", fontsize=9)
    figure.tight_layout()
    return save_plot(figure, out / "real_model_stream.png")


# --- passkey -----------------------------------------------------------------------------------------------------

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


# --- speculative: prompt lookup on an edit task ------------------------------------------------------------------


def edit_tasks(bench: Bench, count: int, primed: bool) -> list[dict]:
    """``count`` public functions (60 to 160 tokens, one per held-out stdlib file, in the corpus's order), each
    with its most used name (used 3 times at least) to rename. ``primed``: the answer starts with the opening of
    a Python code block (after the chat template's generation prompt), so that the model writes the function."""
    from hybridlm.training.corpus import stdlib_corpus

    tasks = []
    for path, text in stdlib_corpus().held_out:
        for node in ast.parse(text).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            code = ast.get_source_segment(text, node)
            names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and len(n.id) >= 3
                     and n.id not in dir(builtins) and not n.id.isupper()]
            if not names or not 60 <= len(bench.encode(code)) <= 160:
                continue
            old = max(set(names), key=names.count)
            if names.count(old) < 3:
                continue
            new = f"{old}_value" if not old.endswith("s") else f"all_{old}"
            message = f"Rename the variable `{old}` to `{new}` in this function:\n\n```python\n{code}\n```"
            ids = bench.chat([{"role": "user", "content": message}]) + (bench.encode(PRIME) if primed else [])
            tasks.append({"file": Path(path).name, "function": node.name, "old": old, "new": new,
                          "code_tokens": len(bench.encode(code)), "ids": ids})
            break
        if len(tasks) == count:
            break
    return tasks


PRIME = "```python\n"


class ForwardCounter:
    """Counts transformers' forwards during ``generate`` and the tokens drafted. With prompt lookup every forward
    verifies a draft (possibly empty): the first feeds the prompt plus the draft, the later ones the last token
    plus the draft."""

    def __init__(self, hf):
        self.calls, self.drafted, self.prompt = 0, 0, 0
        hf.register_forward_pre_hook(self, with_kwargs=True)

    def reset(self, prompt: int) -> None:
        self.calls, self.drafted, self.prompt = 0, 0, prompt

    def __call__(self, module, args, kwargs):
        fed = kwargs["input_ids"].shape[1] if kwargs.get("input_ids") is not None else args[0].shape[1]
        self.drafted += fed - (self.prompt if not self.calls else 1)
        self.calls += 1


def until_stop(tokens: list[int], stop: int) -> list[int]:
    return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens


class EditModes:
    """The four ways of answering an edit task greedily: hybridlm and transformers, plain and prompt lookup."""

    names = ("hybridlm plain", "hybridlm prompt lookup", "transformers plain", "transformers prompt lookup")

    def __init__(self, bench: Bench, draft_tokens: int):
        self.hf, self.k = bench.hf, draft_tokens
        self.stop = bench.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.counter = ForwardCounter(self.hf)
        lookup = SpeculativeDecoding(prompt_lookup=3, num_draft_tokens=draft_tokens)
        self.decoders = {"hybridlm plain": IncrementalDecoder(bench.model),
                         "hybridlm prompt lookup": IncrementalDecoder(bench.model, speculative=lookup)}

    def run(self, mode: str, ids: list[int], budget: int) -> tuple[list[int], dict]:
        """The new tokens up to ``<|im_end|>`` and ``{"forwards", "drafted"}`` (forwards None: one per token)."""
        stop = self.stop
        if mode in self.decoders:
            out = self.decoders[mode].generate([ids], max_new_tokens=budget, stop_tokens=[stop], pad_token_id=stop)
            s = self.decoders[mode].stats  # the prefill, then one verification forward per round
            stats = {"forwards": s["target_forwards"] + 1 if "target_forwards" in s else None,
                     "drafted": s.get("draft_tokens", 0)}
        else:
            self.counter.reset(len(ids))
            extra = {"prompt_lookup_num_tokens": self.k} if mode.endswith("lookup") else {}
            out = self.hf.generate(torch.tensor([ids]), max_new_tokens=budget, do_sample=False, eos_token_id=stop,
                                   pad_token_id=stop, **extra)
            stats = {"forwards": self.counter.calls, "drafted": self.counter.drafted}
        return until_stop(out[0, len(ids):].tolist(), stop), stats


def item_speculative(bench: Bench) -> dict:
    args = bench.args
    edit = EditModes(bench, args.draft_tokens)
    result = {"draft_tokens": args.draft_tokens, "hybridlm_ngram": 3, "repeats": args.repeats, "warmup": 1,
              "primed": not args.unprimed, "tasks": []}
    for task in edit_tasks(bench, args.edit_functions, primed=not args.unprimed):
        ids, budget = task["ids"], args.max_new or task["code_tokens"] + 48
        seconds: dict[str, list[float]] = {}
        outputs, stats = {}, {}
        modes = EditModes.names
        for repeat in range(1 + args.repeats):
            for mode in modes:
                started = time.perf_counter()
                tokens, stats[mode] = edit.run(mode, ids, budget)
                taken = time.perf_counter() - started
                if repeat:
                    seconds.setdefault(mode, []).append(taken)
                outputs.setdefault(mode, tokens)
                assert tokens == outputs[mode], f"{mode}: a greedy run changed its output"
        for library in ("hybridlm", "transformers"):
            assert outputs[f"{library} prompt lookup"] == outputs[f"{library} plain"], \
                f"{library}: prompt lookup's tokens differ from plain greedy decoding"
        row = {key: task[key] for key in ("file", "function", "old", "new", "code_tokens")}
        row.update(prompt_tokens=len(ids), new_tokens=len(outputs["hybridlm plain"]),
                   same_tokens_hybridlm_vs_transformers=outputs["hybridlm plain"] == outputs["transformers plain"],
                   renamed=task["new"] in bench.tokenizer.decode(outputs["hybridlm plain"]), modes={})
        for mode in modes:
            timing = Timing.of(seconds[mode])
            plain = Timing.of(seconds[mode.split()[0] + " plain"])
            new = len(outputs[mode])
            entry = {"min_s": timing.min_ms / 1000, "median_s": timing.median_ms / 1000,
                     "speedup_min": plain.min_ms / timing.min_ms, "speedup_median": plain.median_ms / timing.median_ms}
            s = stats[mode]
            forwards = s["forwards"] or new  # plain hybridlm: the prefill and one step per later token
            entry.update(target_forwards=forwards, tokens_per_forward=new / forwards)
            if mode.endswith("lookup"):
                # every forward emits the drafts it accepted plus one token of the target's own
                entry.update(drafted=s["drafted"], acceptance_rate=(new - forwards) / max(s["drafted"], 1))
            row["modes"][mode] = entry
            extra = (f"  acceptance {entry['acceptance_rate']:.2f}, {entry['tokens_per_forward']:.2f} tokens "
                     "per target forward" if "acceptance_rate" in entry else "")
            print(f"  {task['function']:<18} {mode:<28} {timing:>12.0f} ms  x{entry['speedup_min']:.2f} (min) "
                  f"x{entry['speedup_median']:.2f} (median){extra}", flush=True)
        row["answer"] = bench.tokenizer.decode(outputs["hybridlm plain"])
        result["tasks"].append(row)
    return result


def plot_speculative(result: dict, out: Path) -> str:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.2))
    tasks = result["tasks"]
    width = 0.2
    for i, mode in enumerate(["hybridlm prompt lookup", "transformers prompt lookup"]):
        for j, key in enumerate(["speedup_min", "speedup_median"]):
            axis.bar([t + (2 * i + j - 1.5) * width for t in range(len(tasks))],
                     [task["modes"][mode][key] for task in tasks], width,
                     label=f"{mode.split()[0]} ({key.split('_')[1]})")
    axis.axhline(1, color="gray", linewidth=1)
    axis.set_xticks(range(len(tasks)), [t["function"] for t in tasks], fontsize=7)
    axis.set_ylabel("speed-up vs plain greedy")
    axis.legend(fontsize=7)
    axis.set_title("prompt lookup on 'rename a variable' (greedy, identical tokens)", fontsize=9)
    figure.tight_layout()
    return save_plot(figure, out / "real_model_speculative.png")


# --- prefix cache ------------------------------------------------------------------------------------------------

QUESTIONS = ["What does this module do?", "Which functions does it define?", "Is any of this code thread-safe?",
             "Summarize the first function in one sentence.", "Which exceptions can it raise?",
             "Write a docstring for the last function.", "What would you rename, and why?",
             "List the imports it uses."]


def item_prefix(bench: Bench) -> dict:
    args, model = bench.args, bench.model
    block = 256
    code = bench.tokenizer.decode(held_out_code(bench.tokenizer, args.system_tokens, skip=20_000))
    system = {"role": "system", "content": "You are a careful Python reviewer. The module under review:\n\n" + code}
    prompts = [torch.tensor([bench.chat([system, {"role": "user", "content": q}])]) for q in QUESTIONS]
    shared = min(next((i for i, (a, b) in enumerate(zip(prompts[0][0], p[0])) if a != b), p.shape[1])
                 for p in prompts[1:])
    plain = IncrementalDecoder(model, prefill_chunk_size=block)
    cached = IncrementalDecoder(model, prefill_chunk_size=block, prefix_cache=PrefixCache(block_size=block))

    def first_token(decoder, prompt: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Seconds to the first token (prefill + its choice) and the prefill's last logits."""
        started = time.perf_counter()
        _, logits = decoder.prefill(prompt)
        logits.argmax(-1)
        return time.perf_counter() - started, logits

    cold, _ = first_token(cached, prompts[0])  # fills the prefix cache with the system prompt's blocks
    first_token(plain, prompts[0])  # warm-up
    seconds = {"no prefix cache": [], "prefix cache hit": []}
    diffs, hits = [], []
    for prompt in prompts:
        taken_plain, reference = first_token(plain, prompt)
        taken_hit, logits = first_token(cached, prompt)
        seconds["no prefix cache"].append(taken_plain)
        seconds["prefix cache hit"].append(taken_hit)
        hits.append(cached.stats["prefix_hit_tokens"])
        diffs.append((logits - reference).abs().max().item())
    timings = {name: Timing.of(values) for name, values in seconds.items()}
    result = {"system_tokens": args.system_tokens, "shared_prefix_tokens": shared, "block_size": block,
              "prompt_tokens": [p.shape[1] for p in prompts], "hit_tokens": hits, "cold_first_request_s": cold,
              "ttft": {name: {"min_s": t.min_ms / 1000, "median_s": t.median_ms / 1000, "all_s": seconds[name]}
                       for name, t in timings.items()},
              "speedup_min": timings["no prefix cache"].min_ms / timings["prefix cache hit"].min_ms,
              "speedup_median": timings["no prefix cache"].median_ms / timings["prefix cache hit"].median_ms,
              "max_abs_logit_diff": max(diffs), "logits_identical": max(diffs) == 0.0}
    for name, t in timings.items():
        print(f"  {name:<18} time to first token {t:.0f} ms (min / median)")
    print(f"  hit {hits[0]} of {prompts[0].shape[1]} tokens; speed-up x{result['speedup_min']:.1f} (min) "
          f"x{result['speedup_median']:.1f} (median); max |logits diff| {max(diffs):.1e}")
    return result


def plot_prefix(result: dict, out: Path) -> str:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3))
    for name, row in result["ttft"].items():
        axis.plot(range(1, len(row["all_s"]) + 1), [1000 * s for s in row["all_s"]], marker="o", label=name)
    axis.set_yscale("log")
    axis.set_xlabel("question")
    axis.set_ylabel("time to first token (ms)")
    axis.legend(fontsize=7)
    axis.set_title(f"{result['system_tokens']}-token shared system prompt, PrefixCache(block_size=256)",
                   fontsize=9)
    figure.tight_layout()
    return save_plot(figure, out / "real_model_prefix.png")


# --- speed against transformers ----------------------------------------------------------------------------------


class HybridStepper:
    """hybridlm decode steps (``IncrementalDecoder.decode_step``, eager or compiled) after a prefill."""

    def __init__(self, model, ids: torch.Tensor, reserve: int, compile: bool):
        self.decoder = IncrementalDecoder(model, compile=compile)
        self.cache, logits = self.decoder.prefill(ids, reserve=reserve)
        self.token = logits.argmax(-1)
        self.times: list[float] = []

    def expand(self, batch: int) -> None:
        self.cache = self.cache.select(torch.zeros(batch, dtype=torch.long))
        self.token = self.token.expand(batch).contiguous()

    def step(self, timed: bool = True) -> float:
        started = time.perf_counter()
        self.token = self.decoder.decode_step(self.token, self.cache).argmax(-1)
        taken = time.perf_counter() - started
        if timed:
            self.times.append(taken)
        return taken


class TransformersStepper:
    """transformers decode steps with its DynamicCache after a prefill."""

    def __init__(self, hf, ids: torch.Tensor):
        out = hf(ids, use_cache=True, logits_to_keep=1)
        self.hf, self.cache, self.token = hf, out.cache, out.logits[:, -1:].argmax(-1)
        self.times: list[float] = []

    def expand(self, batch: int) -> None:
        self.cache.batch_repeat_interleave(batch)
        self.token = self.token.expand(batch, 1).contiguous()

    def step(self, timed: bool = True) -> float:
        started = time.perf_counter()
        out = self.hf(self.token, cache=self.cache, use_cache=True)
        self.cache, self.token = out.cache, out.logits[:, -1:].argmax(-1)
        taken = time.perf_counter() - started
        if timed:
            self.times.append(taken)
        return taken


@torch.no_grad()
def item_speed(bench: Bench) -> dict:
    args, model, hf = bench.args, bench.model, bench.hf
    ids = torch.tensor([held_out_code(bench.tokenizer, args.context, skip=30_000)])
    result = {"prefill_tokens": args.prefill, "context": args.context, "steps": args.steps,
              "warmup_steps": args.warmup, "prefill_repeats": args.prefill_repeats}

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    prompt = ids[:, :args.prefill]
    runs = {"hybridlm": lambda: model(prompt, use_cache=True, logits_to_keep=1),
            "transformers": lambda: hf(prompt, use_cache=True, logits_to_keep=1)}
    seconds = {name: [] for name in runs}
    for repeat in range(1 + args.prefill_repeats):
        for name, run in runs.items():
            taken = timed(run)
            if repeat:
                seconds[name].append(taken)
    result["prefill"] = timings_row(seconds)
    print_row(f"prefill {args.prefill}", result["prefill"])

    reserve = args.warmup + args.steps + 1
    steppers = {"transformers": TransformersStepper(hf, ids), "hybridlm eager": HybridStepper(model, ids, reserve,
                                                                                              False)}
    compiled = HybridStepper(model, ids, 2 * reserve, True)
    result["compile_first_step_s_batch1"] = compiled.step(timed=False)
    steppers["hybridlm compiled"] = compiled
    for batch in (1, 16):
        if batch > 1:
            for stepper in steppers.values():
                stepper.expand(batch)
                stepper.times = []
            result["compile_first_step_s_batch16"] = compiled.step(timed=False)
        for index in range(args.warmup + args.steps):
            for stepper in steppers.values():
                stepper.step(timed=index >= args.warmup)
        seconds = {name: s.times for name, s in steppers.items()}
        result[f"decode_batch{batch}"] = timings_row(seconds)
        print_row(f"decode at {args.context}, batch {batch}", result[f"decode_batch{batch}"])
    return result


def timings_row(seconds: dict[str, list[float]]) -> dict:
    row = {name: {"min_ms": Timing.of(s).min_ms, "median_ms": Timing.of(s).median_ms} for name, s in seconds.items()}
    base = row["transformers"]
    for name, t in row.items():
        if name != "transformers":
            t["speedup_min"] = base["min_ms"] / t["min_ms"]
            t["speedup_median"] = base["median_ms"] / t["median_ms"]
    return row


def print_row(what: str, row: dict) -> None:
    cells = "   ".join(f"{name} {t['min_ms']:.1f} / {t['median_ms']:.1f}" +
                       (f" (x{t['speedup_min']:.2f} min, x{t['speedup_median']:.2f} median)" if "speedup_min" in t
                        else "") for name, t in row.items())
    print(f"  {what:<24} ms min / median: {cells}", flush=True)


def plot_speed(result: dict, out: Path) -> str:
    plt = pyplot()
    rows = [("prefill", f"prefill {result['prefill_tokens']}"), ("decode_batch1", "decode b1"),
            ("decode_batch16", "decode b16")]
    rows = [(key, label) for key, label in rows if key in result]
    figure, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3))
    for axis, (key, label) in zip(axes if len(rows) > 1 else [axes], rows):
        names = list(result[key])
        axis.bar(names, [result[key][n]["median_ms"] for n in names], color="tab:blue", label="median")
        axis.scatter(names, [result[key][n]["min_ms"] for n in names], color="black", zorder=3, label="min")
        axis.set_title(label, fontsize=9)
        axis.set_ylabel("ms")
        axis.tick_params(axis="x", labelsize=7, rotation=20)
    axes[0].legend(fontsize=7) if len(rows) > 1 else None
    figure.tight_layout()
    return save_plot(figure, out / "real_model_speed.png")


# --- Markdown tables of a results.json (``--report``) ------------------------------------------------------------


def markdown(results: dict) -> str:
    """One Markdown table per item in ``results`` (what docs/long-context.md shows)."""
    out = []

    def table(head: list[str], rows: list[list]) -> None:
        out.extend(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)])
        out.extend("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
        out.append("")

    if "blocks" in results:
        r = results["blocks"]
        table(["check", "max abs logits difference"],
              [[f"one {r['block']}-token block vs {r['block']} decode steps, {name}", f"{d:.1e}"]
               for name, d in r["block_vs_steps_max_abs_logit_diff"].items()] +
              [["KIVI 4-bit cache written from the fp cache vs prefilled in one chunk",
                f"{r['kivi4_one_chunk_vs_written_max_abs_logit_diff']:.1e}"]])
    if "kivi" in results:
        r = results["kivi"]
        table(["KV", "mean KL(fp ‖ q), nats", "top-1 agreement", "perplexity", "Δ perplexity"],
              [["fp32" if b == "16" else f"{b}-bit", f"{v['kl']:.2e}", f"{v['top1_agreement']:.4f}",
                f"{v['perplexity']:.3f}", f"{v['perplexity_delta']:+.3f}"] for b, v in r["by_bits"].items()])
    if "stream" in results:
        r = results["stream"]
        seg = r["segment"]
        count = len(next(iter(r["policies"].values()))["perplexity"])
        table(["policy", "fed in blocks of"] + [f"{i * seg // 1024}K–" if seg % 1024 == 0 else f"{i * seg}–"
                                                 for i in range(count)],
              [[name, row["block"]] + [f"{p:.2f}" for p in row["perplexity"]] for name, row in r["policies"].items()])
    if "passkey" in results:
        r = results["passkey"]
        cells = {(c["policy"], c["length"], c["depth"]): c["correct"] for c in r["cells"]}
        table(["policy"] + [f"L={length}" for length in r["lengths"]],
              [[name] + ["".join("✓" if cells[name, length, d] else "✗" for d in r["depths"]) +
                         f" ({r['accuracy'][name][str(length)]:.2f})" for length in r["lengths"]]
               for name in r["accuracy"]])
    if "speculative" in results:
        r = results["speculative"]
        rows = []
        for task in r["tasks"]:
            for mode, m in task["modes"].items():
                acceptance = f"{m['acceptance_rate']:.2f}" if "acceptance_rate" in m else "—"
                rows.append([f"{task['file']}:{task['function']} ({task['new_tokens']} tokens)", mode,
                             f"{m['min_s']:.1f} / {m['median_s']:.1f}",
                             f"x{m['speedup_min']:.2f} / x{m['speedup_median']:.2f}", acceptance,
                             f"{m['tokens_per_forward']:.2f}"])
        table(["task", "mode", "s min / median", "speed-up min / median", "acceptance", "tokens / forward"], rows)
    if "prefix" in results:
        r = results["prefix"]
        table(["time to first token", "ms min / median"],
              [[name, f"{1000 * t['min_s']:.0f} / {1000 * t['median_s']:.0f}"] for name, t in r["ttft"].items()] +
              [["speed-up (min / median)", f"x{r['speedup_min']:.1f} / x{r['speedup_median']:.1f}"],
               ["max abs logits difference", f"{r['max_abs_logit_diff']:.1e}"]])
    if "speed" in results:
        r = results["speed"]
        rows = []
        for key, what in (("prefill", f"prefill {r['prefill_tokens']}"), ("decode_batch1", f"decode @{r['context']}, "
                          "batch 1"), ("decode_batch16", f"decode @{r['context']}, batch 16")):
            for name, t in r.get(key, {}).items():
                rows.append([what, name, f"{t['min_ms']:.1f} / {t['median_ms']:.1f}",
                             f"x{t['speedup_min']:.2f} / x{t['speedup_median']:.2f}" if "speedup_min" in t else "—"])
        table(["what", "who", "ms min / median", "transformers / this (min / median)"], rows)
    times = [[item, f"{results[item]['wall_s']:.0f}", results[item]["threads"], results[item]["quick"],
              f"{results[item]['load_average_before'][0]:.1f} → {results[item]['load_average_after'][0]:.1f}"]
             for item in ITEMS if item in results]
    table(["item", "wall s", "threads", "quick", "load average (1 min) before → after"], times)
    return "\n".join(out)


# --- the run -----------------------------------------------------------------------------------------------------

RUNS = {"blocks": (item_blocks, None), "kivi": (item_kivi, plot_kivi), "stream": (item_stream, plot_stream),
        "passkey": (item_passkey, plot_passkey), "speculative": (item_speculative, plot_speculative),
        "prefix": (item_prefix, plot_prefix), "speed": (item_speed, plot_speed)}


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and the PNGs")
    parser.add_argument("--report", action="store_true", help="print Markdown tables of OUT/results.json, run nothing")
    parser.add_argument("--only", nargs="+", choices=ITEMS, help="run these items only (others kept in the JSON)")
    parser.add_argument("--quick", action="store_true", help="shorter stream and passkey, one edit function")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine 2 threads wait on each other)")
    parser.add_argument("--kivi-rows", type=int, default=4)
    parser.add_argument("--kivi-prefill", type=int, default=2048)
    parser.add_argument("--kivi-decode", type=int, default=1024, help="decoded tokens per row (rows x this >= 4K)")
    parser.add_argument("--stream", type=int, help="stream tokens (default 16384, --quick 4096)")
    parser.add_argument("--segment", type=int, help="perplexity stretch (default 1024, --quick 512)")
    parser.add_argument("--window-stream", type=int, help="tokens a bounded policy holds (default 1024, --quick 256)")
    parser.add_argument("--h2o-block", type=int, default=16, help="H2O's block in the stream (no eviction inside)")
    parser.add_argument("--passkey-lengths", type=int, nargs="+",
                        help="prompt lengths (default 1024 2048 4096 8184, --quick 1024 2048 4096)")
    parser.add_argument("--window-passkey", type=int, default=1024)
    parser.add_argument("--edit-functions", type=int, help="edit tasks (default 2, --quick 1)")
    parser.add_argument("--unprimed", action="store_true",
                        help="edit tasks: leave the answer to the model (default: it starts with a code block)")
    parser.add_argument("--max-new", type=int, help="new tokens at most (default: the function's + 48)")
    parser.add_argument("--draft-tokens", type=int, default=10, help="prompt lookup's k (both libraries)")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats of each speculative mode")
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per stepper and batch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before timing")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"stream": (16384, 4096), "segment": (1024, 512), "window_stream": (1024, 256),
                "passkey_lengths": ([1024, 2048, 4096, 8184], [1024, 2048, 4096]), "edit_functions": (2, 1)}
    for name, (full, short) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    args.kivi_bits = [8, 4, 2]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.report:
        print(markdown(json.loads((args.out / "results.json").read_text())))
        return
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if args.only and path.is_file() else {}
    started = time.perf_counter()
    bench = Bench(args)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results["run"] = {"command": " ".join(["python", "benchmarks/real_model_remedies.py", *(argv or sys.argv[1:])]),
                      "threads": torch.get_num_threads(), "torch": torch.__version__, "settings": settings,
                      "cpu_count": os.cpu_count(), "load_average_at_start": load_average()}
    print(f"SmolLM2-135M-Instruct, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load_average()}", flush=True)
    for item in args.only or ITEMS:
        run, plot = RUNS[item]
        print(f"[{item}]", flush=True)
        before, item_started = load_average(), time.perf_counter()
        out = run(bench)
        out.update(wall_s=time.perf_counter() - item_started, load_average_before=before,
                   load_average_after=load_average(), quick=args.quick, threads=torch.get_num_threads())
        if plot is not None:
            out["plot"] = plot(out, args.out)
        results[item] = out
        results["run"]["wall_s"] = time.perf_counter() - started
        write_file(path, json.dumps(results, indent=1))
        print(f"[{item}] {out['wall_s']:.0f} s (load average {before[0]:.1f} -> {out['load_average_after'][0]:.1f})",
              flush=True)
    print(f"total {time.perf_counter() - started:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
