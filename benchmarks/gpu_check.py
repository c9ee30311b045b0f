"""The GPU check of the kernels: one run on a fresh GPU machine (no network), every finding under one folder.

    python benchmarks/gpu_check.py [--out DIR] [--dry-run] [--steps a,b] [--budget SECONDS]

Each step runs in its own process with its own timeout (capped by what is left of ``--budget``), so a hang or an
illegal memory access loses that step only. Output folder (``--out``, else ``$OUT``, else ``gpu_check_out``):
``<step>.log`` per step, ``kernels.json`` / ``compile_sm90.json`` / ``benchmarks.md`` / ``benchmarks.json`` from
the steps that write them, and ``summary.md`` / ``summary.json`` (status and seconds of every step), rewritten
after each step so that a run cut short still leaves its results.

``--dry-run`` runs the same steps on the CPU (Triton in its interpreter, small shapes) and skips those that need
a GPU; it also compiles every Triton kernel for sm_90 (no GPU needed). Exit status: 0 if every step that ran
passed, 1 otherwise, 2 without a GPU (and no ``--dry-run``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: int
    gpu: bool  # needs a GPU (skipped by --dry-run)
    dry_run_only: bool = False  # what a GPU run measures directly


#: In the order of what a short GPU loan must not lose: correctness first, the benchmarks last. The timeouts add
#: up to more than the default budget on purpose: each step gets at most what is left, so a slow step early
#: squeezes the benchmarks, never the checks before them.
STEPS = (
    Step("environment", 60, gpu=False),
    Step("reverse_scan", 60, gpu=False),
    Step("kernels", 150, gpu=False),
    Step("compile_sm90", 1800, gpu=False, dry_run_only=True),  # about 100 compiles on the CPU
    Step("cuda_build", 180, gpu=True),
    Step("gpu_tests", 240, gpu=True),
    Step("large_probe", 60, gpu=True),
    Step("benchmarks", 180, gpu=False),
)


def run_step(name: str, out: Path, dry_run: bool) -> None:
    """Inside the step's process."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_check_steps

    getattr(gpu_check_steps, name)(out, dry_run)


def step_environment(dry_run: bool, name: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("TRITON_INTERPRET", None)  # compiled for the GPU...
    if dry_run and name != "compile_sm90":
        env["TRITON_INTERPRET"] = "1"  # ...or run by the interpreter on CPU tensors
    if not env.get("CUDA_HOME") and Path("/usr/local/cuda/bin/nvcc").exists():
        env["CUDA_HOME"] = "/usr/local/cuda"  # where torch's extension builder finds nvcc and the headers
    return env


def write_summary(out: Path, results: list[dict], started: float) -> None:
    lines = ["# GPU check", "", f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {time.perf_counter() - started:.0f} s so far",
             "", "| step | status | seconds | log |", "|---|---|---:|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r.get('seconds', 0):.0f} | {r['step']}.log |" for r in results]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="output folder")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, skipping the steps that need a GPU")
    parser.add_argument("--steps", default="", help="comma-separated steps to run (default: all)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run; default: 480 (one 8-minute GPU "
                        "run), 2400 with --dry-run")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in this process
    args = parser.parse_args()
    budget = args.budget or (2400 if args.dry_run else 480)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.step:
        run_step(args.step, out, args.dry_run)
        return 0
    names = [s.name for s in STEPS]
    wanted = [n.strip() for n in args.steps.split(",") if n.strip()] or names
    unknown = set(wanted) - set(names)
    if unknown:
        parser.error(f"--steps: unknown {sorted(unknown)}; steps: {', '.join(names)}")
    if not args.dry_run:
        probe = subprocess.run([sys.executable, "-c", "import torch, sys; sys.exit(not torch.cuda.is_available())"])
        if probe.returncode:
            print("no CUDA device visible to torch: run with --dry-run to check the script on the CPU")
            return 2
    started, results = time.perf_counter(), []
    for step in (s for s in STEPS if s.name in wanted):
        result = {"step": step.name}
        results.append(result)
        left = budget - (time.perf_counter() - started)
        if args.dry_run and step.gpu or not args.dry_run and step.dry_run_only:
            result["status"] = "skipped (needs a GPU)" if step.gpu else "skipped (measured by the kernels step)"
        elif left < 10:
            result["status"] = "skipped (out of budget)"
        else:
            timeout = min(step.timeout_s, left)
            command = [sys.executable, __file__, "--step", step.name, "--out", str(out)]
            command += ["--dry-run"] if args.dry_run else []
            print(f"== {step.name} (timeout {timeout:.0f} s)", flush=True)
            begin = time.perf_counter()
            with open(out / f"{step.name}.log", "w") as log:
                try:
                    code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                                          env=step_environment(args.dry_run, step.name)).returncode
                    result["status"] = "passed" if code == 0 else f"FAILED (exit {code})"
                except subprocess.TimeoutExpired:
                    result["status"] = f"TIMED OUT after {timeout:.0f} s"
            result["seconds"] = time.perf_counter() - begin
            tail = (out / f"{step.name}.log").read_text().splitlines()[-12:]
            print("\n".join(f"   {line}" for line in tail))
        print(f"-- {step.name}: {result['status']}", flush=True)
        write_summary(out, results, started)
    print(f"wrote {out / 'summary.md'}")
    return 0 if all(r["status"] == "passed" or r["status"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
