"""The decode-step linear kernel (``kernels/cpu/linear.cpp`` through ``cpu_kernels.linear_rows`` and the
``hybridlm::cpu_linear`` op, and over packed weights through ``packed_linear_rows`` and ``cpu_packed_linear``)
against the float64 product of the same weights; the packed layout; its threads; compiled against eager, and with
frozen weights packed once; where :class:`hybridlm.layers.linear.Linear` hands it the product, and where not; its
errors."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.layers.linear import Linear
from hybridlm.ops import cpu_kernels, cpu_linear
from tests.helpers import on_one_and_two_threads

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")

FP32_EPS = 2.0 ** -24  # unit roundoff of fp32 sums
BF16_EPS = 2.0 ** -8  # of the bf16 output (round to nearest: half of its 2^-7 spacing)


def random_weight(out_features, in_features, kind, generator):
    """``(weight, scale, zero_point, dequantized float64 weight)``: bf16 weights, or int8 codes with a scale per
    output row and (``kind == "int8-zero"``) nonzero zero points."""
    if kind == "bf16":
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
        return weight, None, None, weight.double()
    codes = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scale = torch.rand(out_features, generator=generator) * 0.02 + 0.001
    zero = (torch.randint(-20, 21, (out_features,), generator=generator, dtype=torch.int8)
            if kind == "int8-zero" else None)
    shifted = codes.double() - (0 if zero is None else zero.double()[:, None])
    return codes, scale, zero, shifted * scale.double()[:, None]


def check_against_float64(y, x, exact_weight, bias, scale, zero):
    """``y`` within the error of an fp32 sum of its terms (the kernel subtracts the zero point's share after the
    sum, so that share's magnitude counts too), of the scale and bias applied in fp32, and of one rounding to
    ``y``'s dtype, from the float64 product of the same inputs."""
    x64 = x.double()
    bias64 = 0 if bias is None else bias.double()
    exact = x64 @ exact_weight.T + bias64
    magnitudes = x64.abs() @ exact_weight.abs().T + abs(bias64)
    if zero is not None:
        magnitudes = magnitudes + x64.abs().sum(-1, keepdim=True) * (2 * zero.double().abs() * scale.double())
    bound = 4 * (x.shape[-1] + 4) * FP32_EPS * magnitudes
    if y.dtype == torch.bfloat16:
        bound = bound + BF16_EPS * exact.abs()
    assert y.shape == exact.shape and y.dtype == x.dtype
    assert (exact.abs() > 10 * bound).any()  # a product that a wrong or zero result would not match
    excess = ((y.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"kernel off the float64 product by {excess:.3g} beyond the rounding bound"


def product(x, weight, scale, zero, bias, packed):
    """The kernel's product over nn.Linear's layout, or over the packed weight."""
    if not packed:
        return cpu_kernels.linear_rows(x, weight, scale, zero, bias)
    return cpu_kernels.packed_linear_rows(x, cpu_kernels.pack_linear_weight(weight), weight.shape[0], scale, zero,
                                          bias)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 20), in_features=st.integers(1, 70), out_features=st.integers(1, 60),
       kind=st.sampled_from(["bf16", "int8", "int8-zero"]), x_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       with_bias=st.booleans(), packed=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_is_the_product(rows, in_features, out_features, kind, x_dtype, with_bias, packed, seed):
    """Both layouts: rows in blocks of 4 (of 6 packed, a single row with two sets of sums) and every remainder,
    every remainder of in (8 lanes, and odd features for the single row's two sets) and out (blocks of 3 rows, or
    of 16 packed outputs, the last padded), both weight kinds with and without zero points, bias or none."""
    g = torch.Generator().manual_seed(seed)
    weight, scale, zero, exact_weight = random_weight(out_features, in_features, kind, g)
    x = torch.randn(rows, in_features, generator=g).to(x_dtype)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    y = product(x, weight, scale, zero, bias, packed)
    check_against_float64(y, x, exact_weight, bias, scale, zero)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_packed_layout_is_blocks_of_16_outputs(dtype):
    """``packed[b, k, j]`` is ``weight[16 b + j, k]``, and zero past the last output."""
    weight = torch.arange(50 * 7).remainder(97).view(50, 7).to(dtype)
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed.shape == (4, 7, 16) and packed.dtype == dtype and packed.is_contiguous()
    expected = torch.zeros(4, 7, 16, dtype=dtype)
    for n in range(50):
        for k in range(7):
            expected[n // 16, k, n % 16] = weight[n, k]
    assert torch.equal(packed, expected)


def test_leading_dimensions_and_bf16_bias():
    """``[batch, time, in]`` inputs keep their leading dimensions; a bf16 bias (a bf16 model's) is taken."""
    g = torch.Generator().manual_seed(1)
    weight, _, _, exact_weight = random_weight(24, 40, "bf16", g)
    x = torch.randn(2, 3, 40, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    y = cpu_kernels.linear_rows(x, weight, bias=bias)
    assert y.shape == (2, 3, 24)
    check_against_float64(y.reshape(6, 24), x.reshape(6, 40), exact_weight, bias, None, None)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows", [1, 7])
def test_threads_give_the_same_bits(rows, packed):
    """The threads split the outputs, so each output is summed alike: 2 threads, bit for bit 1 (the weights are
    large enough, 2^18, that the kernel starts its second thread)."""
    g = torch.Generator().manual_seed(2)
    weight, scale, zero, _ = random_weight(512, 512, "int8-zero", g)
    x = torch.randn(rows, 512, generator=g)
    one, two = on_one_and_two_threads(lambda: product(x, weight, scale, zero, None, packed))
    assert torch.equal(one, two)


def bf16_linear(in_features=48, out_features=20, bias=True):
    torch.manual_seed(3)
    return Linear(in_features, out_features, bias=bias).bfloat16().eval()


@pytest.fixture
def kernel_serves():
    """This CPU counted as one the kernel serves (one without bf16 products), whatever it is."""
    with mock.patch.object(cpu_linear, "SERVES_THIS_CPU", True):
        yield


def test_linear_takes_the_kernel_for_few_rows(kernel_serves):
    layer = bf16_linear()
    x = torch.randn(2, cpu_linear.MAX_ROWS // 2, 48).bfloat16()
    with torch.no_grad():
        y = layer(x)
    assert torch.equal(y, cpu_kernels.linear_rows(x, layer.weight, bias=layer.bias))


@pytest.mark.parametrize("case", ["many rows", "gradients", "fp32 weight", "cpu has products"])
def test_linear_keeps_torch_product_elsewhere(kernel_serves, case):
    """A prefill, a product that needs gradients, an fp32 layer and a CPU with bf16 products keep torch's."""
    layer = bf16_linear()
    x = torch.randn(cpu_linear.MAX_ROWS + 1 if case == "many rows" else 2, 48).bfloat16()
    if case == "fp32 weight":
        layer, x = layer.float(), x.float()
    with (mock.patch.object(torch.ops.hybridlm, "cpu_linear", side_effect=AssertionError("kernel called")) as kernel,
          mock.patch.object(cpu_linear, "SERVES_THIS_CPU", case != "cpu has products"),
          torch.set_grad_enabled(case == "gradients")):
        y = layer(x)
    assert not kernel.called
    assert torch.allclose(y.float(), torch.nn.functional.linear(x.float(), layer.weight.float(),
                                                                layer.bias.float()), rtol=2e-2, atol=2e-2)
    if case == "gradients":
        y.sum().backward()
        assert layer.weight.grad is not None


def test_int8_weight_only_codes(kernel_serves):
    """torchao's weight-only int8 codes (``quantize_weights``) go to the kernel with their scale, in an fp32 and a
    bf16 layer, and give the product of the dequantized weight."""
    pytest.importorskip("torchao")
    from hybridlm.model import quantize_weights

    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.Sequential(bf16_linear().to(dtype))
        quantize_weights(model)
        weight = model[0].weight
        x = torch.randn(3, 48).to(dtype)
        with mock.patch.object(torch.ops.hybridlm, "cpu_linear", wraps=torch.ops.hybridlm.cpu_linear) as kernel, \
                torch.no_grad():
            y = model(x)
        assert kernel.call_count == 1 and kernel.call_args.args[1].dtype == torch.int8
        exact_weight = weight.dequantize(torch.float32).double()
        check_against_float64(y, x, exact_weight, model[0].bias, weight.scale.float(), None)


def test_compiled_step_calls_the_op_as_eager(kernel_serves):
    """Traced whole (one opaque op, its fake shape registered), the compiled layer gives eager's bits."""
    layer = bf16_linear()
    x = torch.randn(4, 48).bfloat16()
    torch.library.opcheck(torch.ops.hybridlm.cpu_linear, (x, layer.weight.detach(), None, None, layer.bias.detach()))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))


def weight_only_codes(weight, scale, zero):
    """A stand-in for torchao's weight-only int8 tensor (what ``_weight_parts`` reads of it)."""
    return mock.Mock(qdata=weight, scale=scale, zero_point=zero, act_quant_kwargs=None, act_pre_scale=None,
                     block_size=[1, weight.shape[1]], dtype=torch.bfloat16)


@pytest.mark.parametrize("rows, kind, taken", [(1, "bf16", False), (2, "bf16", True), (4, "int8", False)])
def test_in_a_graph_of_weight_inputs_only_bf16_steps_of_rows(kernel_serves, rows, kind, taken):
    """Traced into a graph whose weights are inputs, a single row and int8 codes are left to inductor's own
    products (faster there than the unpacked op); bf16 weights of several rows go to the op."""
    g = torch.Generator().manual_seed(4)
    weight, scale, zero, _ = random_weight(20, 48, kind, g)
    codes = weight_only_codes(weight, scale, zero)
    x = torch.randn(rows, 48, generator=g).bfloat16()
    assert kind == "bf16" or cpu_linear._weight_parts(codes, x.dtype) is not None  # codes it takes in eager
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True), \
            mock.patch.object(cpu_linear, "_weights_are_constants", return_value=False), \
            mock.patch.object(torch.ops.hybridlm, "cpu_linear", return_value="op") as op, torch.no_grad():
        y = cpu_linear.kernel_linear(x, weight if kind == "bf16" else codes, None)
    assert (y == "op") is taken and op.called is taken


@pytest.mark.parametrize("rows, kind", [(1, "bf16"), (16, "bf16"), (1, "int8"), (5, "int8-zero")])
def test_in_a_graph_of_frozen_weights_the_packed_op(kernel_serves, rows, kind):
    """Traced into a graph whose weights are constants (inductor's freezing), every step of up to MAX_ROWS rows
    goes to the packed op, with the packed weight (or codes), its outputs, scale and zero point."""
    g = torch.Generator().manual_seed(5)
    weight, scale, zero, _ = random_weight(30, 48, kind, g)
    x = torch.randn(rows, 48, generator=g).bfloat16()
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True), \
            mock.patch.object(cpu_linear, "_weights_are_constants", return_value=True), \
            mock.patch.object(torch.ops.hybridlm, "cpu_packed_linear", return_value="op") as op, torch.no_grad():
        y = cpu_linear.kernel_linear(x, weight if kind == "bf16" else weight_only_codes(weight, scale, zero), None)
    assert y == "op"
    (x_arg, packed, out_features, scale_arg, zero_arg, bias_arg), _ = op.call_args
    assert x_arg is x and out_features == 30 and bias_arg is None
    assert torch.equal(packed, cpu_kernels.pack_linear_weight(weight))
    assert scale_arg is scale and zero_arg is zero


def test_inductor_folds_the_packing_into_a_constant(kernel_serves):
    """Compiled by inductor with frozen weights (as DecodeStep compiles), the layer's graph runs the packed op
    alone, on a constant: the packing ran once, at compile time. Its output is the packed op's, bit for bit."""
    from torch._inductor.utils import run_and_get_code

    layer = bf16_linear(bias=False)
    x = torch.randn(3, 48).bfloat16()
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True, cpp_wrapper=False):
        compiled = torch.compile(layer, fullgraph=True)
        y, (code,) = run_and_get_code(compiled, x)
    call = re.compile(r"\s*(\w+ = )?(torch\.ops\.|extern_kernels\.|cpp_fused)[\w.]*\(")  # a kernel's call
    calls = [line for line in code.splitlines() if call.match(line)]
    assert len(calls) == 1 and "torch.ops.hybridlm.cpu_packed_linear" in calls[0], calls
    packed = cpu_kernels.pack_linear_weight(layer.weight.detach())
    expected = cpu_kernels.packed_linear_rows(x, packed, 20)
    assert expected.isfinite().all() and expected.abs().max() > 0.1  # a product, not zeros
    assert torch.equal(y, expected)


