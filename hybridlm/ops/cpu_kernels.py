"""Our C++ CPU scans (``kernels/cpu/scans.cpp``, shipped as ``hybridlm/_kernels/cpu``): Mamba-2's SSD as the
literal recurrence, the ``cpu`` backend of ``ssd_chunk_scan`` and the default for CPU tensors where it can run.

The chunked scan of :mod:`hybridlm.ops.ssd` issues about 240 tensor ops per call; at the state sizes of small and
mid-sized models those cost more than the arithmetic, and more still at 2 threads. The recurrence in C++ does the
same work one token at a time from registers: measured on an AVX2 EPYC (1 thread, min), 256 tokens of 8 heads x 32
x 32 in 0.34 against 1.54 ms, 2,048 tokens of 16 heads x 32 x 64 in 7.0 against 25.5 ms (``benchmarks/cpu_scan.py``).
Its threads are OpenMP's: in a torch process the library shares torch's runtime and thread pool.

The source has a plain C interface and no torch headers, so the system C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) builds it in about a second on first use, for this CPU (``-march=native``). The library is
cached under ``$HYBRIDLM_KERNEL_CACHE`` (default ``~/.cache/hybridlm/kernels``), named by a digest of the source,
the flags, the compiler and this CPU's features, written aside and renamed into place, with its sha256 beside it
(a library that fails it is built again). Without a compiler the
backend is unavailable and the reference runs. It serves inference only: a call that needs gradients, packed
sequences, float64, or runs inside ``torch.compile``, is declined to the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

from hybridlm.files import sha256_of, write_file, written_aside
from hybridlm.ops.cuda import kernel_sources
from hybridlm.ops.declined import Declined

SOURCE = kernel_sources() / "cpu" / "scans.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
CACHE_ENV = "HYBRIDLM_KERNEL_CACHE"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_FLOAT_P, _INT = ctypes.POINTER(ctypes.c_float), ctypes.c_int64
_library: ctypes.CDLL | None = None


def compiler() -> list[str] | None:
    """The command of the C++ compiler to build with: ``$CXX`` (e.g. ``ccache g++``), else the first of ``c++``,
    ``g++``, ``clang++`` on the PATH."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)
    return None if found is None else [found]


def unavailable_reason() -> str | None:
    """Why the CPU scans cannot run here, or None if they can (builds nothing)."""
    if platform.system() != "Linux":
        return f"built for Linux (OpenMP through torch's libgomp); this is {platform.system()}"
    command = compiler()
    if command is None:
        return "no C++ compiler (set CXX, or install g++ or clang++)"
    if shutil.which(command[0]) is None:
        return f"the C++ compiler {command[0]!r} (CXX) is not found"
    if not SOURCE.is_file():
        return f"the source {SOURCE} is missing"
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` builds for: the CPU's model and feature flags (a cache shared by machines with
    different CPUs must not hand one a library with instructions it lacks)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    return "\n".join(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))}))


def library_path() -> Path:
    """Where this source, built by this compiler with these flags for this CPU, is cached."""
    cxx = compiler()
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, *cxx, version, _cpu_identity()]).encode())
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridlm" / "kernels")
    return cache / f"cpu_scans-{digest.hexdigest()[:16]}.so"


def load_library() -> ctypes.CDLL:
    """The built library, building it on first use (or again when the cached one fails its digest); raises
    naming the file and the compiler's output."""
    global _library
    if _library is None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"hybridlm CPU scans: {reason}")
        path = library_path()
        if not _intact(path):
            _build(path)
        try:
            library = ctypes.CDLL(str(path))
        except OSError as error:
            raise RuntimeError(f"hybridlm CPU scans: cannot load {path} ({error}); delete it to rebuild") from None
        library.ssd_scan_f32.argtypes = [_FLOAT_P] * 8 + [_INT] * 7
        library.ssd_scan_f32.restype = None
        _library = library
    return _library


def _digest_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _intact(path: Path) -> bool:
    """Whether ``path`` is a library this module built: its sha256 is the one written beside it after the build."""
    try:
        return _digest_file(path).read_text().strip() == sha256_of(path)
    except OSError:
        return False


def _build(path: Path) -> None:
    """Compile the source into ``path`` (written aside and renamed: concurrent builders each put a whole library
    in place), then its digest beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_aside(path) as temporary:
        cxx = compiler()
        run = subprocess.run([*cxx, *FLAGS, "-o", str(temporary), str(SOURCE)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"hybridlm CPU scans: building {path} from {SOURCE} with {shlex.join(cxx)} failed:\n"
                               f"{(run.stderr or run.stdout).strip()}")
    write_file(_digest_file(path), sha256_of(path))


def _pointer(tensor: torch.Tensor | None):
    return None if tensor is None else ctypes.cast(tensor.data_ptr(), _FLOAT_P)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hybridlm.ops.ssd.ssd_chunk_scan_ref`'s contract (``chunk_size`` unused: the scan is sequential),
    for CPU tensors in inference; declines the rest. ``(y like x, final_state [batch, heads, head_dim, dstate]
    fp32)``, the arithmetic in fp32."""
    _check_servable(x, dt, A, B, C, D, initial_state)
    batch, time, heads, head_dim = x.shape
    groups, dstate = B.shape[2:]
    if (dt.shape != (batch, time, heads) or A.shape != (heads,) or B.shape != C.shape
            or B.shape[:2] != (batch, time) or heads % groups):
        raise ValueError(f"ssd_chunk_scan: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)} disagree")
    xf, dtf, Af, Bf, Cf = (t.detach().float().contiguous() for t in (x, dt, A, B, C))
    skip = None if D is None else D.detach().float().reshape(heads, -1).expand(heads, head_dim).contiguous()
    if initial_state is None:
        state = xf.new_zeros(batch, heads, head_dim, dstate)
    else:
        if initial_state.shape != (batch, heads, head_dim, dstate):
            raise ValueError(f"ssd_chunk_scan: initial_state {tuple(initial_state.shape)} is not "
                             f"{(batch, heads, head_dim, dstate)}")
        state = initial_state.detach().float().clone(memory_format=torch.contiguous_format)
    y = torch.empty_like(xf)
    load_library().ssd_scan_f32(*map(_pointer, (xf, dtf, Af, Bf, Cf, skip, state, y)), batch, time, heads, head_dim,
                                groups, dstate, torch.get_num_threads())
    return y.to(x.dtype), state


def _check_servable(*tensors: torch.Tensor | None) -> None:
    """Decline (to the reference) what the C++ scan does not serve."""
    present = [t for t in tensors if t is not None]
    if torch.compiler.is_compiling():
        raise Declined("the CPU scan is called through ctypes, which torch.compile cannot trace")
    if any(t.device.type != "cpu" for t in present):
        raise Declined("the CPU scan takes CPU tensors")
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        raise Declined("the CPU scan has no backward")
    if any(t.dtype not in DTYPES for t in present):
        raise Declined("the CPU scan computes in fp32: float64 inputs keep the reference")
    if present[0].numel() == 0:
        raise Declined("an empty sequence")
