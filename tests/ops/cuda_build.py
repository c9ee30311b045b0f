"""Compiling the CUDA selective-scan sources in tests.

* :func:`nvcc_compile`: the ``.cu`` files for one GPU architecture (syntax, template instantiation, register
  allocation), with the flags torch's extension builder uses.
* :func:`build_emulated_library`: the PyTorch binding linked with the CPU emulation of the kernels
  (``cuda_emulation/``), loadable with ``torch.ops.load_library`` on a machine without a GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hybridlm.ops.cuda import KERNEL_DIR, SOURCES

EMULATION_DIR = Path(__file__).parent / "cuda_emulation"
EMULATED_LIBRARY = "hybridlm_selective_scan_emulated"
CUDA_SOURCES = [KERNEL_DIR / name for name in SOURCES if name.endswith(".cu")]


def nvcc() -> str | None:
    return shutil.which("nvcc")


def cuda_include() -> Path | None:
    """The CUDA toolkit's include directory (for cuda_bf16.h), found next to nvcc."""
    compiler = nvcc()
    include = Path(compiler).resolve().parent.parent / "include" if compiler else None
    return include if include is not None and (include / "cuda_bf16.h").is_file() else None


def host_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)}\nfailed with:\n{result.stdout}{result.stderr}")


def nvcc_compile(arch: str, out_dir: Path) -> list[Path]:
    """Compiles every ``.cu`` file for ``sm_<arch>`` (two at a time); returns the object files."""
    objects = [out_dir / f"{source.stem}_sm{arch}.o" for source in CUDA_SOURCES]
    commands = [
        [nvcc(), "-std=c++20", "-O3", "-c", f"-gencode=arch=compute_{arch},code=sm_{arch}", str(source), "-o",
         str(obj)]
        for source, obj in zip(CUDA_SOURCES, objects)
    ]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(_run, commands))
    return objects


def build_emulated_library(out_dir: Path) -> Path:
    """Compiles binding.cpp and the emulated launchers against torch and links them into a shared library."""
    torch_dir = Path(torch.__file__).parent
    flags = [
        "-std=c++20", "-O1", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-DHYBRIDLM_SCAN_EMULATED", f"-DHYBRIDLM_SCAN_LIBRARY={EMULATED_LIBRARY}",
        f"-I{KERNEL_DIR}", f"-I{cuda_include()}", f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    sources = [KERNEL_DIR / "binding.cpp", EMULATION_DIR / "emulate.cpp"]
    objects = [out_dir / f"{source.stem}.o" for source in sources]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(_run, [[host_compiler(), *flags, "-c", str(s), "-o", str(o)] for s, o in zip(sources, objects)]))
    library = out_dir / f"lib{EMULATED_LIBRARY}.so"
    _run([host_compiler(), "-shared", *map(str, objects), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch",
          "-ltorch_cpu", "-o", str(library)])
    return library
