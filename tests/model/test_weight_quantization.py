"""Int8 weight-only linears (hybridlm.model.quantize_weights, through torchao).

Oracles: the scheme written out in float64 (one scale per output row, absmax / 127.5; every weight within half a
step of its float value); the quantized model against a float model holding the dequantized weights (a quantized
linear is dequantize-then-matmul), which must differ from the original float model; the compiled decode step
against eager decoding of the same quantized model."""

import pytest
import torch
from torch import nn

from hybridlm.decoding.decode_step import DecodeStep
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.model import quantize_weights
from hybridlm.ops.activation_groups import round_through_int8_groups
from tests.helpers import assert_close_rel, random_ids, relative_error, tiny_model

pytest.importorskip("torchao")

#: every mixer kind but MLA (refused below), and an MLP on each layer
PATTERN = "AMSRPLDKC"


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """torchao's int8 weight as the float tensor it stands for: codes times the row scales."""
    return weight.qdata.float() * weight.scale.float().view(-1, 1)


def float_twin(model, quantized) -> nn.Module:
    """``model`` with each linear weight replaced by the dequantized weight of ``quantized``'s."""
    twin = tiny_model(layer_pattern=PATTERN)
    twin.load_state_dict(model.state_dict())
    twin.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied, as quantizing does
    modules = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(dequantized(modules[name].weight))
    return twin


