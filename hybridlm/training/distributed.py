"""How a run is spread over processes. The loop talks to one small interface (``wrap``, ``check_batch``,
``shard``, ``no_sync``, ``sum``, ``broadcast_text``, ``save``, ``load``, ``full_model``, ``rank``, ``world_size``,
``is_main``); :class:`SingleProcess` is the plain implementation, :class:`DataParallel` (DDP) and
:class:`FullyShardedParallel` (FSDP2) spread it over the processes ``torchrun`` starts (:func:`from_environment`).

Gradients are *summed* over ranks, never averaged: each rank divides its summed token loss by the target count
of the whole global batch (see ``hybridlm.training.loop``), so the sum over ranks is exactly the single-process
gradient, whatever the world size.
"""

from __future__ import annotations

import atexit
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from hybridlm.files import read_manifest, staging_path, torch_bytes, verify_directory, write_file
from hybridlm.training.checkpoint import (
    CHECKPOINT_DIR,
    TRAINER_STATE,
    check_resumable,
    finish_checkpoint,
    load_checkpoint,
    load_trainer_state,
    save_checkpoint,
    start_checkpoint,
)

DCP_DIR = "dcp"  # inside OUT/checkpoint: model and optimizer written by torch.distributed.checkpoint
KINDS = ("ddp", "fsdp")


class SingleProcess:
    """One process: the whole global batch here, no communication."""

    rank, world_size, is_main = 0, 1, True
    device = torch.device("cpu")

    def wrap(self, model):
        return model

    def check_batch(self, micro_batch: int) -> None:
        """Each rank must get an equal share of every micro-batch."""
        if micro_batch % self.world_size:
            raise ValueError(f"the micro-batch (--batch-size / --grad-accum = {micro_batch}) is not divisible by "
                             f"the world size {self.world_size}")

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's share of a micro-batch's row indices."""
        return rows.chunk(self.world_size)[self.rank] if self.world_size > 1 else rows

    def no_sync(self, wrapped, last_micro: bool):
        """Skip gradient synchronisation on all but the last micro-batch of a step."""
        return nullcontext()

    def sum(self, value: float) -> float:
        return value

    def broadcast_text(self, text: str | None) -> str:
        """The main process's ``text`` on every rank."""
        return text

    def barrier(self) -> None:
        """Wait for every rank."""

    def save(self, out: Path, model, optimizer, scheduler, state: dict) -> None:
        save_checkpoint(out, model, optimizer, scheduler, state)

    def load(self, out: Path, model, optimizer, scheduler) -> dict:
        """Resume from a single-process / DDP checkpoint or from a sharded (FSDP) one of any world size."""
        path = check_resumable(out, model)
        if (path / DCP_DIR).is_dir():
            return load_sharded(path, model, optimizer, scheduler)
        return load_checkpoint(out, model, optimizer, scheduler)

    def full_model(self, model):
        """A plain module holding all weights (on the main rank; None elsewhere), e.g. for ``save_pretrained``."""
        return model


