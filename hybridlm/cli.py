"""The ``hybridlm`` command: demo, info, bench, generate, convert."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; ``columns`` are ``(key, heading, format)``."""
    cells = [[heading for _, heading, _ in columns]]
    cells += [[format(row[key], fmt) if fmt else str(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _load_config(args):
    from .config import HybridConfig
    from .presets import preset

    if args.config:
        with open(args.config) as file:
            return HybridConfig(**json.load(file))
    return preset(args.preset)


def _build(config, seed: int = 0):
    from .model import HybridForCausalLM

    torch.manual_seed(seed)
    return HybridForCausalLM(config).eval()


# --- commands --------------------------------------------------------------------------------------


def cmd_demo(args) -> None:
    """A Jamba-style stack against an all-attention stack of the same size: cache and decode speed."""
    from .bench import compare_stacks
    from .generation import IncrementalDecoder
    from .presets import preset

    hybrid_config = preset("jamba-small")
    attention_config = preset("attention-small", expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                              num_experts_per_tok=2)
    models = {"hybrid 1:7 (jamba-small)": _build(hybrid_config), "all-attention": _build(attention_config)}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    print(f"hybridlm demo: two {hybrid_config.num_hidden_layers}-layer stacks, hidden {hybrid_config.hidden_size}, "
          f"random weights")
    for name, count in params.items():
        print(f"  {name}: {count / 1e6:.2f} M parameters, layers {models[name].config.layer_types}")
    rows = compare_stacks(models, [args.context], steps=args.steps)
    print(f"\nPer sequence, decoding one token with {args.context} tokens of context (median of {args.steps}):")
    print(_table(rows, [("stack", "stack", ""), ("bytes_per_token", "cache B/token", ",.0f"),
                        ("fixed_bytes", "fixed cache B", ",d"), (args.context, "decode ms/token", ".2f")]))
    hybrid, attention = rows
    print(f"\nThe hybrid keeps {attention['bytes_per_token'] / hybrid['bytes_per_token']:.1f}x fewer cache bytes per "
          f"token and decodes {attention[args.context] / hybrid[args.context]:.2f}x as fast at this context.")
    decoder = IncrementalDecoder(models["hybrid 1:7 (jamba-small)"], prefill_chunk_size=64)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    start = time.perf_counter()
    print("\nGenerating 16 tokens (greedy) from prompt", prompt[0], "(random weights, so random tokens):")
    for step in decoder.stream(prompt, max_new_tokens=16):
        print(step[0].item(), end=" ", flush=True)
    print(f"\n({(time.perf_counter() - start) * 1000:.0f} ms)")


def cmd_info(args) -> None:
    """Parameters and cache bytes per token of a config file or preset, by layer kind."""
    if args.backends:
        from .ops import backends

        print(backends.report())
        return
    from .bench import cache_bytes

    config = _load_config(args)
    model = _build(config)
    print(f"layers: {config.num_hidden_layers}  hidden: {config.hidden_size}  "
          f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M")
    fixed, per_token = cache_bytes(model, args.context)
    print(f"cache per sequence ({model.dtype}): {fixed:,} B fixed + {per_token:,.0f} B per token of context")
    from .bench import fill_cache

    cache = model.new_cache(1)
    fill_cache(cache, args.context)
    layers, params = _mixers_by_kind(model)
    rows = [{"kind": kind, "layers": layers.get(kind, 0), "params": params.get(kind, 0), "bytes": nbytes}
            for kind, nbytes in cache.nbytes_by_kind().items()]
    print(f"\nby layer kind, cache at {args.context} tokens of context:")
    print(_table(rows, [("kind", "kind", ""), ("layers", "layers", "d"), ("params", "mixer parameters", ",d"),
                        ("bytes", "cache bytes", ",d")]))


def _mixers_by_kind(model) -> tuple[dict[str, int], dict[str, int]]:
    """Per mixer kind: how many layers run one, and their parameters (a parallel layer counts per branch)."""
    from collections import Counter

    from .config import mixer_parts

    layers, params = Counter(), Counter()
    for block in model.model.layers:
        parts = mixer_parts(block.mixer_type)
        for kind in parts:
            mixer = block.mixer if len(parts) == 1 else getattr(block.mixer, kind)
            layers[kind] += 1
            params[kind] += sum(p.numel() for p in mixer.parameters())
    shared = model.model.shared
    if shared is not None:
        layers["shared_attention"] = len(shared.layers)
        params["shared_attention"] = sum(p.numel() for p in shared.parameters())
    return layers, params


def cmd_bench(args) -> None:
    """Decode ms/token and cache bytes/token for attention, 1:7 hybrid and all-Mamba-2 stacks; scan speedups."""
    from .bench import compare_stacks, scan_speedups
    from .presets import preset

    names = {"all-attention": "attention-small", "jamba 1:7": "jamba-small", "all-mamba2": "mamba2-small"}
    models = {label: _build(preset(name, mlp_types=["dense"] * 8, expert_layer_period=None))
              for label, name in names.items()}
    contexts = args.contexts
    rows = compare_stacks(models, contexts, steps=args.steps)
    print(f"decode ms/token (batch 1, median of {args.steps} steps) and cache per sequence:")
    columns = [("stack", "stack", ""), ("bytes_per_token", "cache B/token", ",.0f"),
               ("fixed_bytes", "fixed B", ",d")]
    columns += [(c, f"ms @ {c}", ".2f") for c in contexts]
    for row in rows:
        row["growth"] = row[contexts[-1]] / row[contexts[0]]
    columns.append(("growth", f"{contexts[-1]}/{contexts[0]}", ".2f"))
    print(_table(rows, columns))
    if not args.skip_scans:
        print(f"\nreference scans, chunked vs one step per token (length {args.scan_length}):")
        print(_table(scan_speedups(args.scan_length),
                     [("op", "op", ""), ("chunked_ms", "chunked ms", ".1f"), ("loop_ms", "loop ms", ".1f"),
                      ("speedup", "speedup", ".1f")]))


def cmd_generate(args) -> None:
    """Generate from a checkpoint directory (any supported format); text in and out with its tokenizer."""
    from .formats import load
    from .generation import IncrementalDecoder

    model = load(args.model)
    tokenizer = None
    if args.prompt is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--prompt needs tokenizer files in {args.model}: {error}") from error
        prompt = tokenizer(args.prompt)["input_ids"]
    elif args.ids:
        prompt = [int(token) for token in args.ids.split(",")]
    else:
        raise SystemExit("give --prompt TEXT (with a tokenizer in the checkpoint) or --ids 1,2,3")
    stops = [model.config.eos_token_id] if isinstance(model.config.eos_token_id, int) else \
        list(model.config.eos_token_id or [])
    decoder = IncrementalDecoder(model, prefill_chunk_size=args.prefill_chunk)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_tokens=stops,
                    seed=args.seed)
    generated: list[int] = []
    shown = ""
    for step in decoder.stream([prompt], **settings):
        token = step[0].item()
        if token in stops:
            break
        generated.append(token)
        if tokenizer is None:
            print(token, end=" ", flush=True)
        else:  # decode the whole continuation so multi-token characters print correctly
            text = tokenizer.decode(generated, skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
    print()


def cmd_convert(args) -> None:
    """Read SRC (any supported format) and write DST as ``--to`` (hybridlm or a foreign model_type)."""
    from .formats import load

    model = load(args.src)
    model.save_pretrained(args.dst, format=args.to)
    print(f"wrote {args.dst} ({args.to})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridlm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help=cmd_demo.__doc__)
    demo.add_argument("--context", type=int, default=4096, help="context length for the decode comparison")
    demo.add_argument("--steps", type=int, default=8, help="decode steps timed per stack")
    demo.set_defaults(func=cmd_demo)

    info = commands.add_parser("info", help=cmd_info.__doc__)
    source = info.add_mutually_exclusive_group()
    source.add_argument("--config", help="a HybridConfig JSON file")
    source.add_argument("--preset", default="jamba-small", help="a preset name (see hybridlm.presets)")
    info.add_argument("--context", type=int, default=4096)
    info.add_argument("--backends", action="store_true", help="list kernel backends and what each op uses")
    info.set_defaults(func=cmd_info)

    bench = commands.add_parser("bench", help=cmd_bench.__doc__)
    bench.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    bench.add_argument("--steps", type=int, default=8)
    bench.add_argument("--scan-length", type=int, default=2048)
    bench.add_argument("--skip-scans", action="store_true")
    bench.set_defaults(func=cmd_bench)

    generate = commands.add_parser("generate", help=cmd_generate.__doc__)
    generate.add_argument("--model", required=True, help="checkpoint directory (or hub id in the local cache)")
    generate.add_argument("--prompt", help="text prompt (needs tokenizer files in the checkpoint)")
    generate.add_argument("--ids", help="comma-separated token ids, instead of --prompt")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--prefill-chunk", type=int, default=512)
    generate.set_defaults(func=cmd_generate)

    convert = commands.add_parser("convert", help=cmd_convert.__doc__)
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--to", required=True, help="hybridlm, or a model_type such as jamba, mamba2, bamba")
    convert.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as error:
        print(f"hybridlm {args.command}: {error}", file=sys.stderr)
        raise SystemExit(2) from error


if __name__ == "__main__":
    main()
