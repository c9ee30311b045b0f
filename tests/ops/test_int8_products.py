"""The int8 x int8 linear (``kernels/cpu/integer_linear.cpp`` through ``cpu_kernels.int8_linear_rows`` and the
``hybridlm::cpu_int8_linear`` op): the inputs' quantization per group against its definition, the product against
float64 sums of the same codes, the packed layout (packed ahead, or block by block in the kernel), its threads, and
in a compiled graph with frozen weights the packing folded into constants; where
:class:`hybridlm.layers.linear.Linear` takes it; its errors."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hybridlm.layers.linear import Linear
from hybridlm.model import quantize_weights
from hybridlm.ops import cpu_kernels, cpu_linear
from hybridlm.ops.activation_groups import quantize_groups, round_through_int8_groups
from tests.helpers import on_one_and_two_threads

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")

FP32_EPS = 2.0 ** -24
BF16_EPS = 2.0 ** -8


def random_codes(out_features, in_features, group, generator):
    """int8 codes over their whole range, and one fp32 scale per output and group."""
    codes = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // group, generator=generator) * 0.02 + 0.001
    return codes, scales


def float64_product(x, codes, scales, bias, group):
    """``(exact, magnitudes)``: the product of ``x``'s codes (quantize_groups) and the weight codes, each group's
    integer sum times its two scales, in float64; and the same sum of absolute values (the rounding bound's scale)."""
    x_codes, x_scales = quantize_groups(x, group)
    out = codes.shape[0]
    xg, wg = x_codes.double().unflatten(-1, (-1, group)), codes.double().view(out, -1, group)
    both = x_scales.double().unsqueeze(-2) * scales.double()  # [rows, out, groups]
    exact = (torch.einsum("mgk,ngk->mng", xg, wg) * both).sum(-1)
    magnitudes = (torch.einsum("mgk,ngk->mng", xg.abs(), wg.abs()) * both).sum(-1)
    if bias is not None:
        exact, magnitudes = exact + bias.double(), magnitudes + bias.double().abs()
    return exact, magnitudes


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 20), groups=st.integers(1, 4), group=st.sampled_from([2, 8, 32]),
       out_features=st.integers(1, 60), x_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_is_the_product_of_the_codes(rows, groups, group, out_features, x_dtype, with_bias, seed):
    """Within the groups the sums are exact integers; across them fp32 sums of scaled terms, then one rounding to
    the input's dtype: the float64 product of the same codes bounds the difference."""
    generator = torch.Generator().manual_seed(seed)
    in_features = groups * group
    codes, scales = random_codes(out_features, in_features, group, generator)
    x = (torch.randn(rows, in_features, generator=generator) * 3).to(x_dtype)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    y = cpu_kernels.int8_linear_rows(x, codes, scales, bias)
    exact, magnitudes = float64_product(x, codes, scales, bias, group)
    bound = 4 * (groups + 4) * FP32_EPS * magnitudes
    if x_dtype == torch.bfloat16:
        bound = bound + BF16_EPS * exact.abs()
    assert y.shape == exact.shape and y.dtype == x_dtype
    assert (exact.abs() > 10 * bound).any()  # a product that a wrong or zero result would not match
    excess = ((y.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"kernel off the float64 product of the codes by {excess:.3g} beyond the rounding bound"


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), group=st.sampled_from([2, 8, 32]),
       spread=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_quantized_inputs_follow_their_definition(rows, groups, group, spread, seed):
    """Per group: the scale is max |x| / 127, the codes integers in [-127, 127], each within half a step of x /
    scale (so the largest is +-127), an all-zero group all zero codes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * group, generator=generator) * spread
    x[0, :group] = 0.0
    codes, scales = quantize_groups(x, group)
    grouped, code_groups = x.double().unflatten(-1, (-1, group)), codes.double().unflatten(-1, (-1, group))
    largest = grouped.abs().amax(-1)
    assert torch.allclose(scales.double(), largest / 127, rtol=2 * FP32_EPS, atol=0)
    assert torch.equal(code_groups, code_groups.round()) and code_groups.abs().max() <= 127
    assert (code_groups[0, 0] == 0).all() and scales[0, 0] == 0
    live = largest > 0
    ratio = grouped[live] / scales.double()[live].unsqueeze(-1)
    assert ((code_groups[live] - ratio).abs() <= 0.5 + 1e-4).all()
    assert (code_groups[live].abs().amax(-1) == 127).all()
    rounded = round_through_int8_groups(x, group).double()
    assert ((rounded - x.double()).abs() <= scales.double().repeat_interleave(group, -1) / 2 * (1 + 1e-4)).all()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_quantizes_inputs_as_the_reference(x_dtype):
    """Through an identity of unit scales the kernel's output is its input codes times their scales, which must be
    ``round_through_int8_groups``' bit for bit: ties (x / scale = k + 1/2) to even, an all-zero group zeros."""
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5])  # scale 1: codes 127, 0, 2, 2, -0, -2, 4, -126
    x = torch.cat([ties, torch.zeros(8), torch.randn(48, generator=torch.Generator().manual_seed(3))]).view(2, 32)
    x = x.to(x_dtype)
    identity = torch.eye(32, dtype=torch.int8)
    y = cpu_kernels.int8_linear_rows(x, identity, torch.ones(32, 4))
    assert torch.equal(y, round_through_int8_groups(x, 8).to(x_dtype))
    assert y[0, :8].tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, -2.0, 4.0, -126.0] and (y[0, 8:16] == 0).all()