class _Distributed(SingleProcess):
    """What DDP and FSDP share: the process group torchrun describes, a device per rank, and reductions."""

    def __init__(self):
        import torch.distributed as dist

        missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in os.environ]
        if missing:
            raise RuntimeError(f"--parallel {self.kind} needs the environment torchrun sets ({', '.join(missing)} "
                               f"missing): torchrun --nproc_per_node N -m hybridlm.training.pretrain --parallel "
                               f"{self.kind} ...")
        local_rank = int(os.environ["LOCAL_RANK"])
        if torch.cuda.is_available():
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            atexit.register(dist.destroy_process_group)
        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0

    def _prepare(self, model):
        """Move to this rank's device and make every rank start from rank 0's weights and buffers (the random
        init, Performer features and their seeds), whatever each process drew."""
        model.to(self.device)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                self.dist.broadcast(tensor.data, src=0)
        return model

    def sum(self, value: float) -> float:
        total = torch.tensor(value, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(total)
        return float(total)

    def broadcast_text(self, text: str | None) -> str:
        box = [text]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier()


def _sum_allreduce_hook(process_group, bucket):
    """DDP communication hook: sum a gradient bucket over ranks (DDP's default hook averages)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


class DataParallel(_Distributed):
    """DDP: a full replica per rank, gradients summed over ranks after each step's last micro-batch.
    Checkpoints are the single-process format, written by rank 0."""

    kind = "ddp"

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel

        from hybridlm.layers.mlp import MoE

        self._prepare(model)
        # top-k routing may leave an expert without tokens in a step
        routed = any(isinstance(module, MoE) for module in model.modules())
        wrapped = DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None,
                                          find_unused_parameters=routed)
        wrapped.register_comm_hook(None, _sum_allreduce_hook)
        return wrapped

    def no_sync(self, wrapped, last_micro: bool):
        return nullcontext() if last_micro else wrapped.no_sync()

    def save(self, out: Path, model, optimizer, scheduler, state: dict) -> None:
        if self.is_main:
            save_checkpoint(out, model, optimizer, scheduler, state)
        self.barrier()


class FullyShardedParallel(_Distributed):
    """FSDP2: every block (``model.model.layers[i]``, or the modules ``model.shard_units()`` names when it has
    that method), then the whole model, sharded with ``fully_shard``; gradients reduce-scattered as sums.
    Checkpoints go through ``torch.distributed.checkpoint`` (one shard per rank) and resume on any world size,
    one process included."""

    kind = "fsdp"

    def wrap(self, model):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self._prepare(model)
        for block in model.shard_units() if hasattr(model, "shard_units") else model.model.layers:
            fully_shard(block)
        fully_shard(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
        return model

    @contextmanager
    def no_sync(self, wrapped, last_micro: bool):
        wrapped.set_requires_gradient_sync(last_micro)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)

    def save(self, out: Path, model, optimizer, scheduler, state: dict) -> None:
        save_sharded(out, model, optimizer, scheduler, state, self)

    def load(self, out: Path, model, optimizer, scheduler) -> dict:
        path = check_resumable(out, model)
        if not (path / DCP_DIR).is_dir():
            raise ValueError(f"--resume --parallel fsdp: {path} is a single-process / DDP checkpoint; resume it "
                             "with --parallel none or ddp")
        return load_sharded(path, model, optimizer, scheduler)

    def full_model(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        from hybridlm.model import HybridForCausalLM

        plain = HybridForCausalLM(model.config)
        plain.load_state_dict(weights)
        return plain


def save_sharded(out: Path, model, optimizer, scheduler, state: dict, parallel) -> Path:
    """``OUT/checkpoint`` with model and optimizer through DCP (every rank writes its shard) and the scheduler,
    step and RNG in ``trainer_state.pt`` (rank 0); staged and published as :func:`save_checkpoint` is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if parallel.is_main:
        start_checkpoint(out)
    parallel.barrier()
    staged = staging_path(out / CHECKPOINT_DIR)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staged / DCP_DIR)
    if parallel.is_main:
        write_file(staged / TRAINER_STATE, torch_bytes({"scheduler": scheduler.state_dict(),
                                                        "rng": torch.get_rng_state(), **state}))
        finish_checkpoint(out, model)
    parallel.barrier()
    return out / CHECKPOINT_DIR


def load_sharded(path: Path, model, optimizer, scheduler) -> dict:
    """Restore a DCP checkpoint into ``model`` and ``optimizer`` (sharded or not, any world size), then the
    scheduler and RNG; returns the rest of the saved state (step, tokens, ...). Every file is checked against
    the manifest first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    verify_directory(path)
    state = load_trainer_state(path, read_manifest(path))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    saved = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(saved, checkpoint_id=path / DCP_DIR)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
    scheduler.load_state_dict(state.pop("scheduler"))
    torch.set_rng_state(state.pop("rng"))
    return state


def from_environment(kind: str):
    """The parallel implementation ``kind`` (``"ddp"`` or ``"fsdp"``) over the processes torchrun started
    (gloo on CPU, nccl on GPU; one GPU per local rank)."""
    if kind == "ddp":
        return DataParallel()
    if kind == "fsdp":
        return FullyShardedParallel()
    raise ValueError(f"--parallel {kind!r}; allowed: 'none', {', '.join(repr(k) for k in KINDS)}")
