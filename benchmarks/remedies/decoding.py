"""The decoding items: ``speculative`` (prompt lookup on an edit task, against transformers') and ``prefix``
(time to first token with a prefix-cache hit)."""

from __future__ import annotations

import ast
import builtins
import time
from pathlib import Path

import torch
from real_model import held_out_code

from hybridlm import PrefixCache, SpeculativeDecoding
from hybridlm.decoding.bench import Timing
from hybridlm.decoding.incremental import IncrementalDecoder
from remedies.common import (
    Bench,
    pyplot,
    save_plot,
)


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
