"""Prefix-cache files under faults: a save killed at any step leaves the old file or the new; a truncated, altered
or structurally edited file, or one another process replaces while it is read, loads exactly or fails naming the
file — it never serves other snapshots."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hybridlm import PrefixCache
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.decoding.prefix_cache_files import DIGEST_KEY, METADATA_KEY, _digest
from hybridlm.files import load_safetensors
from tests.decoding.test_prefix_cache import assert_same_fields, state_fields
from tests.fault_injection import flipped, kill_points, replaced_when_opened, run_killed, truncated
from tests.helpers import random_ids, tiny_model

BLOCK = 8
STACK = dict(layer_pattern="MSA")


@pytest.fixture(scope="module")
def model():
    return tiny_model(**STACK)


def filled(model, prompts: int) -> PrefixCache:
    """A cache holding the blocks of ``prompts`` prompts of three blocks and a tail."""
    cache = PrefixCache(block_size=BLOCK)
    decoder = IncrementalDecoder(model, prefill_chunk_size=BLOCK, prefix_cache=cache)
    for seed in range(prompts):
        decoder.generate(random_ids(1, 3 * BLOCK + 2, seed=seed), max_new_tokens=1)
    return cache


def assert_same_cache(got: PrefixCache, expected: PrefixCache) -> None:
    assert list(got._entries) == list(expected._entries)
    for key, entry in expected._entries.items():
        assert (got._entries[key].blocks, got._entries[key].parent) == (entry.blocks, entry.parent)
        assert_same_fields(state_fields(got._entries[key].snapshot), state_fields(entry.snapshot))


def loads_exactly_or_names_the_file(path, model, expected: PrefixCache) -> bool:
    """True when ``path`` loads as ``expected``; False when the load fails naming ``path``."""
    try:
        loaded = PrefixCache.load(path, model)
    except ValueError as error:
        assert str(path) in str(error), error
        return False
    assert_same_cache(loaded, expected)
    return True


def test_a_save_killed_at_any_step_leaves_the_old_file_or_the_new(model, tmp_path):
    old, new = filled(model, 1), filled(model, 2)
    path = tmp_path / "prefix.safetensors"
    found = set()
    for k in kill_points(new.save, tmp_path / "count.safetensors"):
        old.save(path)
        run_killed(new.save, path, kill_at=k)
        loaded = PrefixCache.load(path, model)
        assert_same_cache(loaded, old if len(loaded) == len(old) else new)
        found.add(len(loaded))
    assert found == {len(old), len(new)}


def test_a_truncated_or_altered_file_is_an_error_naming_it(model, tmp_path):
    """Any flipped bit (tensor bytes, the JSON header, the digest) or a cut is detected: the load never serves
    the changed snapshots."""
    cache, path = filled(model, 1), tmp_path / "prefix.safetensors"
    cache.save(path)
    written = path.read_bytes()
    header = 8 + int.from_bytes(written[:8], "little")
    offsets = sorted({*range(0, header, 97), *range(header, len(written), max(1, (len(written) - header) // 64)),
                      len(written) - 1})
    for offset in offsets:
        path.write_bytes(written)
        flipped(path, offset)
        assert not loads_exactly_or_names_the_file(path, model, cache), offset
    for length in (0, 7, header - 1, header, len(written) // 2, len(written) - 1):
        path.write_bytes(written)
        truncated(path, length)
        assert not loads_exactly_or_names_the_file(path, model, cache), length


def test_a_file_replaced_while_it_is_read_loads_as_it_was_opened(model, tmp_path):
    """Another process saves another model's cache to the path just after this one opens it: the load still
    serves this model's snapshots (or refuses), never the other's tensors under this one's header."""
    mine, theirs = tmp_path / "prefix.safetensors", tmp_path / "theirs.safetensors"
    cache = filled(model, 1)
    filled(tiny_model(seed=1, **STACK), 1).save(theirs)  # same shapes and keys, other weights
    cache.save(mine)
    with replaced_when_opened(mine, theirs):
        assert loads_exactly_or_names_the_file(mine, model, cache)
    with pytest.raises(ValueError, match=f"{mine}: PrefixCache: its snapshots come from another model"):
        PrefixCache.load(mine, model)


def _edited(path, edit) -> None:
    """Rewrite the file after ``edit(header, tensors)``, with a matching digest (as a deliberate edit would)."""
    tensors, metadata = load_safetensors(path.read_bytes(), path)
    header = json.loads(metadata[METADATA_KEY])
    edit(header, tensors)
    text = json.dumps(header)
    save_file(tensors, str(path), metadata={METADATA_KEY: text, DIGEST_KEY: _digest(text, tensors)})


def _drop_ssm(header, tensors):
    del tensors["0.0.ssm"]


def _rename(header, tensors):
    tensors["0.0.ssm_renamed"] = tensors.pop("0.0.ssm")


def _reshape(header, tensors):
    tensors["0.0.ssm"] = tensors["0.0.ssm"][..., :-1].contiguous()


def _retype(header, tensors):
    tensors["0.0.ssm"] = tensors["0.0.ssm"].double()


def _drop_state(header, tensors):
    header["entries"][0]["states"].pop()


def _retype_state(header, tensors):
    header["entries"][0]["states"][0]["type"] = "KVState"


@pytest.mark.parametrize("edit, message", [
    (_drop_ssm, "has no tensor '0.0.ssm'"), (_rename, "has no tensor '0.0.ssm'"),
    (_reshape, "tensor '0.0.ssm' is torch.float32 .* this model's is"), (_retype, "tensor '0.0.ssm' is torch.float64"),
    (_drop_state, "snapshot 0 has 2 states, this model's cache 3"), (_retype_state, "state 0.0 is a KVState"),
])
def test_a_structurally_edited_file_is_refused_before_use(model, tmp_path, edit, message):
    path = tmp_path / "prefix.safetensors"
    filled(model, 1).save(path)
    _edited(path, edit)
    with pytest.raises(ValueError, match=f"{path}:? .*{message}"):
        PrefixCache.load(path, model)


def test_tensors_no_snapshot_uses_are_refused(model, tmp_path):
    path = tmp_path / "prefix.safetensors"
    filled(model, 1).save(path)
    _edited(path, lambda header, tensors: tensors.update(extra=torch.zeros(1)))
    with pytest.raises(ValueError, match=f"{path} holds tensors no snapshot uses: extra"):
        PrefixCache.load(path, model)
