"""The quality helpers of hybridlm.training.policy_quality against independent formulas, on a tiny model."""

import math

import torch
import torch.nn.functional as F

from hybridlm import CachePolicy
from hybridlm.training.policy_quality import kl_by_bits, perplexity_by_policy
from tests.helpers import random_ids, tiny_model


def test_perplexity_of_the_full_cache_is_that_of_one_parallel_forward():
    model = tiny_model(layer_pattern="AM").double()
    ids = random_ids(1, 40)
    with torch.no_grad():
        nll = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
    expected = [math.exp(nll[s:s + 16].mean().item()) for s in range(0, 39, 16)]
    result = perplexity_by_policy(model, ids, {"full": None, "window": CachePolicy(window=16)}, segment=16)
    assert len(result["full"]) == 3 and all(value > 1 for value in expected)
    assert all(math.isclose(got, want, rel_tol=1e-9) for got, want in zip(result["full"], expected))
    assert math.isclose(result["window"][0], expected[0], rel_tol=1e-9)  # within the window: the same tokens
    assert not math.isclose(result["window"][-1], expected[-1], rel_tol=1e-6)  # past it: fewer tokens seen


def test_kl_is_zero_while_the_residual_covers_the_context_and_grows_with_fewer_bits():
    model = tiny_model(layer_pattern="AM").double()
    ids = random_ids(1, 48)
    assert kl_by_bits(model, ids, prefill=24, bits=(2,), kv_group_size=4, kv_residual=48) == {2: 0.0}
    kl = kl_by_bits(model, ids, prefill=24, kv_group_size=4, kv_residual=4)
    assert 0 < kl[8] < kl[4] < kl[2]
