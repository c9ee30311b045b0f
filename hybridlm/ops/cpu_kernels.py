"""Our C++ CPU kernels (``kernels/cpu/``, shipped as ``hybridlm/_kernels/cpu``): Mamba-2's SSD, Mamba-1's selective
scan and the gated delta rule as the literal recurrences (``scans.cpp``), and the short causal convolution with its
SiLU (``conv.cpp``). They are the ``cpu`` backend of ``ssd_chunk_scan``, ``selective_scan``, ``gated_delta_rule``
and ``causal_conv1d``, and their default on CPU tensors where they can run.

The chunked references issue hundreds of tensor ops per call (about 240 for the SSD) and stream their
intermediates through memory; at the state sizes of small and mid-sized models that costs more than the
arithmetic, and more still at 2 threads. The recurrences in C++ do the same work one token at a time from
registers. Measured on an AVX2 EPYC, 1 thread, min, reference against C++ (``benchmarks/cpu_scan.py``): the SSD of
256 tokens of 8 heads x 32 x 32 in 1.54 against 0.34 ms, of 2,048 tokens of 16 heads x 32 x 64 in 25.5 against
7.0 ms; Mamba-1's scan of 2,048 tokens of 512 channels x 16 in 88.6 against 32.3 ms. The reference convolution
is a concatenation, one tensor op per tap and a SiLU, each a pass over memory; the kernel reads each token's
channels once. Their threads are OpenMP's: in a torch process the library shares torch's runtime and thread pool.

The sources have a plain C interface and no torch headers, so the system C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) builds them in about a second on first use, for this CPU (``-march=native``). The library
is cached under ``$HYBRIDLM_KERNEL_CACHE`` (default ``~/.cache/hybridlm/kernels``), named by a digest of the
sources, the flags, the compiler and this CPU's features, written aside and renamed into place, with its sha256
beside it (a library that fails it, or passes it and does not load, is built again). Without a compiler the
backend is unavailable and the references run. It serves inference only: a call that needs gradients, packed
sequences, float64, or runs inside ``torch.compile``, is declined to the reference, as is a convolution of
reduced-precision inputs.

The decode-step linears and attention (``linear.cpp``, ``integer_linear.cpp``, ``attention.cpp``) are instead the
C++ kernels of the dispatcher ops ``torch.ops.hybridlm.cpu_linear``, ``cpu_packed_linear``, ``cpu_int8_linear``
and ``cpu_attention`` (``torch_ops.cpp``, built against torch's headers into a second library, about 12 s on first
use, and loaded by :func:`load_torch_ops`; their schemas and fake kernels are defined here): a compiled decode
step calls them hundreds of times, and a call into C++ from the graph costs ~7 us where one into a Python kernel
costs ~25.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridlm.files import sha256_of, write_file, written_aside
from hybridlm.ops.causal_conv1d import conv_shapes
from hybridlm.ops.cuda import kernel_sources
from hybridlm.ops.declined import Declined
from hybridlm.ops.delta_rule import _check as check_delta_rule
from hybridlm.ops.selective_scan import scan_shapes, skip_and_gate

SOURCE_DIR = kernel_sources() / "cpu"
#: built into one plain C library (ctypes), with the headers beside them
SOURCES = ("scans.cpp", "conv.cpp")
#: built against torch's headers into the library of our dispatcher ops' CPU kernels (see load_torch_ops)
TORCH_OPS_SOURCES = ("torch_ops.cpp", "linear.cpp", "integer_linear.cpp", "attention.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC")
CACHE_ENV = "HYBRIDLM_KERNEL_CACHE"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# the C side takes float*: addresses pass as plain integers, which ctypes converts faster than typed pointers
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_library: ctypes.CDLL | None = None


def compiler() -> list[str] | None:
    """The command of the C++ compiler to build with: ``$CXX`` (e.g. ``ccache g++``), else the first of ``c++``,
    ``g++``, ``clang++`` on the PATH."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)
    return None if found is None else [found]


