"""Per-step training losses of both stages of a distillation run: docs/distillation/losses.png."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

run, out = sys.argv[1], sys.argv[2]


def rows(stage: str) -> list[dict]:
    """The metrics rows of one stage (none if it did not run)."""
    try:
        with open(f"{run}/{stage}/metrics.jsonl") as lines:
            return [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError:
        return []


fig, axes = plt.subplots(1, 2, figsize=(11, 4))
t = [r for r in rows("transfer") if "loss" in r]
axes[0].plot([r["step"] for r in t], [r["loss"] for r in t], "o-", ms=3, label="training batch")
e = [r for r in rows("transfer") if "layer_error" in r]
axes[0].plot([r["step"] for r in e], [r["layer_error"] for r in e], "s--", label="held-out rows")
axes[0].set_title("stage 1: relative layer error (mean of 23 layers)")
axes[0].set_xlabel("step (2,048 tokens each)")
axes[0].set_ylabel("|mixer - attention|^2 / |attention|^2")
f = [r for r in rows("finetune") if "loss" in r]
axes[1].plot([r["step"] for r in f], [r["loss"] for r in f], "o-", ms=3, color="tab:orange", label="training batch KL")
axes[1].set_title("stage 2: KL(teacher || student), nats per token")
axes[1].set_xlabel("step (2,048 tokens each)")
for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out, dpi=90)
