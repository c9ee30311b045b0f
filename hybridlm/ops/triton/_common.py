"""Helpers shared by the Triton kernels: device checks, output allocation, launch and small jit functions."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton import knobs

# Kernels are decorated when this package is imported; TRITON_INTERPRET decides then whether they run in
# Triton's CPU interpreter or are compiled for the GPU.
INTERPRETED = bool(knobs.runtime.interpret)

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


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch ``kernel`` unless the grid is empty (a zero-length input)."""
    if all(grid):
        kernel[grid](*args, **kwargs)


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


# The kernels use the helpers below instead of tl.sum, tl.cumsum, tl.zeros, tl.sigmoid and tl.cdiv. Those are
# @triton.jit functions of triton.language itself, and Triton's CPU interpreter runs them only if TRITON_INTERPRET
# was set before triton.language was first imported, which a process that imports transformers (which imports
# triton) cannot arrange. Built on the core primitives, these compile to the same code on the GPU.


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
    """Tile product with fp32 accumulation; fp32 operands are multiplied exactly, not in tf32."""
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision="ieee")


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
