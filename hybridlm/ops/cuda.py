"""Our CUDA C++ selective scan (``kernels/selective_scan`` at the top of the repository), with the signature of
``selective_scan_ref``. The sources ship inside the package as ``hybridlm/_kernels`` (package data mapped from
``kernels/`` by ``setup.py``), so a wheel install can build it; see :func:`kernel_sources`.

The extension is compiled on first use on a CUDA machine by ``torch.utils.cpp_extension.load`` (about a minute;
the result is cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) and registers the
operators ``torch.ops.hybridlm_selective_scan.forward`` / ``.backward``. Nothing here imports CUDA tooling until
then, so this module imports everywhere. Set ``HYBRIDLM_BUILD_VERBOSE=1`` to see the compiler's output;
``hybridlm build-kernels`` builds it ahead of the first forward pass. Calls it cannot take (float64, a state
larger than ``MAX_DSTATE``) are declined, so the backend selection runs the next backend.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path
from time import perf_counter

import torch

from hybridlm.ops.declined import Declined


def kernel_sources() -> Path:
    """The folder of the CUDA sources: ``hybridlm/_kernels`` of an installed wheel, else (a source checkout, an
    editable install) the repository's ``kernels/`` beside the package."""
    spec = importlib.util.find_spec("hybridlm._kernels")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "kernels"


KERNEL_DIR = kernel_sources() / "selective_scan"
SOURCES = ("binding.cpp", "selective_scan_fwd.cu", "selective_scan_bwd.cu")
LIBRARY = "hybridlm_selective_scan"
MIN_CAPABILITY = (8, 0)
MAX_DSTATE = 256  # kMaxState in selective_scan.h
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_library = None
_build_error: str | None = None
_log = logging.getLogger(__name__)


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the extension cannot run on ``device`` (a CUDA device; None: the current one), or None if it can.

    Does not build anything: an extension that is not built yet but can be is reported available.
    """
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"needs compute capability >= 8.0 (sm_80); this GPU is sm_{capability[0]}{capability[1]}"
    if _library is not None:
        return None
    if _build_error is not None:
        return f"the build failed: {_build_error}"
    missing = [name for name in SOURCES if not (KERNEL_DIR / name).is_file()]
    if missing:
        return f"CUDA sources {missing} not found in {KERNEL_DIR} (an incomplete hybridlm install?)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "include" / "cuda_runtime.h").is_file():
        return (f"no CUDA toolkit found (torch looks in $CUDA_HOME, else next to nvcc on the PATH; it got "
                f"{CUDA_HOME}): set CUDA_HOME to the toolkit's directory")
    if importlib.util.find_spec("ninja") is None and shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja): torch needs it to build extensions"
    return None


def load_library():
    """Builds the extension if needed (first use only) and returns its operators, ``torch.ops.<LIBRARY>``."""
    global _library, _build_error
    if _library is None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"hybridlm CUDA selective scan unavailable: {reason}")
        from torch.utils.cpp_extension import load

        _log.warning("hybridlm: building the CUDA selective scan (once, about a minute; cached under "
                     "TORCH_EXTENSIONS_DIR). `hybridlm build-kernels` builds it ahead of time.")
        started = perf_counter()
        try:
            load(
                name=LIBRARY,
                sources=[str(KERNEL_DIR / name) for name in SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3"],
                is_python_module=False,
                verbose=os.environ.get("HYBRIDLM_BUILD_VERBOSE") == "1",
            )
        except Exception as error:
            _build_error = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error) else ''}"
            raise RuntimeError(
                f"building the hybridlm CUDA selective scan failed ({_build_error}); "
                "rerun with HYBRIDLM_BUILD_VERBOSE=1 for the compiler output"
            ) from error
        _library = getattr(torch.ops, LIBRARY)
        _log.warning("hybridlm: CUDA selective scan ready after %.0f s", perf_counter() - started)
    return _library


def check_arguments(u, delta, A, B, C, D=None, z=None, delta_bias=None, initial_state=None) -> None:
    """Raises :class:`Declined` for a well-formed call the kernels do not take (the next backend can), and
    ValueError naming the first argument whose shape or device is wrong."""
    if u.dim() != 3:
        raise ValueError(f"selective_scan: u must be [batch, dim, time], got {tuple(u.shape)}")
    if u.dtype not in DTYPES:
        raise Declined(f"the CUDA selective scan takes u in float32, float16 or bfloat16, got {u.dtype}")
    if A.dim() == 2 and A.shape[1] > MAX_DSTATE:
        raise Declined(f"the CUDA selective scan takes dstate <= {MAX_DSTATE}, got A {tuple(A.shape)}")
    batch, dim, time = u.shape
    if A.dim() != 2 or A.shape[0] != dim or A.shape[1] < 1:
        raise ValueError(f"selective_scan: A must be [dim={dim}, dstate <= {MAX_DSTATE}], got {tuple(A.shape)}")
    dstate = A.shape[1]
    expected = {"delta": (u.shape, delta), "z": (u.shape, z), "D": ((dim,), D), "delta_bias": ((dim,), delta_bias),
                "initial_state": ((batch, dim, dstate), initial_state)}
    for name, (shape, tensor) in expected.items():
        if tensor is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"selective_scan: {name} must be {list(shape)}, got {list(tensor.shape)}")
    for name, tensor in (("B", B), ("C", C)):
        grouped = tensor.dim() == 4
        if tensor.dim() not in (3, 4) or tensor.shape[0] != batch or tensor.shape[-2:] != (dstate, time):
            raise ValueError(f"selective_scan: {name} must be [batch, dstate, time] or [batch, groups, dstate, time] "
                             f"with batch={batch}, dstate={dstate}, time={time}; got {list(tensor.shape)}")
        if grouped and dim % tensor.shape[1]:
            raise ValueError(f"selective_scan: {tensor.shape[1]} groups of {name} do not divide dim={dim}")
    tensors = {"delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z, "delta_bias": delta_bias,
               "initial_state": initial_state}
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != u.device:
            raise ValueError(f"selective_scan: {name} is on {tensor.device}, u on {u.device}")


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``selective_scan_ref`` on CUDA tensors, forward and backward in CUDA. ``chunk_size`` is accepted and
    ignored: it changes only the rounding, and the kernels' chunk is fixed."""
    check_arguments(u, delta, A, B, C, D, z, delta_bias, initial_state)
    if u.device.type != "cuda":
        raise ValueError(f"the CUDA selective scan needs CUDA tensors, got {u.device}")
    return scan_with(load_library(), u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)


