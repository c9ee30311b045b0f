"""Training metrics: one JSON object per logged step in ``metrics.jsonl``, and a PNG loss curve."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Appends rows to ``OUT/metrics.jsonl``; on resume, rows past the resumed step are dropped first so the
    file reads as one uninterrupted run."""

    def __init__(self, out: Path, resume_step: int | None = None):
        self.path = out / "metrics.jsonl"
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            kept = [row for row in rows if row["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
