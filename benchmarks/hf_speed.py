"""hybridlm against transformers on the CPU: the same weights, the same input, side by side in one run.

For a Jamba-, a Mamba-2-, a Bamba- and a Qwen3-Next-shaped model of a few million parameters, built by
transformers with a fixed seed and loaded by hybridlm from the directory transformers wrote, it measures

* prefill: one cached forward over ``--prefill`` tokens (2048), logits of the last token only;
* decode: ms per token of single-token steps after a ``--context``-token (4096) prompt,

after ``--warmup`` untimed runs of each, and prints min / median and the ratios of medians and of minima,
transformers / hybridlm (> 1: hybridlm is faster). The two libraries take turns (prefill by prefill, decode step by
decode step), so that a change in machine load affects both alike.

    python benchmarks/hf_speed.py [--models jamba mamba2 bamba qwen3_next] [--prefill 2048] [--context 4096]
                                  [--threads 1]

On a machine shared with other jobs, ``--threads 1`` gives far steadier numbers: with more threads than free
cores, both libraries' many small ops wait on each other's threads.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers

import hybridlm
from hybridlm.decoding.bench import Timing

VOCAB = 1024


def jamba() -> transformers.PreTrainedModel:
    """8 layers (attention at 4), top-2 MoE over 4 experts every other layer: 11.6M parameters."""
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=16,
    ))


def mamba2() -> transformers.PreTrainedModel:
    """8 Mamba-2 layers, 8 heads of 64, 2 groups of state 64: 4.2M parameters."""
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=8, state_size=64, num_heads=8, head_dim=64, n_groups=2,
        chunk_size=256,
    ))


def bamba() -> transformers.PreTrainedModel:
    """8 layers (attention at 3 and 7) with SwiGLU MLPs: 6.8M parameters."""
    return transformers.BambaForCausalLM(transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, attn_layer_indices=[3, 7], mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64,
        mamba_n_groups=2, mamba_chunk_size=256,
    ))


def qwen3_next() -> transformers.PreTrainedModel:
    """8 layers, Gated DeltaNet : gated attention 3:1 (4 key / 8 value heads of 64), top-2 MoE over 4 experts with a
    gated shared expert in every layer."""
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    ))


MODELS = {"jamba": jamba, "mamba2": mamba2, "bamba": bamba, "qwen3_next": qwen3_next}


def prefill_seconds(model, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


class Decoder:
    """Single-token steps after a prompt, timed one at a time (so two decoders can take turns)."""

    def __init__(self, model, ids: torch.Tensor):
        self.model = model
        out = model(ids, use_cache=True, logits_to_keep=1)
        self.cache, self.token, self.position = out.cache, out.logits[:, -1:].argmax(-1), ids.shape[1]
        self.times: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        out = self.model(self.token, cache=self.cache, use_cache=True, position_ids=torch.tensor([[self.position]]))
        self.times.append(time.perf_counter() - start)
        self.cache, self.token, self.position = out.cache, out.logits[:, -1:].argmax(-1), self.position + 1


def compare(name: str, prefill: int, context: int, repeats: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    theirs = MODELS[name]().eval()
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        ours = hybridlm.HybridForCausalLM.from_pretrained(directory).eval()
    params = sum(p.numel() for p in ours.parameters()) / 1e6
    ids = torch.randint(1, VOCAB, (1, max(prefill, context)), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        diff = (theirs(ids[:, :256]).logits - ours(ids[:, :256]).logits).abs().max().item()
        pre = {"hybridlm": [], "transformers": []}
        for _ in range(warmup + repeats):
            for label, model in (("hybridlm", ours), ("transformers", theirs)):
                pre[label].append(prefill_seconds(model, ids[:, :prefill]))
        decoders = {label: Decoder(model, ids[:, :context]) for label, model in (("hybridlm", ours),
                                                                                 ("transformers", theirs))}
        for _ in range(warmup + steps):
            for decoder in decoders.values():
                decoder.step()
    return {"model": name, "params_M": params, "max_logit_diff": diff,
            "prefill": {label: Timing.of(times[warmup:]) for label, times in pre.items()},
            "decode": {label: Timing.of(decoder.times[warmup:]) for label, decoder in decoders.items()}}


def report(row: dict, prefill: int, context: int) -> None:
    print(f"{row['model']:>7} ({row['params_M']:.1f}M params, max |logits diff| {row['max_logit_diff']:.1e}); "
          "ms min / median")
    for what, timings in ((f"prefill {prefill:>5} tokens", row["prefill"]), (f"decode at {context:>5}", row["decode"])):
        ours, theirs = timings["hybridlm"], timings["transformers"]
        print(f"        {what:<20} hybridlm {ours:8.2f}   transformers {theirs:8.2f}   speed-up "
              f"x{theirs.median_ms / ours.median_ms:.2f} (medians), x{theirs.min_ms / ours.min_ms:.2f} (minima)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="timed prefill repetitions")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed prefills and decode steps before timing")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    for name in args.models:
        report(compare(name, args.prefill, args.context, args.repeats, args.steps, args.warmup), args.prefill,
               args.context)


if __name__ == "__main__":
    main()
