"""MQAR, the multi-query associative recall benchmark (Zoology): where recall breaks, mixer by mixer.

    python recipes/mqar.py --quick --out runs/mqar-quick            # the reduced grid (see QUICK)
    python recipes/mqar.py --out runs/mqar --workers 2              # the full grid (see FULL)
    python recipes/mqar.py --out runs/mqar --mixers attention hybrid-1:3 --cells 256:32 --widths 128
    python recipes/mqar.py --out runs/mqar --report                 # the table and plot of what has run

Every (mixer, width, state size, cell) is trained at each learning rate of ``--lrs`` on fresh MQAR rows with the
loop of :mod:`hybridlm.training` and scored on held-out rows; the best learning rate is kept, as Zoology does.
``OUT/results.json`` gets one object per model and cell (written as they finish, so ``--resume`` continues a run
that was stopped), ``OUT/mqar.png`` plots accuracy against state bytes per sequence, and a table is printed.
The data and the models are described in :mod:`hybridlm.training.mqar`.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from hybridlm.files import read_json, write_file, written_aside
from hybridlm.training.mqar import MIXER_PATTERNS, needs_state_size

FULL = dict(mixers=list(MIXER_PATTERNS), widths=[64, 128], state_sizes=[16, 64],
            cells=["64:4", "128:8", "256:16", "256:32", "512:64"], lrs=[1e-3, 3e-3, 1e-2], steps=1500,
            vocab_size=8192)
# Two short cells, width 64, state size 16, one learning rate (3e-3: the best of 1e-3, 3e-3, 1e-2 for attention at
# this budget, docs/mqar.md): 4 pairs fit in every state, 16 strain the small ones.
QUICK = dict(mixers=["attention", "conv-attention", "mamba2", "performer", "hybrid-1:3"], widths=[64],
             state_sizes=[16], cells=["64:4", "64:16"], lrs=[3e-3], steps=1500, vocab_size=8192)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", type=Path, required=True, help="output directory (results.json, mqar.png, runs/)")
    add("--quick", action="store_true", help="the reduced grid QUICK instead of FULL (options below override it)")
    add("--mixers", nargs="+", choices=list(MIXER_PATTERNS), help="models, see MIXER_PATTERNS")
    add("--widths", nargs="+", type=int, help="hidden sizes")
    add("--state-sizes", nargs="+", type=int, help="state dimension of the fixed-state mixers")
    add("--cells", nargs="+", help="SEQ_LEN:KV_PAIRS grid cells")
    add("--lrs", nargs="+", type=float, help="learning rates tried per model and cell; the best is kept")
    add("--steps", type=int, help="optimizer steps per training run")
    add("--batch-size", type=int, default=32, help="(default: %(default)s)")
    add("--train-rows", type=int, default=None,
        help="training rows per cell (default: steps x batch size, every row seen once: with fewer, rows repeat "
             "and the models learn the training pairs by heart instead of recall)")
    add("--test-rows", type=int, default=1000, help="held-out rows per cell (default: %(default)s)")
    add("--pair-mix", type=int, default=1,
        help="train each cell on an even mix of this many pair counts halving down from its own (4 at (256, 32): "
             "32, 16, 8, 4), as Zoology trains on a mix of cells; held-out rows are the cell's own "
             "(default: %(default)s, the cell alone)")
    add("--max-shift", type=int, default=0,
        help="move each row's pairs and queries right by a random 0..N tokens (random filler before and after, the "
             "row length stays the cell's): the pairs then sit at no fixed position, which a model that "
             "compresses by position (causal Linformer) otherwise exploits (default: %(default)s, Zoology's layout)")
    add("--warm-cell", help="SEQ_LEN:KV_PAIRS: train every model on this (easier) cell for --warm-steps first, "
        "then on its own cell: a curriculum, as Zoology trains on a mix of easy and hard cells")
    add("--warm-steps", type=int, default=0, help="steps on --warm-cell (default: %(default)s, no warm-up cell)")
    add("--mamba2-norm", choices=["gated", "norm_before_gate", "none"], default="gated",
        help="Mamba-2's output gating (config field mamba2_norm; default: %(default)s, Mamba-2's rms_norm(y * "
             "silu(z))). 'none' (y * silu(z)) learns the lookup far faster in hybrids on a CPU budget "
             "(docs/mqar.md); it is recorded in each row")
    add("--vocab-size", type=int, help="keys and values split it in half (FULL: 8192, as in Zoology)")
    add("--workers", type=int, default=1, help="training runs in parallel, one thread each (default: %(default)s)")
    add("--resume", action="store_true", help="keep the rows already in OUT/results.json and run the rest")
    add("--report", action="store_true",
        help="train nothing: the table, results.json and the plot of the runs in OUT/runs.json (runs.json files of "
             "several OUTs can be joined into one for a single table)")
    add("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.cells = [_cell(text) for text in args.cells]
    if (args.warm_cell is None) != (args.warm_steps == 0):
        parser.error("--warm-cell and --warm-steps (>= 1) go together")
    args.warm_cell = _cell(args.warm_cell) if args.warm_cell else None
    if args.train_rows is None:
        args.train_rows = args.steps * args.batch_size
    for name in ("steps", "batch_size", "train_rows", "test_rows", "workers", "pair_mix"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_shift < 0:
        parser.error("--max-shift must be >= 0")
    if args.train_rows < args.batch_size:
        parser.error(f"--train-rows {args.train_rows} is smaller than one batch (--batch-size {args.batch_size})")
    return args


def _cell(text: str) -> tuple[int, int]:
    try:
        seq_len, kv_pairs = (int(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"--cells: {text!r} is not SEQ_LEN:KV_PAIRS") from None
    return seq_len, kv_pairs


def grid(args) -> list[dict]:
    """One job per (cell, mixer, width, state size, learning rate); attention (and conv-attention) has no state
    size."""
    jobs = []
    for seq_len, kv_pairs in args.cells:
        for mixer in args.mixers:
            for width in args.widths:
                for state_size in args.state_sizes if needs_state_size(mixer) else [None]:
                    for lr in args.lrs:
                        jobs.append(dict(mixer=mixer, hidden_size=width, state_size=state_size, seq_len=seq_len,
                                         kv_pairs=kv_pairs, lr=lr))
    return jobs


# What every run kept in one OUT shares: resuming with another value would put two experiments in one table.
RUN_SETTINGS = ("steps", "batch_size", "train_rows", "test_rows", "pair_mix", "max_shift", "warm_cell",
                "warm_steps", "mamba2_norm", "vocab_size", "seed")


def run_settings(args) -> dict:
    """The RUN_SETTINGS of this invocation, as a run records them."""
    settings = {name: getattr(args, name) for name in RUN_SETTINGS}
    settings["warm_cell"] = args.warm_cell and ":".join(map(str, args.warm_cell))
    return settings


def mixed_settings(runs: list[dict]) -> list[str]:
    """The RUN_SETTINGS the runs do not all share (rows recorded before a setting was kept are not checked on
    it)."""
    return [name for name in RUN_SETTINGS if len({json.dumps(run[name]) for run in runs if name in run}) > 1]


def _recorded(runs: list[dict], names: list[str], now: dict | None = None) -> str:
    """``--name value/value`` for each setting in ``names``, as the runs recorded it (and ``(now X)``)."""
    return ", ".join(f"--{name.replace('_', '-')} {'/'.join(sorted({str(run[name]) for run in runs if name in run}))}"
                     + (f" (now {now[name]})" if now else "") for name in names)


def check_resumable(runs: list[dict], args) -> None:
    """Refuse to resume runs made with other settings, naming them."""
    settings = run_settings(args)
    if changed := mixed_settings(runs + [settings]):
        raise SystemExit(f"{args.out}/runs.json was made with other settings: {_recorded(runs, changed, settings)}")


def model_key(row: dict) -> tuple:
    return tuple(row[k] for k in ("mixer", "hidden_size", "state_size", "seq_len", "kv_pairs"))


def rows_of_cell(num_rows: int, seq_len: int, kv_pairs: int, vocab_size: int, max_shift: int, seed: int,
                 pair_mix: int = 1):
    """``num_rows`` rows of a cell; with ``max_shift``, rows that much shorter, then shifted into the cell's
    length."""
    from hybridlm.training.mqar import mixed_mqar_rows, mqar_rows, pair_ladder, shift_rows

    inner = seq_len - max_shift
    rows = mqar_rows(num_rows, inner, kv_pairs, vocab_size, seed=seed) if pair_mix == 1 else \
        mixed_mqar_rows(num_rows, inner, pair_ladder(kv_pairs, pair_mix), vocab_size, seed=seed)
    return shift_rows(rows, max_shift, vocab_size, seed=seed + 7919) if max_shift else rows


@functools.lru_cache(maxsize=1)
def cell_rows(seq_len: int, kv_pairs: int, vocab_size: int, train_rows: int, test_rows: int, seed: int,
              pair_mix: int = 1, max_shift: int = 0):
    """The training and held-out rows of a cell (the jobs of a cell come one after another: made once)."""
    return (rows_of_cell(train_rows, seq_len, kv_pairs, vocab_size, max_shift, seed * 2 + 1, pair_mix),
            rows_of_cell(test_rows, seq_len, kv_pairs, vocab_size, max_shift, seed * 2 + 2))


def check_cell(args, seq_len: int, kv_pairs: int) -> None:
    """Refuse a cell whose pairs do not fit (with ``--max-shift``, in the row less the shift), naming it."""
    from hybridlm.training.mqar import check_mqar_shape

    try:
        check_mqar_shape(args.vocab_size, seq_len - args.max_shift, kv_pairs)
    except ValueError as error:
        if not args.max_shift:
            raise
        raise ValueError(f"the cell {seq_len}:{kv_pairs} less --max-shift {args.max_shift}: {error}") from None


def run_job(job: dict, args) -> dict:
    """Train one model at one learning rate on one cell; its accuracy on the held-out rows and its sizes."""
    import torch

    from hybridlm import HybridForCausalLM
    from hybridlm.training import TrainConfig, train
    from hybridlm.training.checkpoint import CHECKPOINT_DIR
    from hybridlm.training.mqar import answer_accuracy, answer_losses, mqar_config, state_bytes_per_sequence

    torch.set_num_threads(1)
    seq_len, kv_pairs = job["seq_len"], job["kv_pairs"]
    train_rows, test_rows = cell_rows(seq_len, kv_pairs, args.vocab_size, args.train_rows, args.test_rows,
                                      args.seed, args.pair_mix, args.max_shift)
    config = mqar_config(job["mixer"], job["hidden_size"], job["state_size"], seq_len, args.vocab_size,
                         mamba2_norm=args.mamba2_norm)
    torch.manual_seed(args.seed)
    model = HybridForCausalLM(config)
    name = "-".join(str(job[k]) for k in ("mixer", "hidden_size", "state_size", "seq_len", "kv_pairs", "lr"))
    out = args.out / "runs" / name.replace(":", "_")
    started, cpu = time.perf_counter(), time.process_time()
    phases = [(train_rows, args.steps, out)]
    if args.warm_cell:
        warm_rows = rows_of_cell(args.warm_steps * args.batch_size, *args.warm_cell, args.vocab_size,
                                 args.max_shift, args.seed * 2 + 3)
        phases.insert(0, (warm_rows, args.warm_steps, out / "warm"))
    for rows, steps, phase_out in phases:
        last = train(model, rows, TrainConfig(steps=steps, batch_size=args.batch_size, lr=job["lr"],
                                              warmup=steps // 10, log_every=50, eval_every=steps, save_every=steps,
                                              seed=args.seed),
                     phase_out, losses=answer_losses)
        shutil.rmtree(phase_out / CHECKPOINT_DIR, ignore_errors=True)  # thousands of small runs: metrics only
    return dict(job, layer_types=list(config.layer_types), accuracy=answer_accuracy(model, test_rows),
                final_loss=last["loss"], state_bytes_per_sequence=state_bytes_per_sequence(model, seq_len),
                parameters=sum(p.numel() for p in model.parameters()), **run_settings(args),
                train_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu)


def _run_all(jobs: list[dict], args):
    """Yield each job's result in order: in this process with one worker, else in a pool of processes."""
    if args.workers == 1:
        yield from (run_job(job, args) for job in jobs)
        return
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(run_job, job, args) for job in jobs]
        yield from (future.result() for future in futures)


