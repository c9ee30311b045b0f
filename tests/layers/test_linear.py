"""``Linear``: a bf16/fp16 product of several rows on a CPU without products in that dtype runs in fp32 and is
rounded once; everything else is ``nn.Linear``'s own product."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hybridlm.layers.linear as linear
from hybridlm.layers.linear import MIN_FP32_ROWS, Linear

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
    reference = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert got.dtype == dtype and got.shape == reference.shape
    assert reference.abs().max() > 0.1  # not a product of zeros
    ulp = torch.finfo(dtype).eps * reference.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.double() - reference).abs() <= ulp).all()  # rounded once: within one ulp of the exact product


def _without_products(layer, x, dtypes):
    previous = linear.DTYPES_WITHOUT_CPU_PRODUCTS
    linear.DTYPES_WITHOUT_CPU_PRODUCTS = frozenset(dtypes)
    try:
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


def test_a_quantized_weight_keeps_its_own_product():
    torchao = pytest.importorskip("torchao.quantization")
    layer = nn.Sequential(_layer(torch.bfloat16, 64, 32, bias=False)).requires_grad_(False)
    torchao.quantize_(layer, torchao.Int8WeightOnlyConfig())
    x = torch.randn(MIN_FP32_ROWS, 64).bfloat16()
    assert not linear._in_fp32(x, layer[0].weight)  # its dtype reads bf16, but it is int8 codes and scales
    assert torch.equal(_without_products(layer, x, REDUCED), _without_products(layer, x, []))


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
