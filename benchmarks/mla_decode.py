"""MLA decode: the expanded form against attention in latent space, side by side in one run.

A stack of ``--layers`` MLA mixers shaped like Kimi Linear's (its per-head widths: kv_lora_rank 512, nope 128,
rope 64, v 128, no RoPE; ``--heads`` heads, ``--hidden`` wide), each holding a cache of ``--contexts`` tokens (random
normed latents written into the cache: decode time does not depend on their values, and no prefill is needed).
One decode step (batch 1) through the stack, then a rewind of the token it added, ``--warmup`` untimed steps, then
min / median ms of ``--repeats``; the two forms alternate step by step, so that both see the same load. Bytes:
the per-token tensors a step must at least touch over the cache, counted from their shapes: the latent form reads
the latent twice (scores, then values: ``2·rank + rope`` elements per token); the expanded form reads it once and
writes and reads back per-head keys and values (``rank + rope + 2·heads·(nope + rope + v)``).

    python benchmarks/mla_decode.py [--contexts 1024 4096 16384] [--hidden 512] [--heads 8] [--layers 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridlm import HybridConfig
from hybridlm.decoding.bench import Timing
from hybridlm.mixers import MIXERS

KIMI_WIDTHS = dict(mla_kv_lora_rank=512, mla_qk_nope_head_dim=128, mla_qk_rope_head_dim=64, mla_v_head_dim=128,
                   mla_q_lora_rank=None, mla_rope=False)


def warm_stack(config, context: int, dtype) -> list:
    """``(mixer, state)`` per layer, each cache holding ``context`` latents (RMS-normed like the real ones)."""
    stack = []
    for layer in range(config.num_hidden_layers):
        mixer = MIXERS["mla"](config, layer).to(dtype).eval()
        state = mixer.init_state(1, max_length=context + 1, dtype=dtype)
        latent = torch.randn(1, 1, context, mixer.rank + mixer.rope, dtype=dtype)
        latent[..., : mixer.rank] = mixer.kv_a_layernorm(latent[..., : mixer.rank])
        state.update(latent, None, None, None, None)
        stack.append((mixer, state))
    return stack


def decode_step(stack, x, latent: bool) -> None:
    """One token through every layer in the given form, then the token taken back out of each cache."""
    for mixer, state in stack:
        mixer.latent_attention = latent
        x = x + mixer(x, state)
    for _, state in stack:
        state.rewind(1)


def bytes_per_step(mixer, context: int, element: int, latent: bool) -> int:
    per_token = (2 * mixer.rank + mixer.rope if latent else
                 mixer.rank + mixer.rope + 2 * mixer.heads * (mixer.nope + mixer.rope + mixer.v_dim))
    return context * per_token * element


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = HybridConfig(layer_types=["mla"] * args.layers, hidden_size=args.hidden,
                          num_attention_heads=args.heads, **KIMI_WIDTHS)
    torch.manual_seed(0)
    print(f"MLA decode, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, rank 512 + rope 64, "
          f"nope/v 128; {args.dtype}, batch 1, {args.threads} thread(s); ms per token min / median")
    print(f"{'context':>8} {'expanded':>17} {'latent':>17} {'speed-up min / median':>22} {'MB/step expanded':>17} "
          f"{'MB/step latent':>15}")
    for context in args.contexts:
        stack = warm_stack(config, context, dtype)
        x = torch.randn(1, 1, args.hidden, dtype=dtype)
        seconds = {False: [], True: []}
        with torch.no_grad():
            for repeat in range(args.warmup + args.repeats):
                for latent in (False, True):
                    begin = time.perf_counter()
                    decode_step(stack, x, latent)
                    if repeat >= args.warmup:
                        seconds[latent].append(time.perf_counter() - begin)
        expanded, latent = Timing.of(seconds[False]), Timing.of(seconds[True])
        element = torch.empty(0, dtype=dtype).element_size()
        megabytes = [args.layers * bytes_per_step(stack[0][0], context, element, form) / 2**20 for form in (0, 1)]
        print(f"{context:>8} {format(expanded, '.2f'):>17} {format(latent, '.2f'):>17} "
              f"{expanded.min_ms / latent.min_ms:>13.1f}x / {expanded.median_ms / latent.median_ms:.1f}x "
              f"{megabytes[0]:>17.1f} {megabytes[1]:>15.1f}")


if __name__ == "__main__":
    main()