def best_per_model(runs: list[dict]) -> list[dict]:
    """One row per model and cell: the run of the learning rate with the best accuracy, with every lr's accuracy
    and the CPU seconds of them all."""
    best: dict[tuple, dict] = {}
    for run in runs:
        key = model_key(run)
        tried = {**best[key]["accuracy_by_lr"], str(run["lr"]): run["accuracy"]} if key in best else \
            {str(run["lr"]): run["accuracy"]}
        cpu_s = best[key]["cpu_s_all_lrs"] + run["cpu_s"] if key in best else run["cpu_s"]
        if key not in best or run["accuracy"] > best[key]["accuracy"]:
            best[key] = dict(run)
        best[key].update(accuracy_by_lr=tried, cpu_s_all_lrs=cpu_s)
    return list(best.values())


def table(rows: list[dict]) -> str:
    """A Markdown table, one line per model and cell: its accuracy at every learning rate tried, and the best."""
    lrs = sorted({float(lr) for r in rows for lr in r["accuracy_by_lr"]})
    head = ["seq", "kv", "model", "layers", "width", "state", "state bytes / sequence", "parameters",
            *(f"acc. lr {lr:g}" for lr in lrs), "best", "CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["kv_pairs"], list(MIXER_PATTERNS).index(r["mixer"]),
                                         r["hidden_size"], r["state_size"] or 0)):
        tried = {float(lr): accuracy for lr, accuracy in r["accuracy_by_lr"].items()}
        cells = [r["seq_len"], r["kv_pairs"], r["mixer"], f"`{MIXER_PATTERNS[r['mixer']]}`", r["hidden_size"],
                 r["state_size"] or "-", f"{r['state_bytes_per_sequence']:,}", f"{r['parameters']:,}",
                 *(f"{tried[lr]:.3f}" if lr in tried else "—" for lr in lrs), f"**{r['accuracy']:.3f}**",
                 f"{r['cpu_s_all_lrs']:.0f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """Accuracy against state bytes per sequence, one panel per cell, one colour per mixer; False (nothing
    written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cells = sorted({(r["seq_len"], r["kv_pairs"]) for r in rows})
    mixers = [m for m in MIXER_PATTERNS if any(r["mixer"] == m for r in rows)]
    colours = dict(zip(mixers, plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]))
    markers = dict(zip(mixers, "osD^vPX*h<>"))  # points of equal accuracy and bytes stay told apart
    fig, axes = plt.subplots(1, len(cells), figsize=(max(5, 4 * len(cells)) + 1.4, 3.6), squeeze=False, sharey=True)
    for ax, (seq_len, kv_pairs) in zip(axes[0], cells):
        for mixer in reversed(mixers):  # attention, listed first, drawn on top
            points = sorted((r["state_bytes_per_sequence"], r["accuracy"]) for r in rows
                            if r["mixer"] == mixer and (r["seq_len"], r["kv_pairs"]) == (seq_len, kv_pairs))
            if points:
                ax.plot(*zip(*points), markers[mixer], color=colours[mixer], label=mixer, alpha=0.75,
                        markerfacecolor="none" if markers[mixer] in "sD" else colours[mixer])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # the decades only: no overlapping labels
        ax.set_title(f"seq_len {seq_len}, {kv_pairs} key-value pairs")
        ax.set_xlabel("state bytes per sequence")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy")
    axes[0][0].set_ylim(-0.02, 1.02)
    handles = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    shown = [mixer for mixer in mixers if mixer in handles]  # every mixer of every panel, in MIXER_PATTERNS order
    fig.legend([handles[mixer] for mixer in shown], shown, fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 1 - 1.4 / fig.get_figwidth(), 1))  # room on the right for the legend
    with written_aside(path) as temporary:
        fig.savefig(temporary, dpi=80, format="png")
    plt.close(fig)
    return True


