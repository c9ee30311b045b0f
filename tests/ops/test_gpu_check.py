"""benchmarks/gpu_check.py's dry run: the script runs end to end on the CPU, each step in its own process, and
leaves a summary saying what passed and what was skipped for want of a GPU (the cheap steps only: the suite's
budget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def run(*arguments: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=timeout)


def test_dry_run_of_the_cheap_steps(tmp_path):
    done = run("--dry-run", "--out", str(tmp_path), "--steps", "environment,reverse_scan,cuda_build,large_probe")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = {row["step"]: row["status"] for row in json.loads((tmp_path / "summary.json").read_text())}
    assert summary == {"environment": "passed", "reverse_scan": "passed", "large_probe": "skipped (needs a GPU)",
                       "cuda_build": "skipped (needs a GPU)"}
    assert "torch" in (tmp_path / "environment.log").read_text()
    errors = [line for line in (tmp_path / "reverse_scan.log").read_text().splitlines() if "flip" in line]
    assert len(errors) == 2, errors
    assert "| reverse_scan | passed |" in (tmp_path / "summary.md").read_text()


def test_a_failing_or_unknown_step_is_reported(tmp_path):
    done = run("--dry-run", "--out", str(tmp_path), "--steps", "environment", "--budget", "5")
    assert done.returncode == 0 and "skipped (out of budget)" in (tmp_path / "summary.md").read_text()
    done = run("--dry-run", "--out", str(tmp_path), "--steps", "environment,nonsense")
    assert done.returncode == 2 and "--steps: unknown ['nonsense']" in done.stderr
