"""Decode-step attention over a bf16 key/value cache on a CPU without bf16 products, through
:func:`hybridlm.ops.cpu_kernels.grouped_attention` (``kernels/cpu/attention.cpp``).

:func:`hybridlm.ops.attention.attention_ref` writes such steps out in fp32 (``_fp32_grouped_attention``), which
copies the keys and values to fp32 on every call: at batch 16 over 320 slots, SmolLM2-135M's compiled step spent
70 of its 216 ms in those copies and the cache update fused with them (1 thread, AVX2 EPYC, profiled). The kernel
widens each key and value vector in registers as it reads it, scores 8 keys at a time, sums the values for 3
queries at a time, and skips the slots no query may attend to. It is the op ``torch.ops.hybridlm.cpu_attention``
(a C++ kernel: a compiled graph calls it without going back to Python), eager or compiled. Inference only.
"""

from __future__ import annotations

import torch

from hybridlm.ops import cpu_kernels

#: whether a C++ compiler can build the kernel here (built on first use)
KERNEL_AVAILABLE = cpu_kernels.unavailable_reason() is None


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None) -> torch.Tensor | None:
    """The attention of a decode step through the kernel where it serves the call (bf16 keys and values with
    contiguous rows, a boolean mask or none, no gradient), else None: the caller keeps its own."""
    if not (KERNEL_AVAILABLE and q.dtype == k.dtype == v.dtype == torch.bfloat16 and k.stride(-1) == 1
            and v.stride(-1) == 1 and (mask is None or mask.dtype == torch.bool)):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return None
    return torch.ops.hybridlm.cpu_attention(q, k, v, mask, scale) if cpu_kernels.torch_ops_ready() else None
