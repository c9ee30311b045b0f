"""DDP and FSDP2 (gloo, 2 processes under torchrun) train exactly like one process with the same global batch,
and a 2-process FSDP checkpoint (torch.distributed.checkpoint) resumes in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridlm import HybridForCausalLM
from hybridlm.training.distributed import SingleProcess, from_environment
from hybridlm.training.loop import _param_groups

from ..helpers import assert_close_rel
from . import distributed_worker
from .conftest import args_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _losses(out: Path) -> torch.Tensor:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return torch.tensor([row["loss"] for row in rows if "loss" in row], dtype=torch.float64)


def _torchrun(parallel: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "tests.training.distributed_worker", "--parallel", parallel, "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _run_ok(parallel: str, out: Path, *extra: str) -> None:
    result = _torchrun(parallel, out, *extra)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Seven single-process steps (constant learning rate); the 2-process runs below train five."""
    out = tmp_path_factory.mktemp("single")
    distributed_worker.main(["--out", str(out), "--steps", "7"])
    return _losses(out)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_train_like_one(parallel, reference, tmp_path):
    _run_ok(parallel, tmp_path / parallel)
    losses = _losses(tmp_path / parallel)
    assert len(losses) == 5
    assert_close_rel(losses, reference[:5], rel=1e-4)
    if parallel == "fsdp":  # its checkpoint, sharded over 2 ranks, resumes in this single process
        assert (tmp_path / parallel / "checkpoint" / "dcp" / ".metadata").is_file()
        gathered = HybridForCausalLM.from_pretrained(tmp_path / parallel / "model")
        from_shards = distributed_worker.build_model()
        optimizer = torch.optim.AdamW(_param_groups(from_shards, 0.1))  # as the loop builds it
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        assert SingleProcess().load(tmp_path / parallel, from_shards, optimizer, scheduler)["step"] == 5
        for (name, expected), got in zip(from_shards.state_dict().items(), gathered.state_dict().values()):
            assert torch.equal(got, expected), name
        distributed_worker.main(["--out", str(tmp_path / parallel), "--steps", "7", "--resume"])
        resumed = _losses(tmp_path / parallel)
        assert len(resumed) == 7
        assert_close_rel(resumed[5:], reference[5:], rel=1e-4)


def test_the_recipe_under_torchrun_trains_like_one_process(corpus, model_file, tmp_path):
    """``torchrun ... recipes/pretrain.py --parallel fsdp``: the whole recipe (a BPE trained by rank 0 and received
    by rank 1, packing, evaluation, the model gathered and saved with its tokenizer) gives the single-process
    losses, and its output loads."""
    from transformers import AutoTokenizer

    from hybridlm.training import pretrain

    pretrain.main(args_for(corpus, model_file, tmp_path / "single", "--steps", "4"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "recipes/pretrain.py", "--parallel", "fsdp", "--threads", "1",
               *args_for(corpus, model_file, tmp_path / "fsdp", "--steps", "4")]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_close_rel(_losses(tmp_path / "fsdp"), _losses(tmp_path / "single"), rel=1e-4)
    assert AutoTokenizer.from_pretrained(tmp_path / "fsdp").get_vocab() == \
        AutoTokenizer.from_pretrained(tmp_path / "single").get_vocab()
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = HybridForCausalLM.from_pretrained(tmp_path / "single").eval()(ids).logits
        assert_close_rel(HybridForCausalLM.from_pretrained(tmp_path / "fsdp").eval()(ids).logits, expected, rel=1e-4)


def test_world_size_must_divide_the_micro_batch(tmp_path):
    """--batch-size 6 --grad-accum 2 gives micro-batches of 3 rows: no even split over 2 ranks. The run stops
    before training, with nothing written."""
    result = _torchrun("ddp", tmp_path / "run", "--batch-size", "6")
    assert result.returncode != 0
    assert "not divisible by the world size 2" in result.stderr
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_check_batch_names_the_flags():
    parallel = SingleProcess()
    parallel.check_batch(3)  # one process takes any micro-batch
    parallel.world_size = 4
    with pytest.raises(ValueError, match=r"--batch-size / --grad-accum = 6.*world size 4"):
        parallel.check_batch(6)


def test_parallel_outside_torchrun_is_a_clear_error(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        from_environment("ddp")
    with pytest.raises(ValueError, match="--parallel 'zero'"):
        from_environment("zero")
