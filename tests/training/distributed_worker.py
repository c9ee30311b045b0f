"""One tiny training run, single-process or under torchrun (``--parallel ddp|fsdp``), for test_distributed.py:

    torchrun --nproc_per_node 2 -m tests.training.distributed_worker --parallel fsdp --out DIR --steps 5

Model, data and settings are fixed functions of the arguments, so every launch trains the same thing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridlm.training.distributed import SingleProcess, from_environment
from hybridlm.training.loop import TrainConfig, train
from hybridlm.training.packing import pack_documents
from tests.helpers import TINY, tiny_model

SEQ_LEN, ROWS = 16, 16
EOS = 1


def tiny_rows():
    """Random ids with an end-of-text id every ~7 tokens, packed into ``ROWS`` rows of ``SEQ_LEN``."""
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(2, TINY["vocab_size"], (ROWS * SEQ_LEN,), generator=generator)
    stream[torch.rand(stream.shape, generator=generator) < 0.15] = EOS
    return pack_documents(stream, SEQ_LEN, EOS)


def build_model(seed: int = 1):
    """Mamba-2, Performer and attention layers, MoE in every other layer (router aux loss off: it is
    a per-rank mean, so with it the runs agree only approximately)."""
    return tiny_model(seed=seed, layer_pattern="SPA", expert_layer_period=2, expert_layer_offset=1,
                      router_aux_loss_coef=0.0).train()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", choices=("none", "ddp", "fsdp"), default="none")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    parallel = SingleProcess() if args.parallel == "none" else from_environment(args.parallel)
    # constant learning rate: a run stopped at step k and resumed with more steps follows the same schedule
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=2, lr=1e-2, warmup=0,
                         min_lr_ratio=1.0, log_every=1, eval_every=1000, save_every=args.steps)
    # each rank draws its own init and Performer features: the wrap must give every rank rank 0's (seed 1, as the
    # single-process reference)
    model = build_model(seed=1 + parallel.rank)
    train(model, tiny_rows(), config, args.out, resume=args.resume, parallel=parallel)
    full = parallel.full_model(model)  # FSDP: gathered from the shards on rank 0
    if parallel.is_main:
        full.save_pretrained(args.out / "model")


if __name__ == "__main__":
    main()
