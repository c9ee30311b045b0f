"""Training tokens/s, hybridlm against transformers on the CPU: same weights, same batch, side by side.

For the Jamba-, Mamba-2- and Bamba-shaped models of ``hf_speed.py`` (hidden 256, 8 layers), one training step
is forward + backward (next-token loss) + AdamW step over a ``--batch`` x ``--length`` batch (4 x 512). The two
libraries take turns step by step after ``--warmup`` untimed steps, so machine load affects both alike; it
prints min and median tokens/s and the ratio hybridlm / transformers (> 1: hybridlm trains faster).

    python benchmarks/train_speed.py [--models jamba mamba2 bamba] [--batch 4] [--length 512] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers
from hf_speed import MODELS, VOCAB

import hybridlm


class Trainer:
    """One model, its AdamW, and its timed steps."""

    def __init__(self, model, ids: torch.Tensor):
        self.model, self.ids = model.train(), ids
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def step(self, timed: bool = True) -> None:
        start = time.perf_counter()
        loss = self.model(self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if timed:
            self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def compare(name: str, batch: int, length: int, warmup: int, steps: int) -> dict:
    torch.manual_seed(0)
    theirs = MODELS[name]()
    theirs.config.output_router_logits = False  # hybridlm's loss adds the aux loss itself; see its docs
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        ours = hybridlm.HybridForCausalLM.from_pretrained(directory)
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    trainers = {"hybridlm": Trainer(ours, ids), "transformers": Trainer(theirs, ids)}
    for k in range(warmup + steps):
        for trainer in trainers.values():
            trainer.step(timed=k >= warmup)
    tokens = batch * length
    row = {"model": name, "first_loss": {k: t.losses[0] for k, t in trainers.items()}}
    for label, trainer in trainers.items():
        row[label] = (tokens / statistics.median(trainer.seconds), tokens / min(trainer.seconds))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per library")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per library")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"batch {args.batch} x {args.length}, {args.warmup} warm-up + {args.steps} timed steps each")
    for name in args.models:
        row = compare(name, args.batch, args.length, args.warmup, args.steps)
        ours, theirs = row["hybridlm"], row["transformers"]
        first = row["first_loss"]
        print(f"{name:>7}: tokens/s median (min-time) hybridlm {ours[0]:7.0f} ({ours[1]:.0f})  transformers "
              f"{theirs[0]:7.0f} ({theirs[1]:.0f})  ratio x{ours[0] / theirs[0]:.2f} (x{ours[1] / theirs[1]:.2f})  "
              f"first loss {first['hybridlm']:.4f} vs {first['transformers']:.4f}", flush=True)


if __name__ == "__main__":
    main()