def test_packed_layout_is_pairs_of_features_in_blocks_of_16_outputs():
    codes, scales = random_codes(37, 12, 4, torch.Generator().manual_seed(0))
    packed, packed_scales = cpu_kernels.pack_int8_pairs(codes), cpu_kernels.pack_group_scales(scales)
    assert packed.shape == (3, 6, 16, 2) and packed_scales.shape == (3, 3, 16)
    for b, p, j, t in [(0, 0, 0, 0), (0, 5, 15, 1), (1, 2, 3, 1), (2, 4, 4, 0)]:
        assert packed[b, p, j, t] == codes[16 * b + j, 2 * p + t]
    assert packed_scales[1, 2, 7] == scales[23, 2]
    assert (packed[2, :, 5:] == 0).all() and (packed_scales[2, :, 5:] == 0).all()  # outputs 37..47: padding


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), pairs=st.integers(1, 40), out_features=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_codes_packed_ahead_or_in_the_kernel_give_the_same_bits(rows, pairs, out_features, seed):
    """Eager calls pass the codes as they are and the kernel packs each block of 16 outputs (8 feature pairs at a
    time in SSE2 registers, the rest one by one); compiled graphs pass them packed ahead. Both multiply the same
    packed block: equal bits, for pair counts on and off the multiples of 8 and outputs off the blocks of 16."""
    generator = torch.Generator().manual_seed(seed)
    codes, scales = random_codes(out_features, 2 * pairs, 2, generator)
    x = torch.randn(rows, 2 * pairs, generator=generator).bfloat16()
    cpu_kernels.load_torch_ops()
    packed = torch.ops.hybridlm.cpu_int8_linear(x, cpu_kernels.pack_int8_pairs(codes),
                                                cpu_kernels.pack_group_scales(scales), out_features, None)
    as_they_are = torch.ops.hybridlm.cpu_int8_linear(x, codes, scales, out_features, None)
    assert packed.abs().max() > 0 and torch.equal(as_they_are, packed)


@pytest.mark.parametrize("rows", [1, 7, 40])  # 40: the rows are quantized by several threads too
def test_threads_give_the_same_bits(rows):
    codes, scales = random_codes(700, 256, 32, torch.Generator().manual_seed(1))
    x = torch.randn(rows, 256).bfloat16()
    one, two = on_one_and_two_threads(lambda: cpu_kernels.int8_linear_rows(x, codes, scales))
    assert one.abs().max() > 0.1 and torch.equal(one, two)


