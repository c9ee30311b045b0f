"""``torchrun ... recipes/distill.py --parallel ddp|fsdp`` (2 gloo processes) distils exactly like one process with
the same global batch: the same losses in both stages (stage 1's new mixers wrapped or sharded alone, stage 2's
whole student) and the same student at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridlm.training import distill

from ..helpers import assert_close_rel
from .test_distill import one_thread, recipe_args, teacher_dir  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _losses(out: Path, stage: str) -> torch.Tensor:
    rows = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
    return torch.tensor([row["loss"] for row in rows if "loss" in row], dtype=torch.float64)


@pytest.fixture(scope="module")
def single(teacher_dir, corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("distill") / "single"
    threads = torch.get_num_threads()
    distill.main(recipe_args(teacher_dir, corpus, out, "--steps", "3"))
    torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_distil_like_one(parallel, single, teacher_dir, corpus, tmp_path):  # noqa: F811
    out = tmp_path / parallel
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "recipes/distill.py", "--parallel", parallel, *recipe_args(teacher_dir, corpus, out, "--steps", "3")]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    for stage in ("transfer", "finetune"):
        assert len(_losses(out, stage)) == 3
        assert_close_rel(_losses(out, stage), _losses(single, stage), rel=1e-4)
    expected, got = load_file(single / "model.safetensors"), load_file(out / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert_close_rel(got[name], expected[name], rel=1e-3)
    if parallel == "fsdp":  # stage 2's checkpoint is sharded (torch.distributed.checkpoint)
        assert (out / "finetune" / "checkpoint" / "dcp" / ".metadata").is_file()
