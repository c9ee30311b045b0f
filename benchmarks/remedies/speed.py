"""The ``speed`` item: prefill and decode against transformers on the same weights."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from real_model import held_out_code

from hybridlm.decoding.bench import Timing
from hybridlm.decoding.incremental import IncrementalDecoder
from remedies.common import (
    Bench,
    pyplot,
    save_plot,
)


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
