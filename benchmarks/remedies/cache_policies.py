"""The cache-policy items: ``blocks`` (64-token forwards read as decode steps), ``kivi`` (quantized keys and
values) and ``stream`` (perplexity past the context under the bounded policies)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from real_model import held_out_code

from hybridlm import CachePolicy
from remedies.common import (
    BLOCK,
    Bench,
    eviction_policies,
    logprobs,
    prefill,
    pyplot,
    quantized_copy,
    save_plot,
    teacher_forced,
)


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
