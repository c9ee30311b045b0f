"""bf16 against fp32 on the CPU, on the same weights: quality (held-out next-token KL and greedy agreement) and
decode speed.

For each model (the bundled ``hybrid``, hybrid-tiny; ``smollm2``, SmolLM2-135M-Instruct once ``real_model.py fetch`` has
run) it loads the fp32 model and the same checkpoint with ``dtype=torch.bfloat16``, then

* over ``--tokens`` held-out tokens (the held-out split of hybridlm's training corpus), the mean next-token
  KL(fp32 || bf16) in nats and the share of positions where the two pick the same next token;
* the greedy continuation (``generate``) of the first 64 of them for ``--new-tokens`` tokens: how many leading
  tokens the two agree on;
* decode ms/token after a ``--context``-token prefill, eager :class:`~hybridlm.decoding.decode_step.DecodeStep`,
  the two dtypes taking turns step by step (so machine load affects both alike), min and median, and the ratio
  fp32 / bf16 (> 1: bf16 is faster); with ``--compiled``, the compiled steps of both dtypes (static caches) too,
  all four taking turns.

    python benchmarks/bf16_cpu.py [--models hybrid smollm2] [--threads 1] [--context 256] [--compiled]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hybridlm  # noqa: E402
from hybridlm.decoding.decode_step import DecodeStep  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import held_out_code, require_model  # noqa: E402


def directory_of(name: str) -> Path:
    return require_model()[1] if name == "smollm2" else hybridlm.bundled_model_dir(name)


@torch.inference_mode()
def quality(models: dict, ids: torch.Tensor, new_tokens: int, reference: str = "fp32", other: str = "bf16") -> dict:
    """KL(reference || other) per held-out token, the share of equal next tokens, and how many leading greedy
    tokens after the first 64 of ``ids`` the two models agree on."""
    ref, out = (models[label](ids).logits.float().log_softmax(-1) for label in (reference, other))
    kl = (ref.exp() * (ref - out)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    prompt = ids[:, :64]
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    a, b = (models[label].generate(prompt, **settings)[0, 64:] for label in (reference, other))
    differ = (a != b).nonzero()
    return {"kl": kl, "top1": top1, "greedy_prefix": int(differ[0]) if len(differ) else new_tokens}


@torch.inference_mode()
def decode_times(models: dict, prompt: torch.Tensor, warmup: int, steps: int, compiled: tuple[str, ...] = ()) -> dict:
    """ms/token (min, median) of each model's decode step after ``prompt``, the models taking turns step by step;
    the labels in ``compiled`` run a compiled step on a static cache."""
    runs = {}
    for label, model in models.items():
        cache = model.new_cache(1, max_length=prompt.shape[1] + warmup + steps + 1, static=label in compiled)
        token = model(prompt, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
        runs[label] = [DecodeStep(model, compile=label in compiled), cache, token, []]
    for index in range(warmup + steps):
        for run in runs.values():
            step, cache, token, times = run
            start = time.perf_counter()
            logits = step(token, cache)
            elapsed = time.perf_counter() - start
            run[2] = logits.argmax(-1)
            if index >= warmup:
                times.append(1000 * elapsed)
    return {label: (min(run[3]), statistics.median(run[3])) for label, run in runs.items()}


def parse_args(description: str, compiled_only: bool = False) -> argparse.Namespace:
    """The options this benchmark and ``int8_cpu.py`` share: models, held-out tokens, greedy tokens, context,
    warm-up and timed steps, threads; ``compiled_only``: a ``--compiled-only`` flag instead of ``--compiled``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", default=["hybrid", "smollm2"])
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens for the KL and top-1 agreement")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    if compiled_only:
        parser.add_argument("--compiled-only", action="store_true", help="time the compiled steps alone")
    else:
        parser.add_argument("--compiled", action="store_true", help="also time each dtype's compiled step")
    return parser.parse_args()


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, context {args.context}, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    from transformers import AutoTokenizer

    for name in args.models:
        directory = directory_of(name)
        models = {"fp32": hybridlm.HybridForCausalLM.from_pretrained(directory).eval(),
                  "bf16": hybridlm.HybridForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()}
        tokenizer = AutoTokenizer.from_pretrained(directory)
        ids = torch.tensor([held_out_code(tokenizer, max(args.tokens, args.context))])
        q = quality(models, ids[:, :args.tokens], args.new_tokens)
        timed = dict(models)
        if args.compiled:
            timed |= {f"{label} compiled": model for label, model in models.items()}
        t = decode_times(timed, ids[:, :args.context], args.warmup, args.steps,
                         compiled=("fp32 compiled", "bf16 compiled"))
        speeds = ", ".join(f"{label} {low:.2f} / {median:.2f}" for label, (low, median) in t.items())
        ratios = ", ".join(f"{kind.strip() or 'eager'} x{t[f'fp32{kind}'][1] / t[f'bf16{kind}'][1]:.2f}"
                           for kind in ("", " compiled") if f"fp32{kind}" in t)
        print(f"{name}: KL(fp32 || bf16) {q['kl']:.2e} nats/token over {args.tokens} held-out tokens, same next "
              f"token {100 * q['top1']:.1f}%, greedy {q['greedy_prefix']}/{args.new_tokens} tokens identical; "
              f"decode ms/token min / median: {speeds}; fp32 / bf16 (median): {ratios}", flush=True)


if __name__ == "__main__":
    main()