def test_each_weight_is_within_half_a_step_of_its_float_value():
    model = tiny_model(layer_pattern=PATTERN)
    floats = {name: m.weight.detach().double().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize_weights(model)
    modules = dict(model.named_modules())
    assert len(floats) > 20 and "lm_head" in floats
    for name, weight in floats.items():
        stored = modules[name].weight
        assert stored.qdata.dtype == torch.int8, name
        step = weight.abs().amax(1, keepdim=True) / 127.5  # float64, from the float weight alone
        assert_close_rel(stored.scale.double().view(-1, 1), step, 1e-6)
        # half a step, plus what the fp32 scale's own rounding (an ulp, 2**-23 of it) does to a code of up to 128
        bound = step * (0.5 + 128 * 2.0**-23)
        assert ((dequantized(stored).double() - weight).abs() <= bound).all(), name
    assert model.get_input_embeddings().weight.dtype == torch.float32  # untied: the embedding keeps its float weight


def test_a_quantized_model_computes_with_the_dequantized_weights():
    model = tiny_model(layer_pattern=PATTERN)
    ids = random_ids(2, 12)
    with torch.no_grad():
        reference = model(ids).logits
        quantized = quantize_weights(tiny_model(layer_pattern=PATTERN))
        twin = float_twin(model, quantized)
        got, expected = quantized(ids).logits, twin(ids).logits
    assert_close_rel(got, expected, 1e-5)
    assert 1e-4 < relative_error(got, reference) < 5e-2  # rounded, by about the codes' step


def test_compiled_decode_equals_eager_decode_of_the_quantized_model():
    model = quantize_weights(tiny_model(layer_pattern="SRA"))
    prompts = [[5, 6, 7, 8, 9], [3, 4, 9, 1, 2, 7]]
    eager = IncrementalDecoder(model).generate(prompts, max_new_tokens=6)
    compiled = IncrementalDecoder(model, compile=True).generate(prompts, max_new_tokens=6)
    assert torch.equal(compiled, eager)


def test_compiled_decode_of_a_bf16_quantized_model_follows_its_eager_decode():
    """On a bf16 model the compiled step multiplies the int8 codes by bf16 inputs in inductor's weight-only GEMM (on
    fp32 it folds them back into float weights): teacher-forced, its logits are the eager step's within four bf16
    roundings of the largest."""
    model = quantize_weights(tiny_model(layer_pattern="SA").to(torch.bfloat16))
    prompt, tokens = random_ids(2, 5), random_ids(2, 4, seed=1)
    eager, compiled = DecodeStep(model), DecodeStep(model, compile=True)
    caches = [model.new_cache(2, max_length=12, static=True) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(prompt, cache=cache)
        for t in range(tokens.shape[1]):
            expected, got = eager(tokens[:, t], caches[0]).float(), compiled(tokens[:, t], caches[1]).float()
            assert expected.abs().max() > 0.1, "the eager logits are near zero: the comparison would prove little"
            assert relative_error(got, expected) <= 4 * 2.0 ** -8


def test_mla_is_refused_by_name_unless_its_absorbed_projection_is_kept_in_float():
    model = tiny_model(layer_pattern="TA")
    refusal = r"mla layers read.*model\.layers\.0\.mixer\.kv_b_proj.*exclude=\('kv_b_proj',\)"
    with pytest.raises(ValueError, match=refusal):
        quantize_weights(model)
    quantize_weights(model, exclude=("kv_b_proj",))
    mixer = model.model.layers[0].mixer
    assert type(mixer.kv_b_proj.weight) is nn.Parameter and hasattr(mixer.q_proj.weight, "qdata")
    with torch.no_grad():
        assert torch.isfinite(model(random_ids(1, 6)).logits).all()


def test_bad_use_is_a_clear_error(tmp_path):
    model = quantize_weights(tiny_model(layer_pattern="SA"))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(model)
    with pytest.raises(ValueError, match="save the float model"):
        model.save_pretrained(tmp_path / "model")
    assert not (tmp_path / "model").exists()
    with pytest.raises(ValueError, match="bits=4"):
        quantize_weights(tiny_model(layer_pattern="SA"), bits=4)


def test_grouped_codes_multiply_the_inputs_rounded_through_their_own_codes():
    """With ``group_size``, a prefill (int8 x int8 products) computes as a float model holding the dequantized
    weights whose linears each see their input rounded through its int8 codes per group; the weights are
    within half a step of their group's scale, absmax / 127.5; the result differs from the float model's."""
    model = tiny_model(layer_pattern="SRA")
    quantized = quantize_weights(tiny_model(layer_pattern="SRA"), group_size=16)
    twin = tiny_model(layer_pattern="SRA")
    twin.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    modules = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(module, nn.Linear):
                weight = modules[name].weight
                assert weight.scale.shape == (module.out_features, module.in_features // 16)
                steps = weight.scale.double().repeat_interleave(16, -1)
                error = (weight.dequantize(torch.float32).double() - module.weight.double()).abs()
                assert (error <= steps / 2 + 2.0**-22 * module.weight.double().abs()).all()  # + fp32 rounding
                module.weight.copy_(weight.dequantize(torch.float32))
                module.register_forward_pre_hook(lambda _, args: (round_through_int8_groups(args[0], 16),))
        ids = random_ids(2, 24)
        got, expected, reference = quantized(ids).logits, twin(ids).logits, model(ids).logits
    assert_close_rel(got, expected, 1e-5)
    assert 1e-4 < relative_error(got, reference) < 5e-2


def test_compiled_decode_of_grouped_codes_equals_eager_decode():
    """Eager and compiled steps both multiply in the int8 x int8 op (the compiled one over codes packed once)."""
    model = quantize_weights(tiny_model(layer_pattern="SA"), group_size=16)
    prompts = [[5, 6, 7, 8, 9], [3, 4, 9, 1, 2, 7]]
    eager = IncrementalDecoder(model).generate(prompts, max_new_tokens=6)
    compiled = IncrementalDecoder(model, compile=True).generate(prompts, max_new_tokens=6)
    assert torch.equal(compiled, eager)


def test_bad_group_sizes_are_clear_errors():
    for size in (3, 0, 16.0):
        with pytest.raises(ValueError, match=f"group_size={size!r}; it takes an even number"):
            quantize_weights(tiny_model(layer_pattern="SA"), group_size=size)
    model = tiny_model(layer_pattern=PATTERN)
    with pytest.raises(ValueError, match=r"group_size=16 does not serve model\.layers\.\d+\.mixer\.\w+"):
        quantize_weights(model, group_size=16)
    assert not any(hasattr(module.weight, "qdata") for module in model.modules() if isinstance(module, nn.Linear))
