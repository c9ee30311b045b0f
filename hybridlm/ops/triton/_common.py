"""Helpers shared by the Triton kernels: device checks, output allocation, launch and small jit functions."""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.errors import TritonError

from hybridlm.ops.declined import Declined
from hybridlm.ops.packing import token_sequences

# Kernels are decorated when this package is imported; TRITON_INTERPRET decides then whether they run in
# Triton's CPU interpreter or are compiled for the GPU.
INTERPRETED = bool(knobs.runtime.interpret)

# fp32 tile products: tf32 with error compensation (three tf32 products, about fp32's accuracy) on the GPU's
# tensor cores; the interpreter computes "ieee" (exact fp32) products only.
FP32_PRECISION: tl.constexpr = tl.constexpr("ieee" if INTERPRETED else "tf32x3")

_poison = False


@contextlib.contextmanager
def poisoned_outputs():
    """Fill every buffer the kernels write with NaN, so that an element a kernel forgets to write shows up.

    For tests; buffers the kernels accumulate into are zeroed regardless.
    """
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous


def new_buffer(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A buffer a kernel fills completely (NaN-filled under :func:`poisoned_outputs`)."""
    dtype = dtype or like.dtype
    if _poison:
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def check_device(op: str, *tensors: torch.Tensor | None) -> None:
    """Raise unless all tensors share one device the kernels can run on."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) > 1:
        raise ValueError(f"{op}: inputs are on different devices {sorted(map(str, devices))}")
    if present and not INTERPRETED and present[0].device.type != "cuda":
        raise ValueError(
            f"{op}: the Triton kernels need CUDA tensors, got {present[0].device} "
            "(set TRITON_INTERPRET=1 before importing hybridlm.ops.triton to run them on the CPU, slowly)"
        )


class KernelFailed(Declined):
    """A Triton kernel that does not compile (or does not fit: registers, shared memory) for this GPU with this
    configuration. A :class:`~hybridlm.ops.declined.Declined`: the default backend choice runs the next backend,
    a forced ``triton`` raises ``BackendUnavailable`` with this message."""


_failed: dict[tuple, str] = {}  # (kernel, configuration) -> why it failed: not compiled again
compiled: dict[str, dict] = {}  # kernel name -> resources of its last compiled launch (for benchmarks/gpu_check.py)


def _configuration(kernel, args: tuple, kwargs: dict) -> tuple:
    """``(kernel name, (option, value)...)``: what a compile depends on (the constants and the tensors' dtypes)."""
    dtypes = ",".join(str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor))
    return (_name(kernel), *sorted((k, str(v)) for k, v in kwargs.items()), ("dtypes", dtypes))


def _name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)  # an Autotuner wraps the JIT function
    return getattr(fn, "__name__", repr(fn))


def device_guard(device: torch.device):
    """Launches go to ``device``, not the current CUDA device (multi-GPU models, ``device_map="auto"``)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel`` on the device of its first tensor argument unless the grid is empty (a zero-length
    input). ``grid``: a tuple, or a function of the meta-parameters (``lambda META: ...``) when it depends on a
    block size the kernel may tune (:func:`tuned`). A compile error or a configuration that does not fit the GPU
    raises :class:`KernelFailed` naming the kernel and configuration (remembered: the same configuration is not
    compiled again)."""
    if not all(grid(kwargs) if callable(grid) else grid):
        return
    if torch.compiler.is_compiling():  # traced by torch.compile, which launches the kernel itself: no bookkeeping,
        # and no block bounds (its trace would not see them): the launch's own blocks, warps and stages tuned
        getattr(kernel, "blocks_as_passed", kernel)[grid](*args, **kwargs)
        return
    passed, bounds = launch_arguments(kernel, kwargs)
    key = _configuration(kernel, args, kwargs)
    if key in _failed:
        raise KernelFailed(_failed[key])
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if bounds:
        kernel = kernel.bounded(bounds)
    try:
        with device_guard(device):
            handle = kernel[grid](*args, **passed)
    except TritonError as error:
        settings = ", ".join(f"{k}={v}" for k, v in key[1:])
        first_line = (str(error).strip().splitlines() or [""])[0]
        _failed[key] = (f"Triton kernel {key[0]} ({settings}) failed on {device}: "
                        f"{type(error).__name__}: {first_line}")
        raise KernelFailed(_failed[key]) from error
    meta = getattr(handle, "metadata", None)  # compiled (not interpreted): keep its resources
    if meta is not None:
        chosen = getattr(kernel, "best_config", None)  # an Autotuner: the blocks it chose
        compiled[key[0]] = dict(registers=getattr(handle, "n_regs", None), spills=getattr(handle, "n_spills", None),
                                shared_bytes=getattr(meta, "shared", None), warps=getattr(meta, "num_warps", None),
                                stages=getattr(meta, "num_stages", None),
                                config={**dict(key[1:]), **(chosen.kwargs if chosen else {})})


TUNING: dict[str, tuple] = {}  # kernel name -> the (configs, key, options, blocks) of :func:`tuned`


