"""The steps of ``benchmarks/gpu_check.py``, each run in its own process: ``step(out_dir, dry_run)`` prints its
findings (the caller keeps them in ``OUT/<step>.log``) and raises on failure. Imports happen inside the steps, after
the caller has set ``TRITON_INTERPRET`` for a dry run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check_tools import run_tool

ROOT = Path(__file__).resolve().parents[1]


def environment(out: Path, dry_run: bool) -> None:
    """GPU, driver, torch, Triton, nvcc and the optional libraries; the backend report."""
    import torch
    import triton

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch CUDA": torch.version.cuda,
            "triton": triton.__version__, "nvcc": run_tool(["nvcc", "--version"]).splitlines()[-1:],
            "nvidia-smi": run_tool(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                    "--format=csv,noheader"]),
            "CUDA_HOME": os.environ.get("CUDA_HOME")}
    if torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    for name in ("ninja", "fla", "mamba_ssm", "causal_conv1d", "flash_attn"):
        info[name] = "installed" if importlib.util.find_spec(name) else "not installed"
    print(json.dumps(info, indent=1))
    from hybridlm.ops import report

    print(report("cuda" if torch.cuda.is_available() else "cpu"))


def reverse_scan(out: Path, dry_run: bool) -> None:
    """The selective-scan backward's reversed recurrence (forward scan between flips) on this device, and, for the
    record, Triton's own ``associative_scan(reverse=True)`` with the same order-dependent combine."""
    import torch

    device = "cpu" if dry_run else "cuda"
    torch.manual_seed(0)
    for rows in (16, 64):
        a, b = torch.rand(rows, 4, 16, device=device) + 0.5, torch.randn(rows, 4, 16, device=device)
        expected, carry = torch.zeros(rows, 4, 16, dtype=torch.float64), torch.zeros(4, 16, dtype=torch.float64)
        for t in reversed(range(rows)):
            carry = b[t].double().cpu() + a[t].double().cpu() * carry
            expected[t] = carry
        errors = {}
        for method in ("flip", "reverse=True"):
            got = reversed_recurrence(a, b, method).double().cpu()
            errors[method] = float((got - expected).abs().max() / expected.abs().max())
        print(f"rows {rows}: max relative error " + ", ".join(f"{m} {e:.2e}" for m, e in errors.items()))
        if errors["flip"] > 1e-5:
            raise AssertionError(f"the flip-based reversed scan is wrong on {device}: {errors['flip']:.3g}")


def kernels(out: Path, dry_run: bool) -> None:
    """Each Triton kernel once at model shapes (bf16 and fp32, forward and backward): error against the reference
    and, compiled, its registers, spills and shared memory."""
    from benchmarks.gpu_check_probes import kernel_errors

    rows, resources = kernel_errors("cpu" if dry_run else "cuda", small=dry_run)
    (out / "kernels.json").write_text(json.dumps({"errors": rows, "resources": resources}, indent=1))
    failed = [row for row in rows if not row["ok"]]
    if failed:
        raise AssertionError(f"{len(failed)} kernel results out of tolerance: {failed}")


def compile_sm90(out: Path, dry_run: bool) -> None:
    """Compile every Triton kernel for sm_90 at model shapes without a GPU (registers, spills, shared memory):
    catches compile errors and configurations that do not fit before a GPU run."""
    from benchmarks.gpu_check_probes import compile_for_sm90

    resources = compile_for_sm90(out / "compile_sm90.json")
    too_big = {name: r for name, r in resources.items() if r["shared_bytes"] > 232_448}
    if too_big:
        raise AssertionError(f"kernels over the 227 KiB of shared memory per block of sm_90: {too_big}")


def cuda_build(out: Path, dry_run: bool) -> None:
    """Build the CUDA selective scan (timed), then its tests on the GPU."""
    from hybridlm.ops import cuda

    reason = cuda.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the CUDA extension cannot be built here: {reason}")
    started = time.perf_counter()
    cuda.load_library()
    print(f"built in {time.perf_counter() - started:.1f} s")
    _pytest(["tests/ops/test_cuda_scan.py", "-k", "cuda"], per_test_s=60)


#: What the GPU run of the tests leaves out: CPU-only checks that the CPU suite runs anyway (nvcc compiles, the
#: CUDA emulation, this script's dry run, the benchmark runners), so the step's minutes go to the GPU.
CPU_ONLY_TESTS = ["--ignore=tests/ops/test_cuda_sources.py", "--ignore=tests/ops/test_gpu_check.py",
                  "--ignore=tests/ops/test_gpu_benchmarks.py", "-k", "not emulated"]


def gpu_tests(out: Path, dry_run: bool) -> None:
    """The GPU-relevant tests (kernels, backends, the mixers through them)."""
    _pytest(["tests/ops", "tests/mixers", *CPU_ONLY_TESTS], per_test_s=60)


def _pytest(arguments: list[str], per_test_s: int) -> None:
    # faulthandler_timeout prints the stack of a test that hangs past per_test_s (the step's timeout then ends it)
    command = [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-o", f"faulthandler_timeout={per_test_s}", *arguments]
    print(" ".join(command), flush=True)
    status = subprocess.run(command, cwd=ROOT).returncode
    if status:
        raise AssertionError(f"pytest exited with {status}")


def large_probe(out: Path, dry_run: bool) -> None:
    """Kernels on tensors past 2**31 elements (32-bit offsets would wrap): the last rows against the reference."""
    from benchmarks.gpu_check_probes import large_tensor_probe

    large_tensor_probe()


def benchmarks(out: Path, dry_run: bool) -> None:
    """benchmarks/gpu_kernels.py: every backend against the reference, mamba-ssm and fla where installed."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "--out", str(out)]
    if dry_run:
        command += ["--device", "cpu", "--quick", "--repeats", "1", "--only", "causal_conv1d_update"]
    print(" ".join(command), flush=True)
    status = subprocess.run(command, cwd=ROOT).returncode
    if status:
        raise AssertionError(f"gpu_kernels.py exited with {status}")


# ---- probes -----------------------------------------------------------------------------------------------------

def reversed_recurrence(a, b, method: str):
    """``out[t] = b[t] + a[t] out[t + 1]`` over the rows of ``[rows, 4, 16]`` tiles, by ``method``: "flip" (a
    forward scan between flips, as the selective-scan backward does it) or "reverse=True" (Triton's reversed scan)."""
    import torch

    from benchmarks.gpu_check_kernels import reversed_recurrence_kernel

    out = torch.full_like(a, float("nan"))
    rows, cols, depth = a.shape
    reversed_recurrence_kernel[(1,)](a, b, out, rows, rows.bit_length() - 1, cols, depth, FLIP=method == "flip")
    return out
