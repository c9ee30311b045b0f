"""The ``hybridlm`` subcommands that try, inspect and measure models: ``demo``, ``info``, ``build-kernels``,
``bench`` and ``memory`` (registered on import, in that order, by :mod:`hybridlm.cli`)."""

from __future__ import annotations

import contextlib

from hybridlm.cli.common import KV_BITS, command, print_stream
from hybridlm.options import non_negative_float, non_negative_int, option, positive_int
from hybridlm.paths import existing_config
from hybridlm.presets import PRESETS  # names and settings only: no torch

DEFAULT_PRESET = "jamba-small"


def _build(config, seed: int = 0, device: str | None = None):
    """A randomly initialised causal LM of ``config`` (seeded), in eval mode; on ``device="meta"`` its tensors have
    shapes but no storage (enough to count parameters and cache bytes)."""
    import torch

    from hybridlm.model import HybridForCausalLM

    torch.manual_seed(seed)
    with torch.device(device) if device else contextlib.nullcontext():
        return HybridForCausalLM(config).eval()


def _config_from(path: str):
    """The HybridConfig of a ``config.json``, or of the one in a checkpoint directory (any supported format)."""
    file = existing_config(path, "--config")  # a mistyped path fails before torch loads
    from hybridlm.formats.base import read_config, to_hybrid_config

    return to_hybrid_config(read_config(file))


@command(
    "demo", "The bundled 1:3 hybrid writes Python; then it and its all-attention twin side by side: held-out "
            "bits per byte, cache bytes per token and decode speed at long contexts.",
    option("--prompt", default="def fibonacci(n):\n", help="Python code for the hybrid to continue"),
    option("--max-new-tokens", type=non_negative_int, default=96, help="tokens to generate"),
    option("--contexts", type=positive_int, nargs="+", default=[4096, 32768], help="contexts of the decode timing"),
    option("--eval-rows", type=positive_int, default=16, help="held-out rows of 512 tokens for bits per byte"),
    option("--steps", type=positive_int, default=8, help="decode steps timed per model and context"),
    option("--warmup", type=non_negative_int, default=2, help="untimed decode steps before timing"),
    option("--threads", type=positive_int, default=1,
           help="torch threads for the decode timing (1 is steadiest on a shared machine)"),
)
def run_demo(args) -> None:
    from hybridlm.bundled import BUNDLED_MODELS, load_bundled
    from hybridlm.decoding.bench import compare_stacks, speedup_verdict, table
    from hybridlm.training import stdlib_corpus
    from hybridlm.training.evaluation import HeldOut

    loaded = {name: load_bundled(name) for name in BUNDLED_MODELS}
    model, tokenizer = loaded["hybrid"]
    print(f"hybridlm demo: the bundled hybrid ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"layers {'/'.join(model.config.layer_types)}) continues a prompt, greedy:\n")
    print(args.prompt, end="", flush=True)
    print_stream(model, tokenizer, tokenizer(args.prompt, add_special_tokens=False)["input_ids"],
                 [tokenizer.eos_token_id], dict(max_new_tokens=args.max_new_tokens))
    held_out = HeldOut.of(tokenizer, stdlib_corpus().held_out_texts, 512)
    rows = compare_stacks({name: m for name, (m, _) in loaded.items()}, args.contexts, steps=args.steps,
                          warmup=args.warmup, threads=args.threads)
    for row, (m, _) in zip(rows, loaded.values()):
        row["bits_per_byte"] = held_out.evaluate(m, "stream", args.eval_rows)["bits_per_byte"]
        row["parameters"] = sum(p.numel() for p in m.parameters()) / 1e6
    columns = [("stack", "model", ""), ("parameters", "M params", ".2f"),
               ("bits_per_byte", "held-out bits/byte", ".3f"), ("bytes_per_token", "cache B/token", ",.0f")]
    columns += [(c, f"decode ms/token @{c // 1024}K", ".2f") for c in args.contexts]
    print(f"\nHeld-out: the first {args.eval_rows} x 512 tokens of the standard-library files the models never saw; "
          f"decode: batch 1, {args.threads} thread(s), {args.warmup} warm-up steps, then min / median of "
          f"{args.steps}, the two models' steps interleaved.")
    print(table(rows, columns))
    hybrid, attention = rows
    print(f"\nThe hybrid holds {attention['bytes_per_token'] / hybrid['bytes_per_token']:.1f}x fewer cache bytes per "
          "token. " + speedup_verdict({c: attention[c] for c in args.contexts}, {c: hybrid[c] for c in args.contexts})
          + " Models this small hide the gain at short contexts, where per-token work (projections, MLPs, Python) "
          "costs more than reading the cache.")


