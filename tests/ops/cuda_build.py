"""Compiling the CUDA selective-scan sources in tests.

* :func:`nvcc_compile`: the ``.cu`` files for one GPU architecture (syntax, template instantiation, register
  allocation), with the flags torch's extension builder uses.
* :func:`check_binding_syntax`: the PyTorch binding, with the host compiler against torch's headers;
* :func:`build_emulated_library`: the binding linked with the CPU emulation of the kernels (``cuda_emulation/``),
  loadable with ``torch.ops.load_library`` on a machine without a GPU.
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
    """The CUDA toolkit's include directory (for cuda_bf16.h): under $CUDA_HOME, next to nvcc, or the usual place."""
    compiler = nvcc()
    beside_nvcc = Path(compiler).resolve().parent.parent if compiler else None
    homes = [os.environ.get("CUDA_HOME"), beside_nvcc, "/usr/local/cuda"]
    found = [Path(home) / "include" for home in homes if home and (Path(home) / "include" / "cuda_bf16.h").is_file()]
    return found[0] if found else None


def host_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _run(command: list[str]) -> str:
    """Runs ``command``; returns its output (stdout, then stderr), raising with it if the command fails."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)}\nfailed with:\n{result.stdout}{result.stderr}")
    return result.stdout + result.stderr


def nvcc_compile(arch: str, out_dir: Path) -> str:
    """Compiles every ``.cu`` file for ``sm_<arch>`` with the flags torch's extension builder passes (two files at
    a time); returns ptxas's report (``-Xptxas -v``):
    one "Compiling entry function '<mangled kernel>' for 'sm_<arch>'" line per kernel instantiated, with its
    registers and spills."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # e.g. no implicit half conversions

    commands = [
        [nvcc(), *COMMON_NVCC_FLAGS, "-std=c++20", "-O3", "--compiler-options=-fPIC", "-Xptxas=-v", "-c",
         f"-gencode=arch=compute_{arch},code=sm_{arch}", str(source), "-o", str(out_dir / f"{source.stem}_sm{arch}.o")]
        for source in CUDA_SOURCES
    ]
    with ThreadPoolExecutor(2) as pool:
        return "".join(pool.map(_run, commands))


def _torch_flags() -> list[str]:
    """Host compiler flags for code using torch's C++ headers (as torch's extension builder sets them)."""
    include = Path(torch.__file__).parent / "include"
    return ["-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{KERNEL_DIR}", f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]


def check_binding_syntax() -> None:
    """Compiles binding.cpp as the extension builder would for CUDA (syntax and templates, no code generated)."""
    _run([host_compiler(), *_torch_flags(), "-fsyntax-only", str(KERNEL_DIR / "binding.cpp")])


def build_emulated_library(out_dir: Path) -> Path:
    """Compiles binding.cpp and the emulated launchers against torch and links them into a shared library."""
    flags = [*_torch_flags(), "-O1", "-DHYBRIDLM_SCAN_EMULATED", f"-DHYBRIDLM_SCAN_LIBRARY={EMULATED_LIBRARY}",
             f"-I{cuda_include()}"]
    sources = [KERNEL_DIR / "binding.cpp", EMULATION_DIR / "emulate.cpp"]
    objects = [out_dir / f"{source.stem}.o" for source in sources]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(_run, [[host_compiler(), *flags, "-c", str(s), "-o", str(o)] for s, o in zip(sources, objects)]))
    library = out_dir / f"lib{EMULATED_LIBRARY}.so"
    _run([host_compiler(), "-shared", *map(str, objects), f"-L{Path(torch.__file__).parent / 'lib'}", "-lc10",
          "-ltorch", "-ltorch_cpu", "-o", str(library)])
    return library
