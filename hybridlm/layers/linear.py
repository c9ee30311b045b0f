"""The projection every layer and mixer uses: ``nn.Linear``, except for a bf16 or fp16 product on a CPU that has
no products in that dtype (no AVX-512 BF16 or AMX for bf16; no AVX-512 FP16 or AMX-FP16 for fp16). There torch's
eager product falls back to a slow path, several times slower than fp32. So:

* up to ``MAX_ROWS`` rows (a decode step) with bf16 weights, or int8 weight-only codes on a bf16 or fp32 model,
  our kernel (:mod:`hybridlm.ops.cpu_linear`) reads the weights in their own width and multiplies in fp32;
* from :data:`MIN_FP32_ROWS` rows on (past the kernel's rows: a prefill), the input and weight are copied to fp32,
  multiplied, and the output rounded once to the model's dtype (the same fp32 accumulation the native products
  do).

Codes in groups (``quantize_weights(group_size=...)``, :attr:`Linear.input_group`) multiply the input quantized in
the same groups: on a CPU in int8 x int8 products (``cpu_linear.int8_groups_linear``), elsewhere in fp32 on the
input rounded through its codes and the dequantized weight.

Measured on an AVX2 AMD EPYC, 1 thread, SmolLM2-135M's weights in bf16 (``benchmarks/cpu_linear.py``, medians,
docs/performance.md): 1,536 x 576 took 878 us in bf16 against 634 us copied at 4 rows, 48.4 against 6.2 ms at
256 rows (a prefill); at 3 rows the two were level (0.91-1.33x over three shapes), and at 1 row (a decode
step) the copy of the weight costs more than it saves (576 x 1,536: 204 against 322 us). The kernel beats both
below 16 rows and is level with the copy at 16. A compiled decode step (frozen weights) runs the kernel over
weights packed once into a constant of the graph; a graph whose weights are inputs leaves single rows and int8
codes to inductor's products (``cpu_linear.kernel_linear``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops.activation_groups import round_through_int8_groups
from hybridlm.ops.cpu_features import dtypes_without_cpu_products
from hybridlm.ops.cpu_linear import int8_groups_linear, int8_row_codes, kernel_linear, weight_only_codes

#: bf16 / fp16, where this CPU has no products of its own in them
DTYPES_WITHOUT_CPU_PRODUCTS = dtypes_without_cpu_products()
#: rows (tokens) of a product from which its fp32 copy is the faster (level at 3; see the module docstring)
MIN_FP32_ROWS = 4


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoints, ``isinstance`` of it) that multiplies a reduced-precision
    input on a CPU without products in its dtype through the kernel (few rows) or in fp32 (at least
    :data:`MIN_FP32_ROWS` rows): with its weight copied to fp32, or, for int8 weight-only codes (torchao's,
    :func:`hybridlm.model.quantize_weights`), dequantized to fp32 (their own product multiplies in the input's
    dtype, as slow there)."""

    #: int8 codes in groups of this many input features, and the input quantized in the same groups at every
    #: product (set by :func:`hybridlm.model.quantize_weights` with ``group_size``); None: the input as it is
    input_group: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_group is not None:
            return self._int8_product(x)
        y = kernel_linear(x, self.weight, self.bias)
        if y is not None:
            return y
        weight = _fp32_weight(self.weight, x) if _many_reduced_precision_rows_on_cpu(x) else None
        if weight is not None:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), weight, bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def _int8_product(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 x int8 product: the kernel's on the CPU, else the same arithmetic in fp32 (the input rounded
        through its int8 codes, the weight dequantized), rounded once to ``x``'s dtype."""
        y = int8_groups_linear(x, self.weight, self.bias)
        if y is not None:
            return y
        bias = None if self.bias is None else self.bias.float()
        weight = self.weight.dequantize(torch.float32)
        return F.linear(round_through_int8_groups(x, self.input_group), weight, bias).to(x.dtype)


def _many_reduced_precision_rows_on_cpu(x: torch.Tensor) -> bool:
    """An eager product of several rows, on the CPU, in a dtype it has no products in."""
    return (x.dtype in DTYPES_WITHOUT_CPU_PRODUCTS and x.device.type == "cpu"
            and x.numel() >= MIN_FP32_ROWS * x.shape[-1] and not torch.compiler.is_compiling())


def _fp32_weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in fp32: a plain weight of ``x``'s dtype copied, weight-only quantized codes dequantized; None
    for any other tensor subclass (e.g. codes that quantize the input too), which keeps its own product."""
    if type(weight.data) is torch.Tensor:
        return weight.float() if weight.dtype == x.dtype else None
    parts = int8_row_codes(weight)
    if parts is not None:  # torchao's dequantize, in place: one fresh buffer where it makes two (0.3 against 0.8 ms)
        codes, scale, zero_point = parts
        dequantized = codes.float()  # [out, in]
        if zero_point is not None:
            dequantized.sub_(zero_point.float().view(-1, 1))
        return dequantized.mul_(scale.float().view(-1, 1))
    return weight.dequantize(torch.float32) if weight_only_codes(weight) and hasattr(weight, "dequantize") else None