@pytest.mark.parametrize("case, message", [
    ("features", "must be fp32 or bf16 with 48 features"),
    ("fp32 weight", "takes bf16 weights, or int8 codes with their scale"),
    ("codes without scale", "takes bf16 weights, or int8 codes with their scale"),
    ("short scale", "scale [19] has not one entry per output (20)"),
    ("fp16 input", "must be fp32 or bf16"),
    ("1-D weight", "it takes a 2-D weight"),
    ("packed for other outputs", "packed weight [2, 48, 16] for 40 outputs: it takes [ceil(out / 16), in, 16]"),
])
def test_errors_name_the_problem(case, message):
    weight = torch.randn(20, 48).bfloat16()
    x, scale = torch.randn(2, 48), None
    if case == "features":
        x = torch.randn(2, 40)
    elif case == "fp32 weight":
        weight = weight.float()
    elif case == "codes without scale":
        weight = weight.to(torch.int8)
    elif case == "short scale":
        weight, scale = weight.to(torch.int8), torch.ones(19)
    elif case == "1-D weight":
        weight = weight[0]
    elif case == "packed for other outputs":
        with pytest.raises(ValueError, match=re.escape(message)):
            cpu_kernels.packed_linear_rows(x, cpu_kernels.pack_linear_weight(weight), 40)
        return
    else:
        x = x.half()
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_kernels.linear_rows(x, weight, scale)
