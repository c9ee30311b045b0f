"""Triton kernels of the GPU check's reverse-scan probe (imported after ``TRITON_INTERPRET`` is set or unset)."""

import triton
import triton.language as tl

from hybridlm.ops.triton._common import flip_rows


@triton.jit
def _compose(a1, b1, a2, b2):
    """``h -> a1 h + b1`` then ``h -> a2 h + b2``: order-dependent."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def reversed_recurrence_kernel(A, B, OUT, ROWS: tl.constexpr, LOG2: tl.constexpr, COLS: tl.constexpr,
                               DEPTH: tl.constexpr, FLIP: tl.constexpr):
    offs = (tl.arange(0, ROWS)[:, None, None] * COLS + tl.arange(0, COLS)[None, :, None]) * DEPTH \
        + tl.arange(0, DEPTH)[None, None, :]
    a, b = tl.load(A + offs), tl.load(B + offs)
    if FLIP:
        _, local = tl.associative_scan((flip_rows(a, ROWS, LOG2, COLS, DEPTH), flip_rows(b, ROWS, LOG2, COLS, DEPTH)),
                                       0, _compose)
        out = flip_rows(local, ROWS, LOG2, COLS, DEPTH)
    else:
        _, out = tl.associative_scan((a, b), 0, _compose, reverse=True)
    tl.store(OUT + offs, out)
