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
import json
import os
import sys
import time
from pathlib import Path

import torch

from hybridlm.files import write_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from remedies.cache_policies import item_blocks, item_kivi, item_stream, plot_kivi, plot_stream  # noqa: E402
from remedies.common import ITEMS, Bench, load_average  # noqa: E402
from remedies.decoding import item_prefix, item_speculative, plot_prefix, plot_speculative  # noqa: E402
from remedies.passkey import item_passkey, plot_passkey  # noqa: E402
from remedies.report import markdown  # noqa: E402
from remedies.speed import item_speed, plot_speed  # noqa: E402

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
