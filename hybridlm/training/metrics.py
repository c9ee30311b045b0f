"""Training metrics: one JSON object per logged step in ``metrics.jsonl``, and a PNG loss curve."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from hybridlm.files import DamagedFileError, write_file, written_aside


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``. A last row cut short by a kill during its append is dropped with a
    warning; any other damage is an error naming the file and line."""
    lines = path.read_bytes().split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            if number == len(lines):  # no newline after it: the append did not finish
                warnings.warn(f"{path}:{number}: dropped a partial last row (a crash during its append)",
                              stacklevel=2)
                continue
            raise DamagedFileError(f"{path}:{number}: not a JSON row ({error})") from None
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise DamagedFileError(f"{path}:{number}: not a metrics row (a JSON object with an integer 'step')")
        rows.append(row)
    return rows


class MetricsLog:
    """Appends rows to ``OUT/metrics.jsonl``; on resume, rows past the resumed step (and a partial last row)
    are dropped first so the file reads as one uninterrupted run."""

    def __init__(self, out: Path, resume_step: int | None = None):
        self.path = out / "metrics.jsonl"
        if resume_step is None:
            write_file(self.path, "")
        elif self.path.exists():
            kept = [row for row in read_metrics(self.path) if row["step"] <= resume_step]
            write_file(self.path, "".join(json.dumps(row) + "\n" for row in kept))

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rows(self) -> list[dict]:
        return read_metrics(self.path)


def plot_loss(rows: list[dict], path: Path) -> bool:
    """Training and held-out loss against tokens seen; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r]
    held_out: dict[int, list] = {}  # periodic evaluations on a subset, the final one on every held-out row
    for r in rows:
        if "eval_loss" in r:
            held_out.setdefault(r.get("eval_tokens", 0), []).append((r["tokens"], r["eval_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="training loss (running mean)")
    for eval_tokens, points in sorted(held_out.items()):
        ax.plot(*zip(*points), "o-" if len(points) > 1 else "s",
                label=f"held-out loss ({eval_tokens:,} tokens)" if eval_tokens else "held-out loss")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with written_aside(path) as temporary:
        fig.savefig(temporary, dpi=100, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    return True
