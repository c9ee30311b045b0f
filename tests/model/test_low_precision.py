"""bf16 and fp16 models on the CPU, end to end: every mixer kind decodes as its own full forward does, close to
fp32, with its recurrent state kept in fp32; an fp16 overflow is an error, not NaN logits."""

import copy

import pytest
import torch

import hybridlm
from hybridlm.decoding.decode_step import DecodeStep
from hybridlm.mixers import MIXERS

from ..helpers import random_ids, relative_error, tiny_model

#: Kinds whose state is a recurrence (a scan's, a delta rule's, a running sum's): kept in fp32 whatever the
#: model's dtype, since it accumulates over the whole context. The others keep tokens (keys and values, latents,
#: a conv window) in the model's dtype.
RECURRENT = {"mamba", "mamba2", "mamba3", "gated_deltanet", "kda", "performer", "linformer"}

#: bf16 keeps 8 significant bits (a relative rounding of 2^-8 = 3.9e-3 per operation), fp16 11 (4.9e-4).
#: Decoding and the full forward round differently (a recurrence against a chunked scan, one row against many
#: in a matmul), so the two differ by a few roundings of the largest logit: at most 4 units of each, where
#: the tiny models measure up to 1.3 (bf16) and 1.5 (fp16) units. The KL to fp32 measures 3e-7 (bf16) and 3e-8
#: (fp16) nats at most on these random models.
DECODE_REL = {torch.bfloat16: 4 * 2.0 ** -8, torch.float16: 4 * 2.0 ** -11}
KL_BOUND = {torch.bfloat16: 1e-5, torch.float16: 1e-6}


def next_token_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(reference) || softmax(logits)), in nats."""
    p, q = reference.double().log_softmax(-1), logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@torch.no_grad()
def decoded_token_by_token(model, ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    cache = model.new_cache(ids.shape[0])
    return torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(ids.shape[1])], dim=1), cache


def float_dtypes(cache) -> set:
    found = set()
    for state in cache.states:
        for value in vars(state).values() if state is not None else ():
            if torch.is_tensor(value) and value.is_floating_point():
                found.add(value.dtype)
    return found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_low_precision_decodes_like_its_full_forward(kind, dtype):
    fp32 = tiny_model(layer_types=[kind, "attention"])
    model = copy.deepcopy(fp32).to(dtype)
    ids = random_ids(2, 12)
    with torch.no_grad():
        reference, full = fp32(ids).logits, model(ids).logits
        steps, cache = decoded_token_by_token(model, ids)
        generated = model.generate(ids[:, :6], max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert full.dtype == steps.dtype == dtype and bool(torch.isfinite(full).all() and torch.isfinite(steps).all())
    assert relative_error(steps, full) <= DECODE_REL[dtype]
    assert next_token_kl(reference, full) <= KL_BOUND[dtype]
    assert generated.shape == (2, 12)
    kept = float_dtypes(cache)
    assert kept <= {dtype, torch.float32}
    if kind in RECURRENT:
        assert torch.float32 in kept, f"{kind}'s recurrent state is not kept in fp32: {kept}"


def test_float16_overflow_is_an_error_not_nan():
    model = tiny_model(layer_types=["mamba2", "attention"]).to(torch.float16)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(6e4)
        model.config.embedding_multiplier = 4.0  # 2.4e5: past float16's 65504
        with pytest.raises(FloatingPointError, match="float16 model overflowed.*bfloat16"):
            model(random_ids(1, 5))
        cache = model.new_cache(1)
        with pytest.raises(FloatingPointError, match="float16 model overflowed"):  # the decoder's own step too
            DecodeStep(model)(random_ids(1, 1)[:, 0], cache)


@pytest.fixture(scope="module")
def held_out_ids():
    from transformers import AutoTokenizer

    from hybridlm.training.corpus import stdlib_corpus

    tokenizer = AutoTokenizer.from_pretrained(hybridlm.bundled_model_dir("hybrid"))
    text = stdlib_corpus().held_out_texts[1]
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:256]])


def test_bundled_hybrid_in_bf16(held_out_ids):
    """The trained bundled hybrid loaded with ``dtype=torch.bfloat16``: next-token KL to fp32 over 256 held-out
    tokens of code (measured 1.1e-4 nats over 512 in docs/performance.md), the same next token almost everywhere,
    and its decode equal to its full forward."""
    directory = hybridlm.bundled_model_dir("hybrid")
    fp32 = hybridlm.HybridForCausalLM.from_pretrained(directory).eval()
    bf16 = hybridlm.HybridForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    ids = held_out_ids
    with torch.no_grad():
        reference, full = fp32(ids).logits, bf16(ids).logits
        steps, _ = decoded_token_by_token(bf16, ids[:, :48])
    assert next_token_kl(reference, full) <= 1e-3
    assert (reference.argmax(-1) == full.argmax(-1)).float().mean() >= 0.95
    assert relative_error(steps, full[:, :48]) <= DECODE_REL[torch.bfloat16]
