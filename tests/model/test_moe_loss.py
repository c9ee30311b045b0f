"""The MoE load-balancing loss: hybridlm's training loss equals transformers' for the same weights, for every
imported format with experts (transformers' ``output_router_logits=True``), with and without padding."""

import pytest
import torch
import transformers

from hybridlm.layers.mlp import load_balancing_loss, routing_statistics
from tests.formats.compare import random_ids, save_and_load, tiny_model_maker, tiny_transformers_model
from tests.formats.test_granitemoehybrid import tiny_granite
from tests.formats.test_jamba import VOCAB, tiny_jamba_config
from tests.formats.test_kimi_linear import tiny_kimi_linear
from tests.formats.test_nemotron_h import tiny_nemotron_h
from tests.formats.test_qwen3_5_moe import TEXT as QWEN3_5_MOE
from tests.formats.test_qwen3_next import tiny_qwen3_next


def tiny_jamba():
    # a large coefficient, so that a wrong auxiliary loss shows in the total loss too
    return tiny_transformers_model(transformers.JambaForCausalLM, tiny_jamba_config(router_aux_loss_coef=0.3))


tiny_qwen3_5_moe = tiny_model_maker(transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig,
                                    **QWEN3_5_MOE)
tiny_lfm2_moe = tiny_model_maker(
    transformers.Lfm2MoeForCausalLM, transformers.Lfm2MoeConfig, vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1,
    num_experts=6, num_experts_per_tok=2, layer_types=["conv", "full_attention", "conv", "conv"],
    tie_word_embeddings=False, pad_token_id=0)

FORMATS = {
    "jamba": tiny_jamba,
    "granitemoehybrid": lambda: tiny_granite(router_aux_loss_coef=0.3),
    "qwen3_next": lambda: tiny_qwen3_next(router_aux_loss_coef=0.3),
    "qwen3_5_moe": lambda: tiny_qwen3_5_moe(router_aux_loss_coef=0.3),
    # transformers adds no auxiliary loss for these (their sigmoid routers are balanced by a selection bias)
    "nemotron_h": tiny_nemotron_h,
    "kimi_linear": tiny_kimi_linear,
    "lfm2_moe": tiny_lfm2_moe,
}


def batch_with_padding(padded: bool):
    ids = random_ids(VOCAB, 3, 11, seed=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        mask[2, :7] = 0
    # no target at padding, nor at each row's first real token (what a padded position predicts is arbitrary)
    labels = ids.masked_fill(mask.cumsum(-1) <= 1, -100)
    return ids, mask, labels


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_training_loss_equals_transformers(name, padded, tmp_path):
    hf = FORMATS[name]()
    ours = save_and_load(hf, tmp_path)
    ids, mask, labels = batch_with_padding(padded)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        got = ours(ids, attention_mask=mask, labels=labels)
    assert got.aux_loss is not None
    if getattr(expected, "aux_loss", None) is not None:
        assert expected.aux_loss > 1.0  # top-2 of 4: about 2, where a loss 1/k of transformers' is about 1
        assert abs(got.aux_loss.item() - expected.aux_loss.item()) <= 1e-5 * expected.aux_loss.item()
    else:
        assert ours.config.router_aux_loss_coef == 0.0
    assert abs(got.loss.item() - expected.loss.item()) <= 1e-5 * expected.loss.item()


def test_loss_pools_layers_before_the_product():
    """``E * sum_e mean_l(f) * mean_l(p)``, not the mean over layers of each layer's loss: two layers that
    are each unbalanced in opposite directions are balanced together."""
    first = routing_statistics(torch.tensor([[0.9, 0.1], [0.9, 0.1]]), torch.tensor([[0], [0]]), 2)
    second = routing_statistics(torch.tensor([[0.1, 0.9], [0.1, 0.9]]), torch.tensor([[1], [1]]), 2)
    assert load_balancing_loss(first[None]).item() == pytest.approx(1.8)
    assert load_balancing_loss(torch.stack([first, second])).item() == pytest.approx(1.0)
    uniform = routing_statistics(torch.full((4, 4), 0.25), torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]]), 4)
    assert load_balancing_loss(uniform[None]).item() == pytest.approx(2.0)  # k for uniform top-k routing