def grouped_linear(in_features=64, out_features=40, group=32, dtype=torch.bfloat16):
    """A hybridlm Linear quantized as ``quantize_weights(group_size=group)`` leaves it."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    holder = nn.Module()
    holder.proj = Linear(in_features, out_features).to(dtype)
    quantize_weights(holder, group_size=group)
    return holder.proj


@pytest.mark.parametrize("serves", [True, False])
def test_linear_takes_the_op_on_the_cpu_and_else_the_same_arithmetic_in_fp32(serves):
    """On the CPU every product (a step's rows or a prefill's) is the op's; where the op does not serve, the input
    rounded through its codes times the dequantized weight in fp32. Both are the float64 product of the codes
    within fp32 sums and the bf16 output's rounding."""
    layer = grouped_linear()
    x = torch.randn(20, 64).bfloat16()
    with torch.no_grad(), mock.patch.object(cpu_linear, "SERVES_INT8_PRODUCTS", serves):
        y = layer(x)
    weight = layer.weight
    if serves:
        assert torch.equal(y, cpu_kernels.int8_linear_rows(x, weight.qdata, weight.scale, layer.bias))
    expected = (round_through_int8_groups(x, 32).double() @ weight.dequantize(torch.float32).double().T
                + layer.bias.double())
    assert expected.abs().max() > 0.1
    assert (y.double() - expected).abs().max() <= 2 * BF16_EPS * expected.abs().max()


def test_inductor_folds_the_packing_into_constants():
    """Compiled with frozen weights (as DecodeStep compiles), the layer's graph calls the op alone on constants:
    the codes and scales were packed once. Its output is the eager op's, bit for bit."""
    from torch._inductor.utils import run_and_get_code

    layer = grouped_linear(dtype=torch.float32)
    x = torch.randn(2, 64)
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True, cpp_wrapper=False):
        y, (code,) = run_and_get_code(torch.compile(layer, fullgraph=True), x)
        expected = layer(x)
    call = re.compile(r"\s*(\w+ = )?(torch\.ops\.|extern_kernels\.|cpp_fused)[\w.]*\(")  # a kernel's call
    calls = [line for line in code.splitlines() if call.match(line)]
    assert len(calls) == 1 and "torch.ops.hybridlm.cpu_int8_linear" in calls[0], calls
    assert expected.abs().max() > 0.1 and torch.equal(y, expected)


@pytest.mark.parametrize("case, message", [
    ("packed codes shape", r"codes \[3, 32, 16\] Char for 40 outputs: it takes int8 \[out, in\] \(in even\), or "
                           r"packed \[ceil\(out / 16\), in / 2, 16, 2\]"),
    ("odd in", r"codes \[40, 63\] Char for 40 outputs: it takes int8 \[out, in\] \(in even\)"),
    ("outputs", r"codes \[40, 64\] Char for 41 outputs"),
    ("odd group", r"scales \[3, 64, 16\] Float .*the group even"),
    ("groups", r"scales \[40, 3\] Float for codes \[40, 64\]: it takes fp32 \[out, in / group\]"),
    ("packed scales beside codes", r"scales \[3, 2, 16\] Float for codes \[40, 64\]"),
    ("features", "it takes fp32 or bf16 with 64 features"),
    ("fp16 input", "it takes fp32 or bf16 with 64 features"),
])
def test_errors_name_the_problem(case, message):
    codes, scales = random_codes(40, 64, 32, torch.Generator().manual_seed(2))
    packed, packed_scales = cpu_kernels.pack_int8_pairs(codes), cpu_kernels.pack_group_scales(scales)
    x, outputs = torch.randn(2, 64), 40
    if case == "packed codes shape":
        packed = packed[..., 0]
    elif case == "odd in":
        packed, packed_scales, x = codes[:, :63], scales, torch.randn(2, 63)
    elif case == "outputs":
        packed, packed_scales, outputs = codes, scales, 41
    elif case == "odd group":
        packed_scales = torch.zeros(3, 64, 16)
    elif case == "groups":
        packed, packed_scales = codes, torch.ones(40, 3)
    elif case == "packed scales beside codes":
        packed = codes
    elif case == "features":
        x = torch.randn(2, 48)
    elif case == "fp16 input":
        x = x.half()
    cpu_kernels.load_torch_ops()
    with pytest.raises(ValueError, match=message):
        torch.ops.hybridlm.cpu_int8_linear(x, packed, packed_scales, outputs, None)