def unavailable_reason() -> str | None:
    """Why the CPU kernels cannot run here, or None if they can (builds nothing)."""
    if platform.system() != "Linux":
        return f"built for Linux (OpenMP through torch's libgomp); this is {platform.system()}"
    command = compiler()
    if command is None:
        return "no C++ compiler (set CXX, or install g++ or clang++)"
    if shutil.which(command[0]) is None:
        return f"the C++ compiler {command[0]!r} (CXX) is not found"
    missing = [str(SOURCE_DIR / name) for name in SOURCES + TORCH_OPS_SOURCES if not (SOURCE_DIR / name).is_file()]
    if missing:
        return f"sources missing: {', '.join(missing)}"
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` builds for: the CPU's model and feature flags (a cache shared by machines with
    different CPUs must not hand one a library with instructions it lacks)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    return "\n".join(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))}))


def library_path(name: str = "cpu_kernels", flags: tuple[str, ...] | None = None) -> Path:
    """Where library ``name`` of these sources (and headers), built by this compiler with ``flags`` (default
    :data:`FLAGS`) for this CPU, is cached."""
    flags = FLAGS if flags is None else flags
    cxx = compiler()
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    sources = [path.read_text() for path in sorted(SOURCE_DIR.iterdir()) if path.suffix in (".cpp", ".h")]
    digest = hashlib.sha256("\0".join([*sources, *flags, *cxx, version, _cpu_identity()]).encode())
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridlm" / "kernels")
    return cache / f"{name}-{digest.hexdigest()[:16]}.so"


def load_library() -> ctypes.CDLL:
    """The built library, building it on first use (or again when the cached one fails its digest or does not
    load); raises naming the file and the compiler's output."""
    global _library
    if _library is None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"hybridlm CPU kernels: {reason}")
        library = _load_built(library_path(), SOURCES, FLAGS, ctypes.CDLL)
        library.ssd_scan_f32.argtypes = [_POINTER] * 8 + [_INT] * 7
        library.selective_scan_f32.argtypes = [_POINTER] * 7 + [_INT] * 6
        library.gated_delta_rule_f32.argtypes = [_POINTER] * 7 + [ctypes.c_float] + [_INT] * 8
        library.causal_conv1d_f32.argtypes = [_POINTER, _INT, _INT] + [_POINTER] * 5 + [_INT] * 6
        for function in (library.ssd_scan_f32, library.selective_scan_f32, library.gated_delta_rule_f32,
                         library.causal_conv1d_f32):
            function.restype = None
        _library = library
    return _library


def _load_built(path: Path, sources: tuple[str, ...], flags: tuple[str, ...], load):
    """``load(path)`` of the library built from ``sources``: built first where the cache lacks it or it fails its
    digest, and built again once where a whole one does not load (e.g. a system library it links has changed)."""
    if not _intact(path):
        _build(path, sources, flags)
    try:
        return load(str(path))
    except OSError:
        _build(path, sources, flags)
    try:
        return load(str(path))
    except OSError as error:
        raise RuntimeError(f"hybridlm CPU kernels: cannot load {path}, even rebuilt ({error})") from None


def _digest_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _intact(path: Path) -> bool:
    """Whether ``path`` is a library this module built: its sha256 is the one written beside it after the build."""
    try:
        return _digest_file(path).read_text().strip() == sha256_of(path)
    except OSError:
        return False


def _build(path: Path, sources: tuple[str, ...], flags: tuple[str, ...]) -> None:
    """Compile ``sources`` into ``path`` (written aside and renamed: concurrent builders each put a whole library
    in place), then its digest beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_aside(path) as temporary:
        cxx = compiler()
        files = [str(SOURCE_DIR / name) for name in sources]
        # the flags after the sources: libraries (-l) link only what the sources before them need
        run = subprocess.run([*cxx, *files, *flags, "-o", str(temporary)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"hybridlm CPU kernels: building {path} from {SOURCE_DIR} with {shlex.join(cxx)} "
                               f"failed:\n"
                               f"{(run.stderr or run.stdout).strip()}")
    write_file(_digest_file(path), sha256_of(path))


def _torch_flags() -> tuple[str, ...]:
    """FLAGS and what a library against torch's C++ API needs: its headers (C++20), its libraries found where they
    are at run time, its C++ ABI."""
    from torch.utils import cpp_extension

    includes = tuple(f"-I{path}" for path in cpp_extension.include_paths())
    libraries = tuple(arg for path in cpp_extension.library_paths() for arg in (f"-L{path}", f"-Wl,-rpath,{path}"))
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return (*(flag for flag in FLAGS if not flag.startswith("-std")), "-std=c++20", abi, *includes, *libraries,
            "-lc10", "-ltorch_cpu", "-ltorch")


_torch_ops_loaded: bool | None = None


def load_torch_ops() -> None:
    """Register our ops' C++ CPU kernels with torch's dispatcher (``torch_ops.cpp``), building them on first use
    (about 12 s: torch's headers) into the same cache; raises naming the file and the compiler's output. Their
    schemas are defined below in Python (see the module docstring for why the kernels are C++)."""
    global _torch_ops_loaded
    if _torch_ops_loaded:
        return
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"hybridlm CPU kernels: {reason}")
    flags = _torch_flags()
    path = library_path(f"torch_ops-{torch.__version__}", flags)  # built against this torch's headers
    _load_built(path, TORCH_OPS_SOURCES, flags, torch.ops.load_library)
    _torch_ops_loaded = True


@torch.compiler.assume_constant_result
def torch_ops_ready() -> bool:
    """Whether our ops' C++ kernels are registered (loading them on the first call; a constant to a compiled
    graph); a failure is reported once as a warning, and the callers keep torch's own paths."""
    global _torch_ops_loaded
    if _torch_ops_loaded is None:
        try:
            load_torch_ops()
        except RuntimeError as error:
            warnings.warn(f"{error}; hybridlm keeps torch's own products and attention for bf16 and int8 decode "
                          "steps", stacklevel=2)
            _torch_ops_loaded = False
    return _torch_ops_loaded


def _pointer(tensor: torch.Tensor | None):
    """The address of an fp32 ``tensor``'s data (None: a null pointer); the caller keeps the tensor alive until the C
    call returns."""
    return None if tensor is None else tensor.data_ptr()


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
    state = _initial_state(initial_state, (batch, heads, head_dim, dstate), x)
    y = torch.empty_like(xf)
    load_library().ssd_scan_f32(*map(_pointer, (xf, dtf, Af, Bf, Cf, skip, state, y)), batch, time, heads, head_dim,
                                groups, dstate, torch.get_num_threads())
    return y.to(x.dtype), state


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
    """:func:`hybridlm.ops.selective_scan.selective_scan_ref`'s contract (``chunk_size`` unused: the scan is
    sequential), for CPU tensors in inference; declines the rest. ``(y [batch, dim, time] like u, final_state
    [batch, dim, dstate] fp32)``; the step, the skip and the gate as the reference computes them, the scan in C++."""
    _check_servable(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, time, dstate = scan_shapes(u, delta, A)
    Bt, Ct = (_time_major(t, name, batch, time, dstate) for t, name in ((B, "B"), (C, "C")))
    groups = Bt.shape[2]
    if Ct.shape[2] != groups or dim % groups:
        raise ValueError(f"selective_scan: B and C have {groups} and {Ct.shape[2]} groups; they must agree and "
                         f"divide dim={dim}")
    step = delta.detach().float()
    if delta_bias is not None:
        step = step + delta_bias.detach().float().unsqueeze(-1)
    if delta_softplus:
        step = F.softplus(step)
    state = _initial_state(initial_state, (batch, dim, dstate), u)
    ut, stept = (t.transpose(1, 2).contiguous() for t in (u.detach().float(), step))  # [batch, time, dim]
    rates, y = A.detach().float().contiguous(), torch.empty_like(ut)  # (named: alive until the call returns)
    load_library().selective_scan_f32(*map(_pointer, (ut, stept, rates, Bt, Ct, state, y)), batch, time, dim, groups,
                                      dstate, torch.get_num_threads())
    return skip_and_gate(y.transpose(1, 2), u, D, z), state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gate: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hybridlm.ops.delta_rule.gated_delta_rule_ref`'s contract (``chunk_size`` unused: the recurrence is
    sequential), for CPU tensors in inference; declines the rest. ``(o like v, final_state [batch, heads, dim_k,
    dim_v] fp32)``, the arithmetic in fp32."""
    _check_servable(q, k, v, log_gate, beta, initial_state)
    check_delta_rule(q, k, v, log_gate, beta, initial_state)
    batch, time, heads, dim_v = v.shape
    key_heads, dim_k = q.shape[-2:]
    qf, kf, vf, betaf = (t.detach().float().contiguous() for t in (q, k, v, beta))
    gates = None if log_gate is None else log_gate.detach().float().contiguous()
    state = _initial_state(initial_state, (batch, heads, dim_k, dim_v), v)
    o = torch.empty_like(vf)
    load_library().gated_delta_rule_f32(
        *map(_pointer, (qf, kf, vf, gates, betaf, state, o)), dim_k**-0.5 if scale is None else scale, batch, time,
        heads, key_heads, dim_k, dim_v, 1 if gates is None or gates.dim() == 3 else dim_k, torch.get_num_threads())
    return o.to(v.dtype), state


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hybridlm.ops.causal_conv1d.causal_conv1d_ref`'s contract for fp32 CPU tensors in inference (no
    packed sequences); declines the rest. ``(y [batch, channels, time], final_state [batch, channels, width -
    1])``, ``y`` a view of a time-major ``[batch, time, channels]`` tensor (the layout the mixers go on in)."""
    _check_servable(x, weight, bias, initial_state)
    if x.dtype != torch.float32:
        raise Declined("the CPU conv takes fp32 inputs (the reference rounds a reduced-precision conv before its "
                       "activation)")
    batch, channels, time, width = conv_shapes(x, weight, activation, initial_state)
    if x.stride(1) != 1:  # channels contiguous: each tap is a vector operation across them
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    taps = weight.detach().float().t().contiguous()  # [width, channels]
    bias = torch.zeros(channels) if bias is None else bias.detach().float().contiguous()  # + 0 changes no sum
    window = None if initial_state is None else initial_state.detach().float().contiguous()
    y = torch.empty(batch, time, channels)
    final = torch.empty(batch, channels, width - 1)
    load_library().causal_conv1d_f32(_pointer(x), x.stride(0), x.stride(2), *map(_pointer, (
        window, taps, bias, y, final)), batch, time, channels, width, activation == "silu", torch.get_num_threads())
    return y.transpose(1, 2), final


