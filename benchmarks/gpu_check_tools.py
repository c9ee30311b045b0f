"""Command-line tools the GPU check calls (``nvidia-smi``, ``nvcc``, Triton's ``cuobjdump``), read into values;
shared by its steps (:mod:`benchmarks.gpu_check_steps`) and probes (:mod:`benchmarks.gpu_check_probes`)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path


def run_tool(command: list[str]) -> str:
    """The stripped standard output of ``command``, or why it could not run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return f"unavailable ({type(error).__name__})"


def cubin_resources(cubin: bytes) -> dict:
    """Registers, stack and local memory (spills) per thread of a compiled kernel, from ``cuobjdump
    --dump-resource-usage`` (the one Triton ships)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        tool = Path(knobs.nvidia.ptxas.path).with_name("cuobjdump")
        report = run_tool([str(tool), "--dump-resource-usage", str(path)])
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", report))
    return {"registers": int(found["REG"]) if "REG" in found else None,
            "stack_bytes": int(found["STACK"]) if "STACK" in found else None,
            "local_bytes": int(found["LOCAL"]) if "LOCAL" in found else None}
