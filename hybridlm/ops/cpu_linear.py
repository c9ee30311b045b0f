"""Decode-step products with bf16 weights, or int8 weight-only codes, on a CPU without bf16 products (AVX2).

There torch has no fast eager product for them: its bf16 product takes a slow path, and torchao's int8 codes are
dequantized into a weight of the input's dtype first. :func:`hybridlm.ops.cpu_kernels.linear_rows`
(``kernels/cpu/linear.cpp``) widens each weight vector to fp32 in registers as it is loaded, so a step reads the
weights in their own width once and multiplies at fp32 speed. It serves steps of up to :data:`MAX_ROWS` rows
(tokens); prefill products keep torch's (an fp32 copy of the weight into MKL, :mod:`hybridlm.layers.linear`).

Eager, it is the op ``torch.ops.hybridlm.cpu_linear`` over nn.Linear's layout. In a graph whose weights are
constants (inductor's ``freezing``, as :class:`hybridlm.decoding.decode_step.DecodeStep` compiles), it is
``cpu_packed_linear`` over the weights packed in blocks of 16 outputs (:func:`cpu_kernels.pack_linear_weight`),
which freezing folds into a constant of the graph once: a thread reads its weights as one stream, and several
rows share each weight vector from registers. That copy of the weights is held by each compiled graph (as
inductor's own packed products are). Measured on SmolLM2-135M's compiled step (1 thread, AVX2 EPYC, min / median
of interleaved runs, packed op against the rule before it: inductor's products for one row and int8 codes, the
unpacked op for bf16 rows): bf16 batch 1 19.8 / 20.8 against 22.4 / 24.3 ms, batch 16 79.7 / 93.1 against
140.4 / 152.8; int8 batch 1 15.7 / 18.0 against 16.6 / 17.8, batch 16 80.8 / 85.5 against 96.8 / 103.8. In a
graph whose weights are inputs, a single row and int8 codes are left to inductor's products, which take a bf16
weight by one row and torchao's codes (ATen's int8 kernels) at least as fast as the unpacked op. Inference only:
a product that needs gradients keeps torch's.

Codes in groups with the inputs quantized per group (``quantize_weights(group_size=32)``: llama.cpp's Q8_0 scheme)
go to :func:`int8_groups_linear`, int8 x int8 products (``kernels/cpu/integer_linear.cpp``) on any CPU the kernels
build on: 16 codes widen to int16 in one instruction and multiply-add in pairs in one more, where the weight-only
codes above take about four instructions per 8 to reach fp32. SmolLM2-135M's 211 products of a batch-1 step, 1
thread, profiled in the compiled step (one process after the other): 71.9 us a call against the weight-only
packed op's 98.7.
"""

from __future__ import annotations

import torch

from hybridlm.ops import cpu_kernels
from hybridlm.ops.cpu_features import dtypes_without_cpu_products

#: the most rows (tokens of a step) the kernel serves; more are a prefill, for torch's products
MAX_ROWS = 16
#: whether a C++ compiler can build the kernels (built on first use): the int8 x int8 product needs nothing more
SERVES_INT8_PRODUCTS = cpu_kernels.unavailable_reason() is None
#: whether this CPU also lacks bf16 products, where the bf16 and int8 weight-only kernels pay
SERVES_THIS_CPU = torch.bfloat16 in dtypes_without_cpu_products() and SERVES_INT8_PRODUCTS


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
    if torch.compiler.is_compiling():
        if _weights_are_constants():
            packed = cpu_kernels.pack_linear_weight(parts[0])  # folded into a constant of the graph, once
            return torch.ops.hybridlm.cpu_packed_linear(x, packed, parts[0].shape[0], *parts[1:], bias)
        if parts[1] is not None or x.numel() == x.shape[-1]:
            return None  # int8 codes, or a single row: inductor's own products are as fast as the unpacked op
    return torch.ops.hybridlm.cpu_linear(x, *parts, bias)


def int8_groups_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear`` of ``x`` quantized per group of features against int8 codes in groups of the same size
    (:func:`hybridlm.model.quantize_weights` with ``group_size``), in int8 x int8 products through
    ``cpu_int8_linear``, where it serves the call (CPU, inference), else None: the caller multiplies
    :func:`hybridlm.ops.activation_groups.round_through_int8_groups`'s input by the dequantized weight. A compiled
    graph with constant weights packs them once (folded); elsewhere the kernel packs each block of outputs where it
    multiplies it (packing the whole weight with tensor ops on every call made SmolLM2's 256-token prefill 1.5x
    slower). Prefill rows go to the kernel too: 256 rows of SmolLM2's 1,536 x 576 (bf16, 1 thread) took 4.2 ms
    against 6.8 for that fp32 path and 5.6 for its fp32 product alone (108 against 81 GFLOP/s)."""
    if not (SERVES_INT8_PRODUCTS and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.numel() > 0 and cpu_kernels.torch_ops_ready()):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    codes, scales = weight.qdata, weight.scale  # [out, in] int8, [out, in / group] fp32
    out_features = codes.shape[0]
    if _weights_are_constants():
        codes, scales = cpu_kernels.pack_int8_pairs(codes), cpu_kernels.pack_group_scales(scales)
    return torch.ops.hybridlm.cpu_int8_linear(x, codes, scales, out_features, bias)


@torch._dynamo.assume_constant_result
def _weights_are_constants() -> bool:
    """Whether the graph being compiled takes its weights as constants (inductor's ``freezing``, as
    :class:`hybridlm.decoding.decode_step.DecodeStep` compiles): only then is their packing done once."""
    from torch._inductor import config

    return bool(config.freezing)


def _weight_parts(weight: torch.Tensor, dtype: torch.dtype) -> tuple | None:
    """``(weight or codes, scale, zero_point)`` of a bf16 weight (for bf16 inputs) or of torchao's weight-only int8
    codes with one scale per output row; None for any other weight."""
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return (weight, None, None) if weight.dtype == torch.bfloat16 == dtype else None
    return int8_row_codes(weight)


def int8_row_codes(weight: torch.Tensor) -> tuple | None:
    """``(codes [out, in] int8, scale [out, 1], zero_point [out, 1] or None)`` of torchao's weight-only int8 codes
    with one scale per output row; None for any other weight."""
    codes, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if (not weight_only_codes(weight) or codes is None or codes.dtype != torch.int8 or codes.dim() != 2 or scale is None
            or list(getattr(weight, "block_size", ())) != [1, codes.shape[1]]):
        return None
    return codes, scale, getattr(weight, "zero_point", None)


def weight_only_codes(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a quantized tensor subclass (torchao's) that quantizes only the weight: its product
    takes the input as it is, so the weight may be dequantized or read as codes without changing the result."""
    return getattr(weight, "act_quant_kwargs", True) is None and getattr(weight, "act_pre_scale", 1) is None
