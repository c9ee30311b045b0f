"""What quantized recurrent states cost on a hybrid (``python benchmarks/state_quant.py [--model DIR]``; default the
bundled hybrid-tiny).

For fp32 states and each of int8 / fp8 x nearest / stochastic / feedback (``CachePolicy(state_bits=...)``), on
held-out stdlib text (``--rows`` consecutive stretches of it, as one batch) decoded one token at a time (so every
token's state is written quantized):

* mean next-token KL(fp32 || quantized) over the whole stream, and per stretch of it (drift with decode length);
* held-out bits per byte;
* the recurrent-state bytes per request and the whole cache's at the end of a row;
* decode ms/token, all settings timed interleaved in rounds of a few tokens each (min and median over rounds),
  at the thread count printed.

``--json PATH`` keeps every figure (and the KL per stretch), ``--plot PATH`` draws the drift: mean KL per stretch
against the tokens decoded, one line per setting.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from hybridlm import CachePolicy
from hybridlm.bundled import bundled_model_dir
from hybridlm.cache.quantized_state import QuantizedState
from hybridlm.files import write_file, written_aside
from hybridlm.model import load
from hybridlm.training.corpus import stdlib_corpus
from hybridlm.training.tokenizer import tokenizer_for


def settings(windows: str) -> dict[str, CachePolicy | None]:
    """fp32, then int8 and fp8 x nearest / stochastic / feedback, with the windows quantized (``on``), kept
    (``off``: named "... ssm only") or both."""
    chosen = {"fp32": None}
    for quantize_windows in {"on": [True], "off": [False], "both": [True, False]}[windows]:
        for bits in (8, "fp8"):
            for rounding in ("nearest", "stochastic", "feedback"):
                name = f"{'int8' if bits == 8 else 'fp8'} {rounding}{'' if quantize_windows else ', ssm only'}"
                chosen[name] = CachePolicy(state_bits=bits, state_rounding=rounding, state_windows=quantize_windows)
    return chosen


@torch.no_grad()
def decode(model, ids: torch.Tensor, policy) -> tuple[torch.Tensor, object]:
    """Log-probabilities ``[rows, time - 1, vocab]`` of ``ids [rows, time]`` fed one token at a time, and the
    cache."""
    cache = model.new_cache(ids.shape[0], policy=policy)
    out = [model(ids[:, t:t + 1], cache=cache).logits[:, -1].float().log_softmax(-1) for t in range(ids.shape[1] - 1)]
    return torch.stack(out, 1), cache


def state_bytes(cache) -> int:
    return sum(s.nbytes() for kind, s in zip(cache.layer_types, cache.states) if kind != "attention")


@torch.no_grad()
def timings(model, ids: torch.Tensor, chosen: dict, rounds: int, tokens: int) -> dict[str, tuple[float, float]]:
    """ms/token per setting: each round decodes ``tokens`` tokens under every setting in turn."""
    caches = {name: model.new_cache(1, policy=policy) for name, policy in chosen.items()}
    for cache in caches.values():
        model(ids[:, :64], cache=cache)
    samples = {name: [] for name in chosen}
    for r in range(rounds):
        for name, cache in caches.items():
            start = time.perf_counter()
            for t in range(tokens):
                model(ids[:, 64 + r * tokens + t:65 + r * tokens + t], cache=cache)
            samples[name].append(1000 * (time.perf_counter() - start) / tokens)
    return {name: (min(v), statistics.median(v)) for name, v in samples.items()}


def plot_drift(results: dict, path: str) -> None:
    """Mean KL per stretch against the tokens decoded at its end, log scale, one line per quantized setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colours = plt.get_cmap("tab10").colors
    ends = [end for _, end in results["stretches"]]
    for name, row in results["settings"].items():
        if name != "fp32":  # a colour per format and rounding; dotted: the windows kept unquantized
            setting = name.removesuffix(", ssm only")
            colour = colours[[f"{bits} {rounding}" for bits in ("int8", "fp8")
                              for rounding in ("nearest", "stochastic", "feedback")].index(setting)]
            ax.plot(ends, row["stretch_kl"], ("o" if "int8" in name else "s") + (":" if "only" in name else "-"),
                    color=colour, label=name, markersize=4)
    ax.set_yscale("log")
    ax.set_xlabel("tokens decoded (end of the stretch)")
    ax.set_ylabel("mean KL(fp32 || quantized) per stretch")
    ax.set_title(f"{results['model']}: quantized recurrent states, drift", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with written_aside(path) as temporary:
        fig.savefig(temporary, dpi=80, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a hybridlm checkpoint directory with its tokenizer (default: hybrid-tiny)")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens decoded per setting")
    parser.add_argument("--rows", type=int, default=4, help="consecutive stretches of the stream decoded as a batch")
    parser.add_argument("--stretch", type=int, default=256, help="tokens per stretch of the drift columns")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--windows", choices=["on", "off", "both"], default="on",
                        help="quantize the conv windows (and Mamba-3's previous input) too, keep them, or both")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--plot", help="draw the drift here (PNG; needs matplotlib)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    directory = args.model or bundled_model_dir("hybrid")  # hybrid-tiny: the trained 1:3 hybrid
    model = load(directory, dtype=torch.float32).eval()
    tokenizer = tokenizer_for(directory, model.config.vocab_size)
    text = "\n".join(stdlib_corpus().held_out_texts)
    length = args.tokens // args.rows + 1
    stream = tokenizer(text, add_special_tokens=False)["input_ids"][:args.rows * length]
    if len(stream) < args.rows * length:
        raise SystemExit(f"--tokens {args.tokens}: the held-out text has only {len(stream)} tokens")
    ids = torch.tensor(stream).view(args.rows, length)
    targets = ids[:, 1:]
    text_bytes = sum(len(tokenizer.decode(row.tolist()).encode("utf-8")) for row in targets)
    name = "hybrid-tiny" if args.model is None else str(args.model)
    print(f"{name}, {targets.numel()} held-out tokens ({text_bytes} bytes; {args.rows} rows of {length - 1}) "
          f"decoded one at a time, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    reference, reference_cache = decode(model, ids, None)
    stretches = [(s, min(s + args.stretch, length - 1)) for s in range(0, length - 1, args.stretch)]
    header = " | ".join(f"KL tokens {s}-{end}" for s, end in stretches)
    chosen = settings(args.windows)
    speed = timings(model, torch.tensor([stream]), chosen, args.rounds, 8)
    results = {"model": name, "tokens": targets.numel(), "rows": args.rows, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "stretches": stretches, "settings": {}}
    print(f"| setting | mean KL | {header} | bits/byte | state B/request | cache B/request at end | "
          "ms/token min | median |")
    print("|---" * (8 + len(stretches)) + "|")
    for setting, policy in chosen.items():
        logprobs, cache = (reference, reference_cache) if policy is None else decode(model, ids, policy)
        kl = F.kl_div(logprobs, reference, log_target=True, reduction="none").sum(-1)
        nll = -logprobs.gather(-1, targets[..., None])[..., 0]
        bpb = nll.sum().item() / math.log(2) / text_bytes
        per_stretch = [kl[:, s:end].mean().item() for s, end in stretches]
        quantized = [s for s in cache.states if isinstance(s, QuantizedState)]
        assert all(s.nbytes() == s.predicted_nbytes() for s in quantized)
        low, median = speed[setting]
        row = dict(mean_kl=kl.mean().item(), stretch_kl=per_stretch, bits_per_byte=bpb,
                   state_bytes_per_request=state_bytes(cache) // args.rows,
                   cache_bytes_per_request=cache.nbytes() // args.rows, ms_per_token=[low, median])
        results["settings"][setting] = row
        drift = " | ".join(f"{value:.2e}" for value in per_stretch)
        print(f"| {setting} | {row['mean_kl']:.2e} | {drift} | {bpb:.4f} | {row['state_bytes_per_request']:,} | "
              f"{row['cache_bytes_per_request']:,} | {low:.2f} | {median:.2f} |", flush=True)
        if args.json:
            write_file(args.json, json.dumps(results, indent=1))
    if args.plot:
        plot_drift(results, args.plot)


if __name__ == "__main__":
    main()
