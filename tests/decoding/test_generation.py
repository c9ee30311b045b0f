"""The incremental decoder: chunked prefill, cached decode, sampling, stop tokens, streaming, padding."""

import pytest
import torch

from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.decoding.sampling import SamplingSettings, choose_next
from tests.helpers import assert_close_rel, random_ids, tiny_model

STACK = dict(layer_pattern="MASPL", mlp_types=["moe", "dense", "none", "dense", "moe"])


@pytest.fixture(scope="module")
def model():
    return tiny_model(**STACK)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_prefill_chunk_size_does_not_change_the_result(model, chunk):
    ids = random_ids(2, 10)
    cache, last = IncrementalDecoder(model, prefill_chunk_size=chunk).prefill(ids)
    with torch.no_grad():
        assert_close_rel(last, model(ids).logits[:, -1])
    assert cache.seen == 10


def test_greedy_equals_transformers_generate(model):
    prompts = random_ids(2, 6)
    ours = IncrementalDecoder(model, prefill_chunk_size=4).generate(prompts, max_new_tokens=9)
    theirs = model.generate(prompts, max_new_tokens=9, min_new_tokens=9, do_sample=False)
    assert torch.equal(ours, theirs)


def test_prompts_of_different_lengths_equal_each_alone(model):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9, 9, 9, 1]]
    decoder = IncrementalDecoder(model, prefill_chunk_size=3)
    together = decoder.generate(prompts, max_new_tokens=6)
    for row, prompt in enumerate(prompts):
        alone = decoder.generate([prompt], max_new_tokens=6)
        assert together[row, -6:].tolist() == alone[0, -6:].tolist()


def test_stop_tokens_end_rows_and_pad_them(model):
    prompts = [[5, 6, 7], [3, 4, 2]]
    decoder = IncrementalDecoder(model)
    free = decoder.generate(prompts, max_new_tokens=6)[:, 3:]
    # a stop token of row 1 that row 0 never produces, so that row 0 runs on and row 1 must be padded
    stop = next(token for token in free[1, 1:5].tolist() if token not in free[0].tolist())
    stopped = decoder.generate(prompts, max_new_tokens=6, stop_tokens=[stop], pad_token_id=60)[:, 3:]
    first = (free[1] == stop).nonzero()[0].item()
    assert stopped[1, : first + 1].tolist() == free[1, : first + 1].tolist()
    assert stopped[1, first + 1:].tolist() == [60] * (5 - first)
    row0_stop = (free[0] == stop).nonzero()
    keep = row0_stop[0].item() + 1 if len(row0_stop) else 6
    assert stopped[0, :keep].tolist() == free[0, :keep].tolist()  # dropping row 1 from the cache left row 0 intact


def test_streaming_yields_one_step_at_a_time(model):
    stream = IncrementalDecoder(model).stream([[1, 2, 3]], max_new_tokens=4)
    first = next(stream)
    assert first.shape == (1,)
    rest = list(stream)
    assert len(rest) == 3


def test_seeded_sampling_is_reproducible_and_filters_apply(model):
    decoder = IncrementalDecoder(model)
    kwargs = dict(max_new_tokens=8, do_sample=True, temperature=0.9, top_k=5, top_p=0.9)
    a = decoder.generate([[1, 2, 3]], seed=3, **kwargs)
    assert torch.equal(a, decoder.generate([[1, 2, 3]], seed=3, **kwargs))
    greedy = decoder.generate([[1, 2, 3]], max_new_tokens=8)
    assert torch.equal(decoder.generate([[1, 2, 3]], max_new_tokens=8, do_sample=True, top_k=1, seed=0), greedy)
    assert torch.equal(decoder.generate([[1, 2, 3]], max_new_tokens=8, do_sample=True, top_p=1e-6, seed=0), greedy)


def test_choose_next_filters():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    generator = torch.Generator().manual_seed(0)
    picks = {choose_next(logits, SamplingSettings(do_sample=True, top_k=2), generator).item() for _ in range(200)}
    assert picks == {1, 2}
    nucleus = SamplingSettings(do_sample=True, top_p=0.7)  # p = [.03, .64, .24, .09]: keep tokens 1 and 2
    picks = {choose_next(logits, nucleus, generator).item() for _ in range(200)}
    assert picks == {1, 2}


def test_bad_settings_and_prompts_are_rejected(model):
    decoder = IncrementalDecoder(model)
    with pytest.raises(ValueError, match="top_p"):
        decoder.generate([[1]], top_p=0)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([[1], []])
    with pytest.raises(ValueError, match="limit of 256"):  # linformer_max_length of the tiny config
        decoder.generate([[1] * 250], max_new_tokens=10)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        IncrementalDecoder(model, prefill_chunk_size=0)
