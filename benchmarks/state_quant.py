"""What quantized recurrent states cost on the bundled hybrid-tiny (``python benchmarks/state_quant.py``).

For fp32 states and each of int8 / fp8 x nearest / stochastic / feedback (``CachePolicy(state_bits=...)``), on
held-out stdlib text (``--rows`` consecutive stretches of it, as one batch) decoded one token at a time (so every
token's state is written quantized):

* mean next-token KL(fp32 || quantized) over the whole stream, and per stretch of it (drift with decode length);
* held-out bits per byte;
* the recurrent-state bytes per request and the whole cache's at the end of a row;
* decode ms/token, all settings timed interleaved in rounds of a few tokens each (min and median over rounds),
  at the thread count printed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from hybridlm import CachePolicy
from hybridlm.bundled import bundled_model_dir
from hybridlm.cache.quantized_state import QuantizedState
from hybridlm.model import load
from hybridlm.training.corpus import stdlib_corpus
from hybridlm.training.tokenizer import tokenizer_for

SETTINGS = {"fp32": None, **{f"{'int8' if bits == 8 else 'fp8'} {rounding}": CachePolicy(state_bits=bits,
                                                                                          state_rounding=rounding)
                             for bits in (8, "fp8") for rounding in ("nearest", "stochastic", "feedback")}}


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
def timings(model, ids: torch.Tensor, rounds: int, tokens: int) -> dict[str, tuple[float, float]]:
    """ms/token per setting: each round decodes ``tokens`` tokens under every setting in turn."""
    caches = {name: model.new_cache(1, policy=policy) for name, policy in SETTINGS.items()}
    for cache in caches.values():
        model(ids[:, :64], cache=cache)
    samples = {name: [] for name in SETTINGS}
    for r in range(rounds):
        for name, cache in caches.items():
            start = time.perf_counter()
            for t in range(tokens):
                model(ids[:, 64 + r * tokens + t:65 + r * tokens + t], cache=cache)
            samples[name].append(1000 * (time.perf_counter() - start) / tokens)
    return {name: (min(v), statistics.median(v)) for name, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens decoded per setting")
    parser.add_argument("--rows", type=int, default=4, help="consecutive stretches of the stream decoded as a batch")
    parser.add_argument("--stretch", type=int, default=256, help="tokens per stretch of the drift columns")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    directory = bundled_model_dir("hybrid")  # hybrid-tiny: the trained 1:3 hybrid
    model = load(directory, dtype=torch.float32).eval()
    tokenizer = tokenizer_for(directory, model.config.vocab_size)
    text = "\n".join(stdlib_corpus().held_out_texts)
    length = args.tokens // args.rows + 1
    stream = tokenizer(text, add_special_tokens=False)["input_ids"][:args.rows * length]
    ids = torch.tensor(stream).view(args.rows, length)
    targets = ids[:, 1:]
    text_bytes = sum(len(tokenizer.decode(row.tolist()).encode("utf-8")) for row in targets)
    print(f"hybrid-tiny, {targets.numel()} held-out tokens ({text_bytes} bytes; {args.rows} rows of {length - 1}) "
          f"decoded one at a time, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    reference, reference_cache = decode(model, ids, None)
    stretches = range(0, length - 1, args.stretch)
    header = " | ".join(f"KL tokens {s}-{min(s + args.stretch, length - 1)}" for s in stretches)
    speed = timings(model, torch.tensor([stream]), args.rounds, 8)
    print(f"| setting | mean KL | {header} | bits/byte | state B/request | cache B/request at end | "
          "ms/token min | median |")
    print("|---" * (8 + len(stretches)) + "|")
    for name, policy in SETTINGS.items():
        logprobs, cache = (reference, reference_cache) if policy is None else decode(model, ids, policy)
        kl = F.kl_div(logprobs, reference, log_target=True, reduction="none").sum(-1)
        nll = -logprobs.gather(-1, targets[..., None])[..., 0]
        bpb = nll.sum().item() / math.log(2) / text_bytes
        drift = " | ".join(f"{kl[:, s:s + args.stretch].mean().item():.2e}" for s in stretches)
        quantized = [s for s in cache.states if isinstance(s, QuantizedState)]
        assert all(s.nbytes() == s.predicted_nbytes() for s in quantized)
        low, median = speed[name]
        print(f"| {name} | {kl.mean().item():.2e} | {drift} | {bpb:.4f} | {state_bytes(cache) // args.rows:,} | "
              f"{cache.nbytes() // args.rows:,} | {low:.2f} | {median:.2f} |", flush=True)


if __name__ == "__main__":
    main()