def launch_arguments(kernel, kwargs: dict) -> tuple[dict, dict]:
    """``(what to pass, bounds)``: an autotuned kernel (on the GPU) is not passed the block sizes it tunes (Triton
    refuses a meta-parameter both passed and tuned); the launcher's values, the largest that fit the registers
    and shared memory at this shape, bound its choices instead (``kernel.bounded(bounds)``). In the
    interpreter: every argument, no bounds."""
    tuned_blocks = tuned_block_sizes(kernel) if isinstance(kernel, triton.runtime.Autotuner) else {}
    bounds = {name: kwargs[name] for name in tuned_blocks if name in kwargs}
    return {k: v for k, v in kwargs.items() if k not in bounds}, bounds


def block_choices(configs: tuple, blocks: dict | None) -> list[tuple[int, int, dict[str, int]]]:
    """``(num_warps, num_stages, block sizes)`` of every configuration :func:`tuned` declares: each ``(warps,
    stages)`` with every combination of the ``blocks`` choices; a third item ``{name: choices}`` replaces the
    choices of those blocks for that entry (a block width that spills with fewer warps)."""
    out = []
    for warps, stages, *own in configs:
        choices = {**(blocks or {}), **(own[0] if own else {})}
        out += [(warps, stages, dict(zip(choices, sizes))) for sizes in itertools.product(*choices.values())]
    return out


def autotuned(kernel, configs: tuple, key: list[str], blocks: dict | None = None, **options):
    """``kernel`` autotuned over ``(num_warps, num_stages)`` configurations and the choices of ``blocks``
    (``{"BLOCK_V": (32, 64)}``; see :func:`block_choices`), re-tuned when the ``key`` arguments or the tensors'
    dtypes change. A launch's own block sizes bound the choices: ``tuner.bounded(bounds)`` is a tuner whose
    choices are clamped to them, one per distinct ``bounds`` (kept in ``tuner.by_bounds``), so a configuration
    chosen under one launch's bounds is never reused under tighter ones. ``options``: ``restore_value`` for
    buffers updated in place, ``reset_to_zero`` for accumulated ones (the tuning runs the kernel once per
    configuration)."""
    choices = block_choices(configs, blocks)

    def clamped_tuner(bounds: dict[str, int]):
        unique = {}  # clamping can make two choices equal: each configuration once
        for warps, stages, sizes in choices:
            sizes = {name: min(size, bounds.get(name, size)) for name, size in sizes.items()}
            unique.setdefault((warps, stages, tuple(sorted(sizes.items()))),
                              triton.Config(sizes, num_warps=warps, num_stages=stages))
        return triton.autotune(list(unique.values()), key=key, **options)(kernel)

    tuner = clamped_tuner({})

    def bounded(bounds: dict[str, int]):
        named = tuple(sorted(bounds.items()))
        if named not in tuner.by_bounds:
            tuner.by_bounds[named] = clamped_tuner(bounds)
        return tuner.by_bounds[named]

    tuner.by_bounds, tuner.bounded = {}, bounded
    # for torch.compile's traces (see launch): the same warps and stages, the blocks as each launch passes them
    tuner.blocks_as_passed = autotuned(kernel, tuple({(w, s): None for w, s, *_ in configs}), key, **options) \
        if blocks else tuner
    return tuner


def tuned(*configs: tuple, key: list[str], blocks: dict[str, tuple[int, ...]] | None = None, **options):
    """Decorator: :func:`autotuned` on the GPU; in the interpreter (where warps and stages mean nothing) the
    kernel as it is, with Triton's default configuration and the block sizes each launch passes."""
    def decorate(kernel):
        TUNING[_name(kernel)] = (configs, key, options, dict(blocks or {}))
        return kernel if INTERPRETED else autotuned(kernel, configs, key, blocks, **options)

    return decorate


def narrowest(kernel, name: str, size: int) -> int:
    """The smallest ``name`` block a launch passing ``size`` may run with: ``size`` unless the kernel is autotuned
    over it (for buffers with one slot per block)."""
    choices = tuned_block_sizes(kernel).get(name, ()) if isinstance(kernel, triton.runtime.Autotuner) else ()
    return min([size, *choices])


def tuned_block_sizes(kernel) -> dict[str, set[int]]:
    """Every size each block ``kernel`` tunes may take (from :data:`TUNING`; empty for an untuned kernel)."""
    return _tuned_block_sizes(_name(kernel))


@functools.cache  # read at every launch; TUNING is filled once, when the kernels are defined
def _tuned_block_sizes(name: str) -> dict[str, set[int]]:
    configs, _, _, blocks = TUNING.get(name, ((), None, None, None))
    sizes: dict[str, set[int]] = {}
    for _, _, chosen in block_choices(configs, blocks):
        for name, size in chosen.items():
            sizes.setdefault(name, set()).add(size)
    return sizes


def block(n: int, minimum: int = 16, maximum: int | None = None) -> int:
    """A power-of-two tile width covering ``n`` (at least ``minimum``: tl.dot needs 16 on the GPU)."""
    size = max(minimum, triton.next_power_of_2(max(n, 1)))
    return min(size, maximum) if maximum else size