def _time_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).contiguous()


def _optional_floats(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.float().contiguous()


def scan_with(library, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None):
    """The scan through ``library``'s operators (the CUDA build, or the tests' CPU emulation of the same kernels),
    with autograd. Inputs are brought to the kernels' layout here, so autograd maps their gradients back."""
    dtype = u.dtype
    B4, C4 = (x if x.dim() == 4 else x.unsqueeze(1) for x in (B, C))
    return _SelectiveScan.apply(
        library, bool(delta_softplus), u.contiguous(), _time_major(delta, dtype), A.float().contiguous(),
        _time_major(B4, dtype), _time_major(C4, dtype), _optional_floats(D),
        None if z is None else _time_major(z, dtype), _optional_floats(delta_bias), _optional_floats(initial_state),
    )


def _stream(x: torch.Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, library, softplus, u, delta, A, B, C, D, z, delta_bias, initial_state):
        keep = any(ctx.needs_input_grad)
        out, final_state, chunk_states = library.forward(
            u, delta, A, B, C, D, z, delta_bias, softplus, initial_state, keep, _stream(u)
        )
        ctx.library, ctx.softplus = library, softplus
        if keep:
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, chunk_states)
        return out, final_state

    @staticmethod
    def backward(ctx, dout, dfinal_state):
        u, delta, A, B, C, D, z, delta_bias, chunk_states = ctx.saved_tensors
        want_dinitial = ctx.needs_input_grad[10]
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial = ctx.library.backward(
            u, delta, A, B, C, D, z, delta_bias, ctx.softplus, chunk_states, dout.contiguous(),
            dfinal_state.contiguous(), want_dinitial, _stream(u),
        )
        return (
            None, None, du, ddelta, dA, dB.to(B.dtype), dC.to(C.dtype),
            dD if D is not None else None, dz if z is not None else None,
            ddelta_bias if delta_bias is not None else None, dinitial if want_dinitial else None,
        )