def train_grid(args) -> list[dict]:
    """Run the grid's jobs not yet in OUT/runs.json; every run, old and new."""
    for seq_len, kv_pairs in args.cells:
        check_cell(args, seq_len, kv_pairs)  # bad input fails before any training
    if args.warm_cell:
        check_cell(args, *args.warm_cell)
    results = args.out / "runs.json"
    if (args.out / "results.json").exists() and not args.resume:
        raise SystemExit(f"{args.out}/results.json exists: pass --resume to continue that run, or another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = read_json(results) if args.resume and results.exists() else []
    check_resumable(runs, args)
    done = {model_key(r) + (r["lr"],) for r in runs}
    jobs = [job for job in grid(args) if model_key(job) + (job["lr"],) not in done]
    print(f"{len(jobs)} training runs ({len(done)} already done)", flush=True)
    for run in _run_all(jobs, args):
        runs.append(run)
        print(f"{run['mixer']:<14} width {run['hidden_size']:>3} state {run['state_size'] or '-':>3} "
              f"({run['seq_len']}, {run['kv_pairs']}) lr {run['lr']:.0e}: accuracy {run['accuracy']:.3f} "
              f"({run['cpu_s']:.0f} cpu s)", flush=True)
        write_file(results, json.dumps(runs, indent=1))
        write_file(args.out / "results.json", json.dumps(best_per_model(runs), indent=1))
    return runs


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.report:
        if not (args.out / "runs.json").exists():
            raise SystemExit(f"--report: {args.out}/runs.json does not exist")
        runs = read_json(args.out / "runs.json")
        if mixed := mixed_settings(runs):  # runs.json files joined from several OUTs: one table, one experiment
            raise SystemExit(f"--report: {args.out}/runs.json mixes settings: {_recorded(runs, mixed)}")
        write_file(args.out / "results.json", json.dumps(best_per_model(runs), indent=1))
    else:
        runs = train_grid(args)
    rows = best_per_model(runs)
    print(table(rows))
    if plot(rows, args.out / "mqar.png"):
        print(f"plot: {args.out / 'mqar.png'}")
    return rows


if __name__ == "__main__":
    main()
