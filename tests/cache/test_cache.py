"""HybridCache: sizes by kind, the 1:7 stack's KV saving, row selection, snapshots, devices, model checks."""

import pytest
import torch

from tests.helpers import assert_close_rel, random_ids, tiny_model
from tests.mixers.test_mixers import expected_nbytes

PATTERN = "AMSPL"


def filled(model, batch=2, length=9):
    cache = model.new_cache(batch)
    with torch.no_grad():
        model(random_ids(batch, length), cache=cache)
    return cache


def test_nbytes_by_kind_follows_the_formulas():
    model = tiny_model(layer_pattern=PATTERN)
    cache = filled(model, batch=2, length=9)
    by_kind = cache.nbytes_by_kind()
    for kind in ("attention", "mamba", "mamba2", "performer", "linformer"):
        assert by_kind[kind] == expected_nbytes(kind, model.config, 2, 9)
    assert cache.nbytes() == sum(by_kind.values()) + 2 * 8  # + the per-row position counters


def test_one_in_eight_attention_holds_an_eighth_of_the_kv_bytes():
    hybrid = tiny_model(layer_pattern="MMMAMMMM")
    attention = tiny_model(layer_pattern="AAAAAAAA")
    for context in (16, 40):
        kv_hybrid = filled(hybrid, 1, context).nbytes_by_kind()["attention"]
        kv_attention = filled(attention, 1, context).nbytes_by_kind()["attention"]
        assert kv_hybrid * 8 == kv_attention


def test_preallocated_cache_reports_used_and_reserved():
    model = tiny_model(layer_pattern="AM")
    cache = model.new_cache(1, max_length=32)
    with torch.no_grad():
        model(random_ids(1, 5), cache=cache)
    kv_used = expected_nbytes("attention", model.config, 1, 5)
    kv_reserved = expected_nbytes("attention", model.config, 1, 32)
    assert cache.reserved_nbytes() - cache.nbytes() == kv_reserved - kv_used


def test_reorder_and_select_rows():
    model = tiny_model(layer_pattern=PATTERN)
    ids = random_ids(3, 8)
    cache = model.new_cache(3)
    with torch.no_grad():
        model(ids, cache=cache)
        order = torch.tensor([2, 2, 0])
        picked = cache.select(order)
        step = random_ids(3, 1, seed=1)
        expected = model(torch.cat([ids[order], step], 1)).logits[:, -1]
        assert_close_rel(model(step, cache=picked).logits[:, -1], expected)
        cache.reorder_cache(order)
        assert_close_rel(model(step, cache=cache).logits[:, -1], expected)


def test_snapshot_and_restore():
    """A prompt's state, snapshotted once, serves several continuations."""
    model = tiny_model(layer_pattern=PATTERN)
    prompt = random_ids(1, 6)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(prompt, cache=cache)
        snapshot = cache.snapshot()
        for seed in (1, 2):
            cache.restore(snapshot)
            cont = random_ids(1, 3, seed=seed)
            got = model(cont, cache=cache).logits
            assert_close_rel(got, model(torch.cat([prompt, cont], 1)).logits[:, -3:])
    assert snapshot.seen == 6


def test_restore_rejects_a_foreign_snapshot():
    cache = tiny_model(layer_pattern="AM").new_cache(1)
    other = tiny_model(layer_pattern="MA").new_cache(1)
    with pytest.raises(ValueError, match="different model"):
        cache.restore(other)


def test_to_device_round_trip():
    model = tiny_model(layer_pattern=PATTERN)
    cache = filled(model, 1, 4)
    moved = cache.to("meta")
    assert all(t.device.type == "meta" for s in moved.states for t in s._tensors().values())
    back = cache.to("cpu")
    assert back.nbytes() == cache.nbytes() and back.seen == cache.seen


def test_cache_from_another_model_or_batch_is_rejected():
    model = tiny_model(layer_pattern="AM")
    other = tiny_model(layer_pattern="AS")
    with pytest.raises(ValueError, match="different model"):
        model(random_ids(1, 3), cache=other.new_cache(1))
    with pytest.raises(ValueError, match="batch size"):
        model(random_ids(2, 3), cache=model.new_cache(1))
    with pytest.raises(TypeError, match="HybridCache"):
        model(random_ids(1, 3), cache=object())