@command(
    "info", "Parameters and cache bytes per token of a saved config or a preset, by layer kind.",
    option("--config", metavar="DIR_OR_FILE",
           help="a config.json, or a checkpoint directory holding one (hybridlm's or any supported format); "
                "default: the preset"),
    option("--preset", choices=list(PRESETS), metavar="NAME",
           help=f"a preset: {', '.join(PRESETS)}; default: {DEFAULT_PRESET}"),
    option("--context", type=positive_int, default=4096, help="context length at which cache bytes are counted"),
    option("--backends", action="store_true", help="instead, list kernel backends and what each op uses"),
)
def run_info(args) -> None:
    if args.backends:
        from hybridlm.ops import report

        print(report())
        return
    if args.config and args.preset:
        raise ValueError("give --config or --preset, not both")
    if args.config:
        config = _config_from(args.config)
        print(f"config: {args.config}")
    else:
        from hybridlm.presets import preset

        name = args.preset or DEFAULT_PRESET
        config = preset(name)
        print(f"preset: {name}" + ("" if args.preset else " (the default; choose with --preset or --config)"))
    from hybridlm.decoding.bench import cache_bytes, fill_cache, mixers_by_kind, table

    model = _build(config, device="meta")  # sizes only: a full-size config must not allocate its weights
    print(f"layers: {config.num_hidden_layers}  hidden: {config.hidden_size}  "
          f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M")
    fixed, per_token = cache_bytes(model, args.context)
    print(f"cache per sequence in the model's dtype ({model.dtype}; `hybridlm memory` counts 16-bit KV): {fixed:,} B "
          f"fixed + {per_token:,.0f} B per token of context")
    cache = model.new_cache(1)
    fill_cache(cache, args.context)
    layers, params = mixers_by_kind(model)
    rows = [{"kind": kind, "layers": layers.get(kind, 0), "params": params.get(kind, 0), "bytes": nbytes}
            for kind, nbytes in cache.nbytes_by_kind().items()]
    print(f"\nby layer kind, cache at {args.context} tokens of context:")
    print(table(rows, [("kind", "kind", ""), ("layers", "layers", "d"), ("params", "mixer parameters", ",d"),
                        ("bytes", "cache bytes", ",d")]))


@command("build-kernels", "Build the CUDA selective scan now (else the first forward on a GPU builds it, ~1 min).")
def run_build_kernels(args) -> None:
    from hybridlm.ops import cuda

    print(f"CUDA sources: {cuda.KERNEL_DIR}", flush=True)
    reason = cuda.unavailable_reason()
    if reason is not None:
        raise OSError(f"cannot build the CUDA selective scan here: {reason}")
    cuda.load_library()
    print(f"the CUDA selective scan is built (torch.ops.{cuda.LIBRARY}); later processes load it from the cache")


@command(
    "bench", "Decode ms and cache bytes per token: attention, 1:7 hybrid, Mamba-2, Qwen3-Next 3:1; scan speedups.",
    option("--contexts", type=positive_int, nargs="+", default=[512, 2048, 8192], help="context lengths to decode at"),
    option("--steps", type=positive_int, default=8, help="timed decode steps per stack and context"),
    option("--warmup", type=non_negative_int, default=2, help="untimed runs before timing"),
    option("--threads", type=positive_int, default=1,
           help="torch threads for the decode timing (1 is steadiest on a shared machine)"),
    option("--scan-length", type=positive_int, default=2048, help="sequence length of the scan comparison"),
    option("--scan-repeats", type=positive_int, default=5, help="timed runs per scan"),
    option("--skip-scans", action="store_true", help="leave out the scan comparison"),
    option("what", nargs="?", choices=["stacks", "context"], default="stacks",
           help="stacks: the comparison above; context: each stack with fp, 8- and 4-bit KV and sinks + window"),
    option("--plot", help="with 'context': write a PNG plot here (needs matplotlib); default: no plot"),
)
def run_bench(args) -> None:
    from hybridlm.decoding.bench import compare_stacks, scan_speedups, table
    from hybridlm.presets import preset

    names = {"all-attention": "attention-small", "jamba 1:7": "jamba-small", "all-mamba2": "mamba2-small",
             "qwen3-next 3:1": "qwen3-next-small"}  # Gated DeltaNet : gated attention
    models = {label: _build(preset(name, mlp_types=["dense"] * 8, expert_layer_period=None))
              for label, name in names.items()}
    if args.what == "context":
        _bench_context(models, args)
        return
    contexts = args.contexts
    rows = compare_stacks(models, contexts, steps=args.steps, warmup=args.warmup, threads=args.threads)
    print(f"decode ms/token, min / median of {args.steps} steps after {args.warmup} warm-up (batch 1, "
          f"{args.threads} thread(s), the stacks' steps interleaved), and cache per sequence:")
    columns = [("stack", "stack", ""), ("bytes_per_token", "cache B/token", ",.0f"),
               ("fixed_bytes", "fixed B", ",d")]
    columns += [(c, f"ms @ {c}", ".2f") for c in contexts]
    for row in rows:
        row["growth"] = row[contexts[-1]].median_ms / row[contexts[0]].median_ms
    columns.append(("growth", f"median {contexts[-1]}/{contexts[0]}", ".2f"))
    print(table(rows, columns))
    if not args.skip_scans:
        print(f"\nreference scans, chunked vs one step per token (length {args.scan_length}; ms min / median of "
              f"{args.scan_repeats} after {args.warmup} warm-up):")
        print(table(scan_speedups(args.scan_length, args.scan_repeats, args.warmup),
                     [("op", "op", ""), ("chunked", "chunked ms", ".1f"), ("loop", "loop ms", ".1f"),
                      ("speedup", "speedup (median)", ".1f"), ("speedup_min", "speedup (min)", ".1f")]))


def _bench_context(models, args) -> None:
    from hybridlm.cache.kv.policy import CachePolicy
    from hybridlm.decoding.bench import context_rows, plot_context_rows, table

    policies = {"fp": None, "8-bit": CachePolicy(kv_bits=8), "4-bit": CachePolicy(kv_bits=4),
                "sinks 4 + window 1020": CachePolicy(sink_tokens=4, window=1020)}
    mamba = {"all-mamba2": models.pop("all-mamba2")}  # no attention layers: a policy changes nothing
    rows = context_rows(models, policies, args.contexts, args.steps, args.warmup)
    rows += context_rows(mamba, {"fp": None}, args.contexts, args.steps, args.warmup)
    print(f"cache bytes and decode ms/token (min / median of {args.steps} after {args.warmup} warm-up), batch 1:")
    print(table(rows, [("stack", "stack", ""), ("policy", "KV policy", ""), ("context", "context", ",d"),
                       ("cache_bytes", "cache bytes", ",d"), ("decode", "decode ms", ".2f"),
                       ("peak_rss_mib", "peak RSS MiB", ",.0f")]))
    if args.plot:
        print(plot_context_rows(rows, args.plot))


def _state_bits(text: str) -> int | str:
    """``--state-bits``: 8 or fp8."""
    if text not in ("8", "fp8"):
        import argparse

        raise argparse.ArgumentTypeError(f"must be 8 or fp8, got {text!r}")
    return 8 if text == "8" else text


@command(
    "memory", "Cache bytes per request and per token by layer kind, at contexts and KV bit widths, beside the "
              "weights' bytes, for any config hybridlm reads (plain llama / mistral / mixtral / qwen2 / qwen3 too); "
              "with --serve, the concurrent requests that fit on a device.",
    option("--model", metavar="CONFIG_OR_DIR", help="a config.json or a checkpoint directory; default: give --preset"),
    option("--preset", choices=list(PRESETS), metavar="NAME",
           help=f"a preset instead of --model: {', '.join(PRESETS)}; default: give --model"),
    option("--context", type=positive_int, nargs="+", default=None,
           help="context lengths (default 4096 32768 131072); with --serve the largest context of the plan "
                "(default: the model's maximum)"),
    option("--batch", type=positive_int, default=1, help="sequences per request"),
    option("--kv-bits", type=int, choices=KV_BITS, nargs="+", default=None,
           help="KV bit widths (16: unquantized; default 16 8 4, with --serve 16)"),
    option("--json", action="store_true", help="print the rows as JSON instead of a table"),
    option("--serve", action="store_true",
           help="plan serving: weights, bytes per request by part, the requests that fit at 1K, 2K, ... tokens"),
    option("--device-gib", type=non_negative_float, default=80.0, help="with --serve: device memory in GiB (80)"),
    option("--page-size", type=positive_int, default=None,
           help="with --serve: paged KV in pages of this many tokens (counts pages rounded up and block tables); "
                "default: unpaged"),
    option("--weight-bits", type=int, choices=[16, 8, 4], default=16,
           help="with --serve: bits per weight (16; 8 or 4 for quantized weights, their scales not counted)"),
    option("--state-bits", type=_state_bits, default=None,
           help="with --serve: recurrent states in 8 (int8) or fp8 (CachePolicy.state_bits); default fp32"),
    option("--state-rounding", choices=["nearest", "stochastic", "feedback"], default=None,
           help="with --state-bits: the rounding (feedback counts its bf16 residual); default: nearest"),
    option("--plot", help="with --serve: write a PNG of requests against context here (needs matplotlib); "
                         "default: no plot"),
)
def run_memory(args) -> None:
    import json

    if (args.model is None) == (args.preset is None):
        raise ValueError("give --model CONFIG_OR_DIR or --preset NAME (one of them)")
    if not args.serve:
        for flag, value in [("--page-size", args.page_size), ("--plot", args.plot), ("--state-bits", args.state_bits),
                            ("--state-rounding", args.state_rounding)]:
            if value is not None:
                raise ValueError(f"{flag} needs --serve")
    config_file = existing_config(args.model, "--model") if args.model else None  # before torch loads
    from hybridlm.formats.base import read_config
    from hybridlm.model.memory import read_any_config
    from hybridlm.presets import preset

    # read_config: a JSON object, infinities decoded
    config = read_any_config(read_config(config_file)) if config_file else preset(args.preset)
    name = args.model or args.preset
    if args.serve:
        _serve_plan(config, name, args)
        return
    from hybridlm.decoding.bench import table
    from hybridlm.model.memory import by_kind_text, memory_rows

    rows = memory_rows(config, args.context or [4096, 32768, 131072], args.batch, args.kv_bits or [16, 8, 4],
                       name=name)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        row["request_gib"], row["weights_gib"] = row["bytes_per_request"] / 2**30, row["weight_bytes"] / 2**30
        row["kinds"] = by_kind_text(row)
    print(table(rows, [("context", "context", ",d"), ("kv_bits", "KV bits", "d"), ("batch", "batch", "d"),
                       ("bytes_per_token", "KV B/token", ",.0f"), ("fixed_bytes", "fixed B", ",d"),
                       ("request_gib", "cache GiB/request", ",.3f"), ("weights_gib", "weights GiB (16-bit)", ",.2f"),
                       ("kinds", "cache by layer kind", "")]))
    print("Counted for a bfloat16 cache (as served): 16-bit KV unquantized, each state in the dtype its mixer "
          "keeps in a bfloat16 model; `hybridlm info` counts the model's own dtype (fp32: twice the KV bytes).")


def _serve_plan(config, name: str, args) -> None:
    """``hybridlm memory --serve``: the plan at each KV bit width, printed (or as JSON), plotted on request."""
    import json

    from hybridlm.decoding.bench import table
    from hybridlm.model.memory import _size
    from hybridlm.model.serving import meta_model, plan_serving, plot_plans, serving_contexts, weight_parameters

    if args.batch != 1:
        raise ValueError("--batch: with --serve every request is one sequence; the plan counts requests")
    if args.context is not None and len(args.context) > 1:
        raise ValueError(f"--context: with --serve give one (the largest context of the plan), got {args.context}")
    contexts = serving_contexts(config, args.context[0] if args.context else None)
    parameters, model = weight_parameters(config), meta_model(config)
    plans = [plan_serving(config, args.device_gib, contexts, kv_bits=bits, page_size=args.page_size,
                          weight_bits=args.weight_bits, name=name, parameters=parameters, model=model,
                          state_bits=args.state_bits, state_rounding=args.state_rounding)
             for bits in args.kv_bits or [16]]
    if args.json:
        print(json.dumps([plan.as_dict() for plan in plans], indent=1))
        return
    first = plans[0]
    print(f"{name} on {args.device_gib:g} GiB ({first.device_bytes:,} B): weights ({first.weight_bits}-bit) "
          f"{_size(first.weight_bytes)} ({first.weight_bytes:,} B), left for requests {_size(first.free_bytes)}")
    top = contexts[-1]
    for plan in plans:
        row = plan.row(top)
        paging = f", paged KV in pages of {plan.page_size} tokens" if plan.page_size else ""
        paging += f", {plan.state_bits} recurrent states" if plan.state_bits else ""
        print(f"\none request at {top:,} tokens, {plan.kv_bits}-bit KV{paging}: {_size(row['bytes_per_request'])} "
              f"({row['bytes_per_request']:,} B)")
        for part, held in row["bytes_by_part"].items():
            print(f"  {part:<24} {held:>16,} B  {_size(held):>10}")
        if plan.page_size:
            print(f"  of which paging overhead (last page rounded up, int32 block tables): "
                  f"{row['paged_overhead_bytes']:,} B")
    rows = []
    for index, context in enumerate(contexts):
        row = {"context": context}
        for plan in plans:
            found = plan.rows[index]
            row[f"mib{plan.kv_bits}"] = found["bytes_per_request"] / 2**20
            row[f"n{plan.kv_bits}"] = found["requests"]
        rows.append(row)
    columns = [("context", "context", ",d")]
    for plan in plans:
        columns += [(f"mib{plan.kv_bits}", f"MiB/request ({plan.kv_bits}-bit KV)", ",.1f"),
                    (f"n{plan.kv_bits}", f"requests ({plan.kv_bits}-bit KV)", ",d")]
    print(f"\nconcurrent requests that fit beside the weights (cache only: activations and the engine's "
          f"workspace not counted):\n{table(rows, columns)}")
    if args.plot:
        print(plot_plans(plans, args.plot))
