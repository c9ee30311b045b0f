"""HybridForCausalLM: continuation equals the full forward for any stack, generate(), save/load, training."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from hybridlm import HybridConfig, HybridForCausalLM
from hybridlm.config import MIXER_TYPES
from tests.helpers import assert_close_rel, random_ids, tiny_config, tiny_model

# single mixers, MLP-only layers ("none") and parallel mixers ("a+b"), each with a dense, MoE or no MLP
LAYER_KINDS = list(MIXER_TYPES) + ["none", "attention+mamba2", "mamba+performer"]
stacks = st.lists(st.tuples(st.sampled_from(LAYER_KINDS), st.sampled_from(["dense", "moe", "none"]))
                  .filter(lambda layer: layer != ("none", "none")), min_size=1, max_size=4)


@settings(max_examples=40)
@given(stack=stacks, batch=st.integers(1, 3), length=st.integers(1, 20),
       cuts=st.lists(st.integers(1, 19), max_size=3), seed=st.integers(0, 1000))
def test_chunked_prefill_then_decode_equals_full_forward(stack, batch, length, cuts, seed):
    model = tiny_model(seed % 7, layer_types=[m for m, _ in stack], mlp_types=[f for _, f in stack])
    ids = random_ids(batch, length, seed=seed)
    prefix = sorted({c for c in cuts if c < length})
    decode_from = prefix[-1] if prefix else 0
    bounds = prefix + list(range(decode_from + 1, length)) + [length]
    with torch.no_grad():
        full = model(ids).logits
        cache, pieces, start = model.new_cache(batch), [], 0
        for stop in bounds:
            pieces.append(model(ids[:, start:stop], cache=cache).logits)
            start = stop
    assert_close_rel(torch.cat(pieces, 1), full)
    assert cache.seen == length and cache.positions.tolist() == [length] * batch


def test_use_cache_starts_a_cache_and_cache_continues_it():
    model = tiny_model(layer_pattern="SA")
    ids = random_ids(2, 9)
    with torch.no_grad():
        out = model(ids[:, :6], use_cache=True)
        assert out.cache is not None and out.cache.seen == 6
        nxt = model(ids[:, 6:], cache=out.cache)
        assert_close_rel(nxt.logits, model(ids).logits[:, 6:])
        assert model(ids).cache is None


GEN = dict(layer_pattern="MASP", mlp_types=["moe", "dense", "none", "moe"], pad_token_id=0)


def test_generate_greedy_equals_argmax_loop():
    model = tiny_model(**GEN)
    prompt = random_ids(1, 5)
    out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_left_padded_generation_equals_each_prompt_alone():
    model = tiny_model(**GEN)
    prompts = [random_ids(1, n, seed=n)[0] for n in (3, 8, 5)]
    width = 8
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    kwargs = dict(max_new_tokens=7, min_new_tokens=7, do_sample=False)
    together = model.generate(ids, attention_mask=mask, **kwargs)[:, width:]
    for row, p in enumerate(prompts):
        assert torch.equal(together[row], model.generate(p[None], **kwargs)[0, len(p):])


def test_beam_search_reorders_the_cache_correctly():
    """Beam search with the cache (rows reordered every step) equals beam search recomputing from scratch."""
    model = tiny_model(**GEN)
    prompt = random_ids(2, 4)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                  early_stopping=False)
    cached = model.generate(prompt, **kwargs)
    recomputed = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, recomputed)
    assert cached.shape == (6, 10)


def test_sampling_runs_and_respects_top_k_1():
    model = tiny_model(**GEN)
    prompt = random_ids(1, 4)
    greedy = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    top1 = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=1, temperature=0.7)
    assert torch.equal(greedy, top1)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model(layer_pattern="AMSPL", mlp_types=["moe", "dense", "none", "dense", "moe"],
                       tie_word_embeddings=True)
    ids = random_ids(2, 11)
    model.save_pretrained(tmp_path)
    for loader in (HybridForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path).eval()
        assert type(loaded) is HybridForCausalLM
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits)
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert isinstance(AutoConfig.from_pretrained(tmp_path), HybridConfig)


def test_gradients_reach_every_parameter():
    model = tiny_model(layer_pattern="AMSPL", mlp_types=["moe", "dense", "none", "dense", "moe"]).train()
    ids = random_ids(4, 24)
    out = model(ids, labels=ids)
    assert out.aux_loss is not None
    out.loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reaches {name}"


def test_training_lowers_the_loss():
    """A few hundred steps on a copy task: predict the token seen 4 positions earlier."""
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config(layer_pattern="MSA", mlp_types=["moe", "dense", "dense"],
                                          vocab_size=16)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(200):
        head = torch.randint(1, 16, (16, 4), generator=generator)
        ids = torch.cat([head, head, head], 1)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.6 * sum(losses[:20]) / 20


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model(layer_pattern="AS").train()
    ids = random_ids(2, 10)
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        assert_close_rel(param.grad, plain[name], rel=1e-5)


# --- bad input -------------------------------------------------------------------------------------


def test_float_ids_are_rejected():
    with pytest.raises(TypeError, match="integer token ids"):
        tiny_model(layer_pattern="A")(torch.ones(1, 3))


def test_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_model(layer_pattern="A")(torch.tensor([[1, 61]]))


def test_prompt_longer_than_the_limit_is_rejected():
    model = tiny_model(layer_pattern="AM", max_position_embeddings=8)
    with pytest.raises(ValueError, match="limit of 8"):
        model(random_ids(1, 9))
    cache = model.new_cache(1)
    model(random_ids(1, 8), cache=cache)
    with pytest.raises(ValueError, match="limit of 8"):
        model(random_ids(1, 1), cache=cache)


def test_padding_inside_a_row_is_rejected():
    model = tiny_model(layer_pattern="AM")
    with pytest.raises(ValueError, match="padding"):
        model(random_ids(1, 4), attention_mask=torch.tensor([[1, 0, 1, 1]]))
    cache = model.new_cache(1)
    with pytest.raises(ValueError, match="left padding"):
        model(random_ids(1, 3), attention_mask=torch.tensor([[1, 1, 0]]), cache=cache)


def test_mask_of_the_wrong_length_is_rejected():
    with pytest.raises(ValueError, match="attention_mask"):
        tiny_model(layer_pattern="A")(random_ids(1, 4), attention_mask=torch.ones(1, 6))


def test_bidirectional_linformer_cannot_be_a_causal_lm():
    with pytest.raises(ValueError, match="linformer_causal"):
        HybridForCausalLM(tiny_config(layer_pattern="L", linformer_causal=False))


def test_own_checkpoint_with_missing_or_unexpected_weights_is_rejected(tmp_path):
    """transformers would initialise a missing weight randomly and only log it: hybridlm refuses, naming it."""
    from safetensors.torch import load_file, save_file

    tiny_model(layer_pattern="AM").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.1.mixer.A_log")
    state["model.extra.weight"] = torch.zeros(3)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for loader in (HybridForCausalLM, AutoModelForCausalLM):
        with pytest.raises(ValueError, match=r"missing keys: model\.layers\.1\.mixer\.A_log.*unexpected keys: "
                                             r"model\.extra\.weight"):
            loader.from_pretrained(tmp_path)
