"""A verification block (2 to 64 tokens on a warm cache) reads, token by token, what its own decode step would
read (hybridlm.cache.kv.stepwise): under every cache policy its logits equal decoding the block one token at a time,
which is what makes greedy speculative decoding exactly greedy decoding. Control: for the layouts whose reading
changes as the cache moves on (quantized KV, attention sinks), a block read the plain way differs."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache.kv import layouts, quantize, quantized_window
from hybridlm.cache.kv.stepwise import is_verification_block
from tests.cache.test_rollback import assert_same_cache, check_rollback, run
from tests.helpers import assert_close_rel, random_ids, relative_error, tiny_model

POLICIES = {
    "full": ({}, None),
    "ring": (dict(sliding_window=4), None),
    "window": ({}, CachePolicy(window=4)),
    "sinks+window": ({}, CachePolicy(sink_tokens=2, window=4)),
    "quantized": ({}, CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2)),
    "quantized sinks+window": ({}, CachePolicy(kv_bits=4, kv_group_size=4, kv_residual=2, sink_tokens=2, window=8)),
    "paged": ({}, CachePolicy(page_size=4)),
}
READ_AS_STEPS = {"sinks+window", "quantized", "quantized sinks+window"}  # a plain multi-token reading differs


@torch.no_grad()
def block_and_steps(model, policy, prompt, block, mask):
    """Logits of ``block`` in one forward and one token at a time, each after the same (left-padded) prefill."""
    cache = model.new_cache(prompt.shape[0], policy=policy)
    model(prompt, cache=cache, attention_mask=mask)
    stepped = cache.snapshot()
    in_one = model(block, cache=cache).logits
    steps = torch.cat([model(block[:, i : i + 1], cache=stepped).logits for i in range(block.shape[1])], 1)
    return in_one, steps


@pytest.mark.parametrize("name", POLICIES)
def test_a_verification_block_reads_what_its_decode_steps_read(name, monkeypatch):
    overrides, policy = POLICIES[name]
    model = tiny_model(layer_pattern="AMA", **overrides)
    prompt, block = random_ids(2, 11), random_ids(2, 8, seed=1)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, :2] = False
    in_one, steps = block_and_steps(model, policy, prompt, block, mask)
    assert_close_rel(in_one, steps)
    if name in READ_AS_STEPS:
        for module in (layouts, quantize, quantized_window):
            monkeypatch.setattr(module, "is_verification_block", lambda first, time: False)
        plain, _ = block_and_steps(model, policy, prompt, block, mask)
        assert relative_error(plain, steps) > 1e-3


def test_which_forwards_are_verification_blocks():
    assert is_verification_block(5, 2) and is_verification_block(5, 64)
    assert not is_verification_block(0, 8)  # a prefill reads its own tokens in full precision (KIVI)
    assert not is_verification_block(5, 1) and not is_verification_block(5, 65)


def random_policy(kind, bits, group, residual, sinks, window):
    quantized = dict(kv_bits=bits, kv_group_size=group, kv_residual=residual)
    return {"ring": None, "quantized": CachePolicy(**quantized),
            "sinks+window": CachePolicy(sink_tokens=sinks, window=window),
            "quantized sinks+window": CachePolicy(**quantized, sink_tokens=sinks, window=window)}[kind]


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["ring", "quantized", "sinks+window", "quantized sinks+window"]),
       bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([2, 4]), residual=st.integers(0, 6),
       sinks=st.integers(0, 3), window=st.integers(3, 9), warm=st.integers(1, 14), k=st.integers(2, 9),
       padding=st.integers(0, 4), seed=st.integers(0, 99))
def test_random_policies_crop_exactly_and_read_blocks_as_steps(kind, bits, group, residual, sinks, window, warm, k,
                                                               padding, seed):
    """Random policy parameters (a sliding-window layer's ring too), lengths and left padding: cropping to each
    token of a verified block equals a forward that stopped there (tests/cache/test_rollback.py's check), and the
    block's logits equal its decode steps'."""
    policy = random_policy(kind, bits, group, residual, sinks, window)
    model = tiny_model(seed, layer_pattern="AM", **({"sliding_window": window} if kind == "ring" else {}))
    prompt, block = random_ids(2, warm, seed=seed), random_ids(2, k, seed=seed + 1)
    mask = torch.ones(2, warm, dtype=torch.bool)
    mask[0, : min(padding, warm - 1)] = False
    check_rollback(model, prompt, block, random_ids(2, 2, seed=seed + 2), mask, policy=policy)
    in_one, steps = block_and_steps(model, policy, prompt, block, mask)
    assert_close_rel(in_one, steps)


@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(["quantized", "sinks+window", "quantized sinks+window"]), bits=st.sampled_from([2, 4, 8]),
       group=st.sampled_from([2, 4]), residual=st.integers(0, 6), sinks=st.integers(0, 3), window=st.integers(3, 9),
       keep=st.integers(1, 6), seed=st.integers(0, 99),
       ops=st.lists(st.tuples(st.sampled_from(["step", "block", "crop"]), st.integers(1, 6)), min_size=1, max_size=8))
@example(kind="quantized", bits=2, group=2, residual=0, sinks=0, window=3, keep=5, seed=0,
         ops=[("step", 1), ("step", 1), ("step", 1), ("crop", 3)])  # more kept than one group's worth
def test_random_decoding_and_crops_with_kept_checkpoints(kind, bits, group, residual, sinks, window, keep, seed, ops):
    """A draft model's life under ``keep_checkpoints(keep)``: one-token steps, blocks and crops in any order. A crop
    of at most what the kept checkpoints cover (``keep`` slots, less what earlier crops used) is allowed, and every
    allowed crop equals a cache that was fed only the tokens kept."""
    policy = random_policy(kind, bits, group, residual, sinks, window)
    model = tiny_model(seed, layer_pattern="A")
    ids = random_ids(1, 64, seed=seed)
    cache, seen, budget = model.new_cache(1, policy=policy), 5, 0
    run(model, ids[:, :seen], cache)
    cache.keep_checkpoints(keep)
    for op, n in ops:
        if op == "crop":
            back = min(n, seen - 1)
            reason = cache.states[0].rewind_blocker(back)
            assert reason is None or back > budget, reason
            if reason is None:
                cache.crop(seen - back)
                seen, budget = seen - back, max(0, budget - back)
                reference = model.new_cache(1, policy=policy)
                run(model, ids[:, :seen], reference)
                assert_same_cache(cache, reference)
            continue
        time = 1 if op == "step" else n + 1
        for start in range(seen, seen + time, 1 if op == "step" else time):
            run(model, ids[:, start : start + (1 if op == "step" else time)], cache)
        seen, budget = seen + time, min(keep, budget + time)