def dot_dtype(*tensors: torch.Tensor):
    """Operand type of the tile products: the inputs' half type if there is one, else fp32 (computed exactly).

    Triton's CPU interpreter (3.9) returns garbage for products of bf16 tiles, so there it is always fp32.
    """
    if INTERPRETED:
        return tl.float32
    for t in tensors:
        if t.dtype in (torch.bfloat16, torch.float16):
            return tl.bfloat16 if t.dtype == torch.bfloat16 else tl.float16
    return tl.float32


def state_dot_dtype(*tensors: torch.Tensor):
    """Operand type of products with a state (sums over whole sequences, kept in fp32 between kernels): bf16
    for bf16 inputs (fp32's range), else fp32. An fp16 state can exceed 65504, so fp16 inputs do not cast it."""
    if not INTERPRETED and any(t.dtype == torch.bfloat16 for t in tensors):
        return tl.bfloat16
    return tl.float32


class Packing(NamedTuple):
    """Packed sequences as the kernels read them (see :func:`sequence_span`): ``seq [time]``, each token's sequence
    number, and ``cu [n_seqs + 1]``, the boundaries (int64, on the inputs' device)."""

    seq: torch.Tensor
    cu: torch.Tensor

    @property
    def n_seqs(self) -> int:
        return self.cu.numel() - 1


def packing_of(bounds: list[int] | None, device) -> Packing | None:
    """:class:`Packing` of the checked boundaries ``bounds`` (:func:`hybridlm.ops.packing.packed_sequences`), or
    None for an ordinary batch."""
    if bounds is None:
        return None
    return Packing(token_sequences(bounds, device), torch.tensor(bounds, device=device, dtype=torch.int64))


@triton.jit
def sequence_span(SEQ, CU, row, t, mask, time, PACKED: tl.constexpr):
    """Of each token ``t`` (an int64 vector) of batch row ``row``: its sequence number, first token and end (one
    past its last token), as int64 vectors. Packed (batch 1): read from ``SEQ`` and ``CU`` (a :class:`Packing`,
    0 where ``mask`` is false); else the row is the sequence."""
    if PACKED:
        seq = tl.load(SEQ + t, mask=mask, other=0).to(tl.int64)
        start = tl.load(CU + seq, mask=mask, other=0).to(tl.int64)
        end = tl.load(CU + seq + 1, mask=mask, other=0).to(tl.int64)
    else:
        seq = t * 0 + row
        start = t * 0
        end = t * 0 + time
    return seq, start, end



# The kernels use the helpers below instead of tl.sum, tl.cumsum, tl.zeros, tl.sigmoid and tl.cdiv. Those are
# @triton.jit functions of triton.language itself, and Triton's CPU interpreter runs them only if TRITON_INTERPRET
# was set before triton.language was first imported, which a process that imports transformers (which imports
# triton) cannot arrange. Built on the core primitives, these compile to the same code on the GPU.


@triton.jit
def program_id64(AXIS: tl.constexpr):
    """``tl.program_id(AXIS)`` as int64, so that the offsets computed from it do not wrap past 2**31 elements."""
    return tl.program_id(AXIS).to(tl.int64)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def total(x, AXIS: tl.constexpr):
    """``tl.sum(x, AXIS)``."""
    return tl.reduce(x, AXIS, _add)


@triton.jit
def running_total(x, AXIS: tl.constexpr, REVERSE: tl.constexpr):
    """``tl.cumsum(x, AXIS, reverse=REVERSE)``."""
    return tl.associative_scan(x, AXIS, _add, reverse=REVERSE)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def mm(a, b, DOT_DTYPE: tl.constexpr):
    """Tile product with fp32 accumulation; fp32 operands in ``FP32_PRECISION`` (about fp32's accuracy)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=FP32_PRECISION)
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def flip_rows(x, ROWS: tl.constexpr, LOG2_ROWS: tl.constexpr, COLS: tl.constexpr, DEPTH: tl.constexpr):
    """``x[::-1]`` of an fp32 ``[ROWS, COLS, DEPTH]`` tile, exactly (bit patterns swapped by xor, as ``tl.flip``).

    Reversed scans run as forward scans between two flips: a reversed ``tl.associative_scan`` with an
    order-dependent combine has a history of wrong results on GPUs.
    """
    bits = x.to(tl.int32, bitcast=True)
    for i in tl.static_range(LOG2_ROWS):  # swap the halves of every block of 2 << i rows
        pairs = tl.reshape(bits, (ROWS // (2 << i), 2, 1 << i, COLS, DEPTH))
        pairs = pairs ^ tl.reduce(pairs, 1, _xor, keep_dims=True)
        bits = tl.reshape(pairs, (ROWS, COLS, DEPTH))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def softplus(x):
    """``log(1 + exp(x))``, linear above 20 like ``torch.nn.functional.softplus``."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def silu_grad(x):
    """Derivative of ``x * sigmoid(x)``."""
    s = sigmoid(x)
    return s * (1.0 + x * (1.0 - s))