# Defined on the dispatcher directly: a ``torch.library.custom_op`` costs ~10 us more per call.
_ops = torch.library.Library("hybridlm", "FRAGMENT")
_ops.define("cpu_linear(Tensor x, Tensor weight, Tensor? scale, Tensor? zero_point, Tensor? bias) -> Tensor")
_ops.define("cpu_packed_linear(Tensor x, Tensor packed, int out_features, Tensor? scale, Tensor? zero_point, "
            "Tensor? bias) -> Tensor")
_ops.define("cpu_int8_linear(Tensor x, Tensor codes, Tensor scales, int out_features, Tensor? bias) -> Tensor")
_ops.define("cpu_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale) -> Tensor")


@torch.library.register_fake("hybridlm::cpu_linear")
def _(x, weight, scale, zero_point, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("hybridlm::cpu_packed_linear")
def _(x, packed, out_features, scale, zero_point, bias):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("hybridlm::cpu_int8_linear")
def _(x, codes, scales, out_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("hybridlm::cpu_attention")
def _(q, k, v, mask, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def linear_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                zero_point: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ ((weight - zero_point) * scale)^T + bias``, like ``x``: ``x [..., in]`` fp32 or bf16 on the CPU,
    ``weight [out, in]`` bf16, or int8 codes with ``scale`` (fp32) and optionally ``zero_point`` (int8), each
    ``[out]`` (or ``[out, 1]``); ``bias [out]`` of any float dtype. Summed in fp32, rounded once (``linear.cpp``).
    The op ``torch.ops.hybridlm.cpu_linear``, whose C++ kernel this loads first. Inference only (no gradient);
    :mod:`hybridlm.ops.cpu_linear` decides where it is the faster product."""
    load_torch_ops()
    return torch.ops.hybridlm.cpu_linear(x, weight, scale, zero_point, bias)


#: outputs of a block of a packed weight (``linear.cpp``'s ``kPackedOutputs``)
PACKED_OUTPUTS = 16


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (bf16, int8 codes, or their group scales) in blocks of :data:`PACKED_OUTPUTS` outputs,
    ``[ceil(out / 16), in, 16]``, the outputs past ``out`` zero: the layout of ``cpu_packed_linear``, whose threads
    each read their blocks as one stream. Plain tensor ops, so that inductor's freezing folds them into a constant
    of the graph where the weight is one."""
    out, features = weight.shape
    blocks = -(-out // PACKED_OUTPUTS)
    padded = F.pad(weight, (0, 0, 0, blocks * PACKED_OUTPUTS - out)) if out % PACKED_OUTPUTS else weight
    return padded.view(blocks, PACKED_OUTPUTS, features).transpose(1, 2).contiguous()  # [blocks, in, 16]


def packed_linear_rows(x: torch.Tensor, packed: torch.Tensor, out_features: int, scale: torch.Tensor | None = None,
                       zero_point: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_rows` over :func:`pack_linear_weight`'s ``packed`` weight of ``out_features`` outputs (the op
    ``torch.ops.hybridlm.cpu_packed_linear``), the weights read as one stream. Each output is summed along ``in``
    in one fp32 lane (a single row's in two, even and odd features), where linear_rows sums 8 strided partial sums:
    the two agree to rounding."""
    load_torch_ops()
    return torch.ops.hybridlm.cpu_packed_linear(x, packed, out_features, scale, zero_point, bias)


def pack_int8_pairs(codes: torch.Tensor) -> torch.Tensor:
    """int8 ``codes [out, in]`` (``in`` even) in blocks of :data:`PACKED_OUTPUTS` outputs, each feature pair's codes
    side by side, ``[ceil(out / 16), in / 2, 16, 2]``, the outputs past ``out`` zero: the layout of
    ``cpu_int8_linear``, which multiplies a pair at a time. Plain tensor ops, folded by inductor's freezing as
    :func:`pack_linear_weight`'s are."""
    pairs = codes.view(torch.int16)  # [out, in / 2]: each feature pair's two codes as one element
    packed = pack_linear_weight(pairs)  # [blocks, in / 2, 16] pairs
    return packed.view(torch.int8).view(*packed.shape, 2)  # [blocks, in / 2, 16, 2]


def pack_group_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``scales [out, groups]`` (one per output and group of features) in blocks of 16 outputs, ``[ceil(out /
    16), groups, 16]``, beside :func:`pack_int8_pairs`' codes: :func:`pack_linear_weight`'s layout."""
    return pack_linear_weight(scales.float())


def int8_linear_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` in int8 x int8 products (llama.cpp's Q8_0 scheme; ``integer_linear.cpp``), like ``x``:
    ``codes [out, in]`` int8 with fp32 ``scales [out, in / group]``, one per output and group of ``group`` features
    (even); each row of ``x [..., in]`` (fp32 or bf16, CPU) is quantized per group to int8 codes with the scale
    ``max |x| / 127``, rounded half to even (:func:`hybridlm.ops.activation_groups.quantize_groups`). The group's
    sums are exact in int32, the groups summed in fp32 and the output rounded once. The op
    ``torch.ops.hybridlm.cpu_int8_linear`` over the codes and scales as they are: each thread packs the block of 16
    outputs it multiplies, where a compiled graph passes :func:`pack_int8_pairs`' and :func:`pack_group_scales`'
    layouts, packed once."""
    load_torch_ops()
    return torch.ops.hybridlm.cpu_int8_linear(x, codes, scales, codes.shape[0], bias)


def _time_major(x: torch.Tensor, name: str, batch: int, time: int, dstate: int) -> torch.Tensor:
    """``[batch, dstate, time]`` or ``[batch, groups, dstate, time]`` -> contiguous fp32 ``[batch, time, groups,
    dstate]``."""
    grouped = x.unsqueeze(1) if x.dim() == 3 else x
    if grouped.dim() != 4 or grouped.shape[0] != batch or grouped.shape[2:] != (dstate, time):
        raise ValueError(f"selective_scan {name} {tuple(x.shape)} must be [batch, dstate, time] or [batch, groups, "
                         f"dstate, time] with batch={batch}, dstate={dstate}, time={time}")
    return grouped.detach().float().permute(0, 3, 1, 2).contiguous()


def _initial_state(initial_state: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous fp32 copy of ``initial_state`` (checked to be ``shape``), or zeros."""
    if initial_state is None:
        return torch.zeros(shape, dtype=torch.float32, device=like.device)
    if initial_state.shape != shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)} is not {shape}")
    return initial_state.detach().float().clone(memory_format=torch.contiguous_format)


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


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """Softmax attention in fp32 over bf16 keys and values, rounded once to ``q``'s dtype
    (``kernels/cpu/attention.cpp``; :func:`hybridlm.ops.attention.attention_ref` without ``causal`` or
    ``seq_idx``): ``q [batch, q_heads, q_len, dim]``, ``k [batch, kv_heads, slots, dim]`` and ``v [..., dim_v]``
    bf16 with contiguous rows (a static cache's views as they are), ``mask`` boolean, broadcastable to ``[batch,
    q_heads, q_len, slots]``, True where a query may attend. Inference only (no gradient); meant for decode steps,
    where ``q_heads / kv_heads * q_len`` rows share each key and value read. The op
    ``torch.ops.hybridlm.cpu_attention``, whose C++ kernel this loads first."""
    load_torch_ops()
    return torch.ops.hybridlm.cpu_attention(q, k, v, mask, scale)
