"""Mamba-3 inside a model: a 1:3 attention:Mamba-3 stack (SISO and MIMO) packs documents, rolls back, continues
after a prefix-cache hit, generates a left-padded batch as each prompt alone, and counts its state in the memory
report."""

import pytest
import torch

from hybridlm import PrefixCache
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.model.memory import memory_rows
from tests.cache.test_rollback import check_rollback
from tests.decoding.test_prefix_cache import BLOCK, assert_same_fields, prefill_counts, prompt, state_fields
from tests.helpers import assert_close_rel, random_ids, tiny_config, tiny_model
from tests.mixers.test_mixers import expected_nbytes
from tests.model.test_packing import assert_same_gradients, gradients, packed_batch, per_document_gradients

STACKS = {"siso": dict(layer_pattern="RARR"),
          "mimo": dict(layer_pattern="RARR", mamba3_mimo=True, mamba3_mimo_rank=2, mamba3_outproj_norm=True)}


@pytest.mark.parametrize("stack", list(STACKS))
def test_packed_documents_equal_each_alone(stack):
    """Logits in fp32 and gradients in float64: each document of a packed row as if it ran alone."""
    model = tiny_model(1, **STACKS[stack])
    ids, positions, documents = packed_batch([[5, 1, 7], [13]], seed=3)
    with torch.no_grad():
        alone = torch.cat([torch.cat([model(doc).logits for doc in row], dim=1) for row in documents])
        assert_close_rel(model(ids, position_ids=positions).logits, alone)
    model.double()
    probe = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(4),
                        dtype=torch.float64)
    expected = per_document_gradients(model, documents, probe)
    model.zero_grad()
    (model(ids, position_ids=positions).logits * probe).sum().backward()
    assert_same_gradients(gradients(model), expected)


@pytest.mark.parametrize("stack", list(STACKS))
def test_crop_equals_a_forward_that_stopped_there(stack):
    model = tiny_model(2, **STACKS[stack])
    mask = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    check_rollback(model, random_ids(2, 5), random_ids(2, 4, seed=1), random_ids(2, 2, seed=2), mask)


def test_a_continuation_after_a_prefix_hit_equals_a_cold_prefill():
    model = tiny_model(**STACKS["mimo"])
    shared = prompt(2 * BLOCK, seed=1)
    first, second = (torch.cat([shared, prompt(n, seed=s)], dim=1) for n, s in ((3, 2), (5, 3)))
    cold = IncrementalDecoder(model, prefill_chunk_size=BLOCK)
    cached = IncrementalDecoder(model, prefill_chunk_size=BLOCK, prefix_cache=PrefixCache(block_size=BLOCK,
                                                                                        max_bytes=10**8))
    cached.generate(first, max_new_tokens=3)
    cold_cache, cold_logits = cold.prefill(second, reserve=3)
    hit_cache, hit_logits = cached.prefill(second, reserve=3)
    assert prefill_counts(cached) == {"prefix_hit_tokens": 2 * BLOCK, "prefill_tokens": 5}
    assert_same_fields(state_fields(hit_cache), state_fields(cold_cache))
    assert cold_logits.abs().max() > 0 and torch.equal(hit_logits, cold_logits)
    assert torch.equal(cached.generate(second, max_new_tokens=5), cold.generate(second, max_new_tokens=5))


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_left_padded_batch_generates_what_each_prompt_generates_alone(stack):
    model = tiny_model(5, **STACKS[stack])
    prompts = [random_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    decoder = IncrementalDecoder(model, prefill_chunk_size=4)
    together = decoder.generate(prompts, max_new_tokens=6)
    for i, ids in enumerate(prompts):
        alone = decoder.generate([ids], max_new_tokens=6)
        assert together[i, -6:].tolist() == alone[0, -6:].tolist()


def test_the_memory_report_counts_the_state():
    config = tiny_config(**STACKS["mimo"])
    (row,) = memory_rows(config, [100], batch=2)
    assert row["by_kind"]["mamba3"] == 3 * expected_nbytes("mamba3", config, 2, 100, element=2)
    assert row["bytes_per_token_by_kind"].keys() == {"attention"}
