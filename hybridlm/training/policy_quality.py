"""What a cache policy costs in quality, measured on a trained model (``python -m hybridlm.training.policy_quality``).

* :func:`kl_by_bits`: next-token KL divergence of quantized KV from the full-precision cache, teacher-forced:
  prefill in chunks, then decode token by token, both caches fed the same tokens.
* :func:`perplexity_by_policy`: perplexity over a long stream decoded one token at a time (so sinks + window
  keep their in-cache positions), per window of the stream, for each policy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridlm.cache.kv.policy import CachePolicy


@torch.no_grad()
def _decode_logits(model, ids: torch.Tensor, policy, prefill: int, chunk: int = 256) -> torch.Tensor:
    """Log-probabilities ``[time - prefill, vocab]`` of tokens ``prefill..`` decoded one at a time after a
    chunked prefill of the first ``prefill`` tokens (``ids [1, time]``)."""
    cache = model.new_cache(1, policy=policy)
    out = [model(ids[:, start:min(start + chunk, prefill)], cache=cache).logits[:, -1:]
           for start in range(0, prefill, chunk)][-1:]
    for t in range(prefill, ids.shape[1] - 1):
        out.append(model(ids[:, t:t + 1], cache=cache).logits)
    logits = torch.cat(out, 1)[0]
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)


def kl_by_bits(model, ids: torch.Tensor, prefill: int, bits=(8, 4, 2), **policy) -> dict[int, float]:
    """Mean KL(full precision || quantized) of the next-token distributions after ``prefill`` tokens."""
    reference = _decode_logits(model, ids, None, prefill)
    result = {}
    for b in bits:
        quantized = _decode_logits(model, ids, CachePolicy(kv_bits=b, **policy), prefill)
        result[b] = F.kl_div(quantized, reference, log_target=True, reduction="batchmean").item()
    return result


def perplexity_by_policy(model, ids: torch.Tensor, policies: dict, segment: int) -> dict[str, list[float]]:
    """Perplexity of each ``segment``-token stretch of ``ids [1, time]`` (decoded one token at a time)."""
    targets = ids[0, 1:]
    result = {}
    for name, policy in policies.items():
        logprobs = _decode_logits(model, ids, policy, prefill=1)
        nll = -logprobs.gather(-1, targets[:, None])[:, 0]
        result[name] = [math.exp(nll[s:s + segment].mean().item()) for s in range(0, nll.shape[0], segment)]
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    from hybridlm.bundled import BUNDLED_MODELS, bundled_model_dir
    from hybridlm.model import load
    from hybridlm.training.corpus import stdlib_corpus
    from hybridlm.training.tokenizer import tokenizer_for

    parser = argparse.ArgumentParser(description="KV cache policies' quality cost on a bundled model")
    parser.add_argument("--model", choices=list(BUNDLED_MODELS), default="hybrid")
    parser.add_argument("--skip-kl", action="store_true", help="only the perplexity by policy")
    args = parser.parse_args(argv)
    directory = bundled_model_dir(args.model)
    model = load(directory, dtype=torch.float32).eval()
    tokenizer = tokenizer_for(directory, model.config.vocab_size)
    text = "\n".join(stdlib_corpus().held_out_texts)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:4096]])
    if not args.skip_kl:
        print("KL from the full-precision cache, 4K context (prefill 3840, then 256 decoded):")
        print(kl_by_bits(model, ids, prefill=3840, kv_group_size=32, kv_residual=128))
    policies = {"full": None, "window 256": CachePolicy(window=256),
                "sinks 4 + window 252": CachePolicy(sink_tokens=4, window=252),
                "h2o 128 + window 128": CachePolicy(heavy_hitters=128, window=128)}
    print("perplexity per 512 tokens of a 4096-token stream (trained at 512):")
    for name, values in perplexity_by_policy(model, ids, policies, 512).items():
        print(name, " ".join(f"{v:.2f}" for v in values), flush=True)


if __name__ == "__main__":
    main()
