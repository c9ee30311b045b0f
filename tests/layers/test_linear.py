"""``Linear``: a bf16/fp16 product of several rows on a CPU without products in that dtype runs in fp32 and is
rounded once (past the few-row kernel, tested in tests/ops/test_cpu_linear.py); everything else is
``nn.Linear``'s own product."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hybridlm.layers.linear as linear
from hybridlm.layers.linear import MIN_FP32_ROWS, Linear
from hybridlm.ops import cpu_linear

REDUCED = (torch.bfloat16, torch.float16)


@pytest.fixture
def products_spy(monkeypatch):
    """The dtypes of the inputs every ``F.linear`` call multiplies."""
    seen = []
    original = F.linear

    def spy(x, weight, bias=None):
        seen.append((x.dtype, weight.dtype))
        return original(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    return seen


def _layer(dtype, in_features, out_features, bias, seed=0):
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():  # nn.Linear's init is small for few inputs: non-trivial weights and bias
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer.to(dtype)


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(REDUCED), rows=st.integers(MIN_FP32_ROWS, 40), in_features=st.integers(1, 96),
       out_features=st.integers(1, 48), bias=st.booleans(), leading=st.sampled_from([(), (2,)]))
def test_several_rows_in_reduced_precision_are_multiplied_in_fp32_and_rounded_once(
        dtype, rows, in_features, out_features, bias, leading):
    """Against the float64 product rounded once to ``dtype``: fp32 accumulation of exact products of bf16/fp16
    values is within one rounding of it (the native bf16 product of a CPU with one rounds the same way)."""
    layer = _layer(dtype, in_features, out_features, bias).requires_grad_(False)
    x = torch.randn(*leading, rows, in_features).to(dtype)
    got = _without_products(layer, x, REDUCED)
    bias = None if layer.bias is None else layer.bias.double()
    reference = F.linear(x.double(), layer.weight.double(), bias)
    assert got.dtype == dtype and got.shape == reference.shape
    assert reference.abs().max() > 0.1  # not a product of zeros
    magnitudes = F.linear(x.double().abs(), layer.weight.double().abs(), None if bias is None else bias.abs())
    assert_rounded_once(got, reference, magnitudes, in_features + 1)


def assert_rounded_once(got, reference, magnitudes, terms):
    """``got`` is the exact ``reference`` rounded once to ``got``'s dtype: within half an ulp of it, give or take
    the fp32 accumulation of ``terms`` products (at most ``terms * eps32 * sum |products|``, ``magnitudes``).
    Rounding twice (a product rounded to bf16, then scaled) lands up to a whole ulp away."""
    half_ulp = 0.5 * torch.finfo(got.dtype).eps * reference.abs()
    accumulation = terms * torch.finfo(torch.float32).eps * magnitudes
    assert ((got.double() - reference).abs() <= half_ulp + accumulation).all()


def _without_products(layer, x, dtypes):
    """``layer(x)`` on a CPU without products in ``dtypes``, the few-row kernel off (tests/ops/test_cpu_linear.py
    tests it and where ``Linear`` calls it)."""
    previous = linear.DTYPES_WITHOUT_CPU_PRODUCTS
    linear.DTYPES_WITHOUT_CPU_PRODUCTS = frozenset(dtypes)
    try:
        with mock.patch.object(cpu_linear, "SERVES_THIS_CPU", False):
            return layer(x)
    finally:
        linear.DTYPES_WITHOUT_CPU_PRODUCTS = previous


@pytest.mark.parametrize("dtype", REDUCED)
def test_which_product_runs(dtype, products_spy):
    layer = _layer(dtype, 16, 8, bias=True)
    many, few = torch.randn(MIN_FP32_ROWS, 16).to(dtype), torch.randn(1, MIN_FP32_ROWS - 1, 16).to(dtype)
    _without_products(layer, many, REDUCED)
    assert products_spy.pop() == (torch.float32, torch.float32)
    _without_products(layer, few, REDUCED)  # a decode step: the copy of the weight would cost more than it saves
    assert products_spy.pop() == (dtype, dtype)
    _without_products(layer, many, [])  # a CPU with products in the dtype keeps them
    assert products_spy.pop() == (dtype, dtype)
    fp32 = _layer(torch.float32, 16, 8, bias=True)
    x = torch.randn(MIN_FP32_ROWS, 16)
    assert torch.equal(_without_products(fp32, x, REDUCED), nn.Linear.forward(fp32, x))
    assert products_spy[-2:] == [(torch.float32, torch.float32)] * 2


def test_int8_weight_only_codes_are_dequantized_to_fp32_and_other_codes_keep_their_product():
    quantization = pytest.importorskip("torchao.quantization")
    layer, activations_too = (nn.Sequential(_layer(torch.bfloat16, 64, 32, bias=False)).requires_grad_(False)
                              for _ in range(2))
    quantization.quantize_(layer, quantization.Int8WeightOnlyConfig())
    quantization.quantize_(activations_too, quantization.Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(MIN_FP32_ROWS, 64).bfloat16()
    codes = layer[0].weight
    assert codes.qdata.dtype == torch.int8
    weights = codes.qdata.double() * codes.scale.double()
    reference = x.double() @ weights.T  # the codes' exact product
    assert reference.abs().max() > 0.1
    assert_rounded_once(_without_products(layer, x, REDUCED), reference, x.double().abs() @ weights.abs().T, 64)
    assert torch.equal(linear._fp32_weight(codes, x), codes.dequantize(torch.float32))  # in place, the same bits
    assert linear._fp32_weight(activations_too[0].weight, x) is None  # the input is quantized too: its own product
    assert torch.equal(_without_products(activations_too, x, REDUCED), _without_products(activations_too, x, []))


def test_int8_codes_with_a_zero_point_dequantize_to_the_correctly_rounded_fp32_weight():
    """(codes - zero point) is an exact integer and its product with the fp32 scale is rounded once: the float64
    product rounded to fp32, bit for bit (a stand-in for torchao's tensor, whose symmetric codes have no offset)."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (24, 16), generator=g, dtype=torch.int8)
    zero_point = torch.randint(-9, 10, (24, 1), generator=g, dtype=torch.int8)
    scale = torch.rand(24, 1, generator=g) * 0.01 + 1e-3
    weight = mock.Mock(qdata=codes, scale=scale, zero_point=zero_point, act_quant_kwargs=None, act_pre_scale=None,
                       block_size=[1, 16], dtype=torch.bfloat16)
    expected = ((codes.double() - zero_point.double()) * scale.double()).float()
    assert bool((zero_point != 0).any()) and expected.abs().max() > 0.1
    assert torch.equal(linear._fp32_weight(weight, torch.zeros(MIN_FP32_ROWS, 16).bfloat16()), expected)


def test_gradients_flow_through_the_fp32_product():
    layer = _layer(torch.bfloat16, 24, 12, bias=True)
    x = torch.randn(5, 24).bfloat16().requires_grad_()
    _without_products(layer, x, REDUCED).float().square().sum().backward()
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.bfloat16
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias))
    F.linear(x64, w64, b64).to(torch.bfloat16).double().square().sum().backward()  # the same rounded output
    for got, expected in ((x.grad, x64.grad), (layer.weight.grad, w64.grad), (layer.bias.grad, b64.grad)):
        assert expected.abs().max() > 0.1
        torch.testing.assert_close(got.double(), expected, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=0)
