"""Decode-step products with bf16 weights, or int8 weight-only codes, on a CPU without bf16 products (AVX2).

There torch has no fast eager product for them: its bf16 product takes a slow path, and torchao's int8 codes are
dequantized into a weight of the input's dtype first. :func:`hybridlm.ops.cpu_kernels.linear_rows`
(``kernels/cpu/linear.cpp``) widens each weight vector to fp32 in registers as it is loaded, so a step reads the
weights in their own width once and multiplies at fp32 speed. It serves steps of up to :data:`MAX_ROWS` rows
(tokens); prefill products keep torch's (an fp32 copy of the weight into MKL, :mod:`hybridlm.layers.linear`).

It is the op ``torch.ops.hybridlm.cpu_linear`` (a C++ kernel, :func:`hybridlm.ops.cpu_kernels.load_torch_ops`),
eager and in a compiled graph; in a graph only for bf16 weights of several rows: inductor's own products take a
bf16 weight by one row and torchao's int8 codes (ATen's int8 kernels) at least as fast. Measured on SmolLM2-135M's
compiled step (1 thread, AVX2 EPYC, min of interleaved runs, kernel in the graph against inductor's product):
bf16 batch 1 28.9 against 24.2 ms, int8 batch 1 18.6 against 17.6, int8 batch 16 118.4 against 103.6; bf16 batch
16 196 against 257 (session 37, docs/performance.md). Inference only: a product that needs gradients keeps torch's.
"""

from __future__ import annotations

import torch

from hybridlm.ops import cpu_kernels
from hybridlm.ops.cpu_features import dtypes_without_cpu_products

#: the most rows (tokens of a step) the kernel serves; more are a prefill, for torch's products
MAX_ROWS = 16
#: whether this CPU lacks bf16 products and a C++ compiler can build the kernel (built on first use)
SERVES_THIS_CPU = torch.bfloat16 in dtypes_without_cpu_products() and cpu_kernels.unavailable_reason() is None


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` through the kernel where it serves the call (see the module docstring), else
    None: the caller keeps its own product."""
    if not (SERVES_THIS_CPU and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and 0 < x.numel() <= MAX_ROWS * x.shape[-1]):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    parts = _weight_parts(weight, x.dtype)
    if parts is None or not cpu_kernels.torch_ops_ready():
        return None
    if torch.compiler.is_compiling() and (parts[1] is not None or x.numel() == x.shape[-1]):
        return None  # int8 codes, or a single row: inductor's own weight-only and bf16 products are faster in a graph
    return torch.ops.hybridlm.cpu_linear(x, *parts, bias)


def _weight_parts(weight: torch.Tensor, dtype: torch.dtype) -> tuple | None:
    """``(weight or codes, scale, zero_point)`` of a bf16 weight (for bf16 inputs) or of torchao's weight-only int8
    codes with one scale per output row; None for any other weight."""
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return (weight, None, None) if weight.dtype == torch.bfloat16 == dtype else None
    codes, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if (not weight_only_codes(weight) or codes is None or codes.dtype != torch.int8 or codes.dim() != 2 or scale is None
            or list(getattr(weight, "block_size", ())) != [1, codes.shape[1]]):
        return None
    return codes, scale, getattr(weight, "zero_point", None)


def weight_only_codes(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a quantized tensor subclass (torchao's) that quantizes only the weight: its product
    takes the input as it is, so the weight may be dequantized or read as codes without changing the result."""
    return getattr(weight, "act_quant_kwargs", True) is None and getattr(weight, "act_pre_scale", 1) is None
