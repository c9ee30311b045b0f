"""Paged KV (CachePolicy(page_size=N)): the same logits as the contiguous cache bit for bit, pages shared between
samples of one prompt (bytes by formula), copy-on-write, rollback, and bad input.

Oracles: the contiguous layout (same model, same inputs, the same rows selected); for bytes, the page count of
each row worked out by hand (shared full pages once, each sample's tail pages of its own)."""

import collections
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache import KVState
from hybridlm.cache.kv import PagedKV, RingKV
from tests.helpers import random_ids, tiny_model


def run(model, ids, policy, chunks, mask=None, cache=None):
    """Logits of ``ids`` fed in chunks of the given sizes (then one token at a time), and the cache."""
    cache = cache if cache is not None else model.new_cache(ids.shape[0], policy=policy)
    bounds = [0, *torch.tensor(chunks).cumsum(0).tolist()]
    bounds += list(range(bounds[-1] + 1, ids.shape[1] + 1))
    logits = []
    with torch.no_grad():
        for start, stop in zip(bounds, bounds[1:]):
            part = None if mask is None else mask[:, :stop]
            logits.append(model(ids[:, start:stop], cache=cache, attention_mask=part).logits)
    return torch.cat(logits, 1), cache


def assert_equal_where_real(got, expected, mask):
    real = torch.ones(expected.shape[:2], dtype=torch.bool) if mask is None else mask
    assert expected[real].abs().max() > 0
    assert torch.equal(got[real], expected[real]), (got[real] - expected[real]).abs().max()


@settings(max_examples=8, deadline=None)
@given(page_size=st.sampled_from([1, 3, 4, 5, 16]), first=st.integers(1, 7), second=st.integers(0, 6),
       pattern=st.sampled_from(["A", "MA", "AMA"]), kv_heads=st.sampled_from([1, 2, 4]), padded=st.booleans())
def test_paged_equals_contiguous_bit_for_bit(page_size, first, second, pattern, kv_heads, padded):
    """Prefill in two chunks, then decode; GQA / MQA / MHA; rows of different lengths (left padding)."""
    model = tiny_model(layer_pattern=pattern, num_key_value_heads=kv_heads)
    ids = random_ids(3, 15)
    mask = None
    if padded:
        mask = torch.ones(3, 15, dtype=torch.bool)
        mask[1, :4], mask[2, :first + 2] = False, False  # row 2: its whole first chunk is padding
    chunks = [first] + ([second] if second else [])
    expected, contiguous = run(model, ids, None, chunks, mask)
    got, paged = run(model, ids, CachePolicy(page_size=page_size), chunks, mask)
    assert_equal_where_real(got, expected, mask)
    state = paged.states[pattern.index("A")]
    assert isinstance(state, PagedKV)
    rows = [15 - (0 if mask is None else int((~mask[b]).sum())) for b in range(3)]  # real tokens per row
    assert [len(t) for t in state.tables] == [math.ceil(n / page_size) for n in rows]  # no page for padding


def test_rows_of_different_lengths_hold_no_padding():
    model = tiny_model(layer_pattern="A")
    ids, mask = random_ids(2, 40), torch.ones(2, 40, dtype=torch.bool)
    mask[1, :30] = False  # row 1: 10 real tokens
    _, cache = run(model, ids, CachePolicy(page_size=8), [40], mask)
    state = cache.states[0]
    page = 2 * state.kv_heads * 8 * state.head_dim * 4
    assert state.pages_in_use() == 5 + 2
    assert state.nbytes() == 7 * page + 4 * 7 + 8 * 2
    contiguous = model.new_cache(2)
    run(model, ids, None, [40], mask, cache=contiguous)
    assert contiguous.states[0].nbytes() == 2 * 40 * page // 8 + 16  # the contiguous layout keeps the padding


@pytest.mark.parametrize("page_size", [16, 24])
def test_eight_samples_share_one_copy_of_a_2k_prompt(page_size):
    """One row prefilled with 2,048 tokens, selected 8 times (n samples), each decoding its own 5 tokens: the
    prompt's full pages are held once, each sample holds its tail (the copied partly filled page and beyond);
    logits equal the contiguous cache's after the same select, and the shared pages never change."""
    model = tiny_model(layer_pattern="MA")
    prompt, samples, steps = 2048, 8, 5
    ids = random_ids(1, prompt, seed=3)
    tails = random_ids(samples, steps, seed=4)
    caches = {}
    for name, policy in [("paged", CachePolicy(page_size=page_size)), ("contiguous", None)]:
        cache = model.new_cache(1, policy=policy)
        with torch.no_grad():
            for start in range(0, prompt, 512):  # chunked prefill
                model(ids[:, start:start + 512], cache=cache)
        caches[name] = cache.select(torch.zeros(samples, dtype=torch.long))
    paged, contiguous = caches["paged"], caches["contiguous"]
    state = paged.states[1]
    assert all(state.refs[p] == samples for p in state.tables[0]) and state.tables == [state.tables[0]] * samples
    full = state.tables[0][:prompt // page_size]  # full pages: shared to the end
    before = state.keys[:, full].clone(), state.values[:, full].clone()
    with torch.no_grad():
        for t in range(steps):
            got = model(tails[:, t:t + 1], cache=paged).logits
            expected = model(tails[:, t:t + 1], cache=contiguous).logits
            assert expected.abs().max() > 0 and torch.equal(got, expected)
    assert all(table[:len(full)] == full for table in state.tables)
    assert torch.equal(state.keys[:, full], before[0]) and torch.equal(state.values[:, full], before[1])

    page = 2 * state.kv_heads * page_size * state.head_dim * 4
    pages = prompt // page_size + samples * math.ceil((prompt % page_size + steps) / page_size)
    entries = samples * math.ceil((prompt + steps) / page_size)
    assert state.pages_in_use() == pages
    assert state.nbytes() == pages * page + 4 * entries + 8 * samples
    one_prompt = math.ceil(prompt / page_size) * page
    assert state.nbytes() < one_prompt + samples * 2 * page  # one prompt plus a page or two per sample
    assert contiguous.states[1].nbytes() == samples * (prompt + steps) * page // page_size + 8 * samples
    print(f"page_size={page_size}: paged {state.nbytes():,} B, contiguous {contiguous.states[1].nbytes():,} B")


def test_copy_on_write_leaves_the_shared_page_to_the_last_row():
    state = PagedKV.empty(1, 2, 3, page_size=4)
    keys = torch.randn(1, 2, 6, 3)
    state.update(keys, -keys, torch.arange(6)[None], None, None)  # pages 0 (full) and 1 (2 of 4 slots)
    rows = state.select(torch.tensor([0, 0, 0]))
    assert rows.tables == [[0, 1]] * 3 and rows.refs == [3, 3]
    new = torch.randn(3, 2, 1, 3)
    view = rows.update(new, -new, torch.full((3, 1), 6), None, None)
    assert rows.tables[0][0] == rows.tables[1][0] == rows.tables[2][0] == 0  # the full page stays shared
    assert rows.tables[2][1] == 1 and len({t[1] for t in rows.tables}) == 3  # two copies; the last row keeps it
    assert rows.refs[0] == 3 and all(rows.refs[t[1]] == 1 for t in rows.tables)
    for b in range(3):
        expected = torch.cat([keys[0], new[b]], 1)  # [heads, 7, dim]
        assert torch.equal(view.keys[b], expected) and torch.equal(view.values[b], -expected)
    assert torch.equal(rows.keys[:, 0], keys[0, :, :4])  # the shared full page is untouched
    assert torch.equal(state._gather(6)[0], keys)  # and so is the state the rows were selected from


@settings(max_examples=10, deadline=None)
@given(page_size=st.integers(1, 5), prompt=st.integers(1, 9),
       actions=st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 6)),
                                  st.tuples(st.just("select"), st.lists(st.integers(0, 5), min_size=1, max_size=4)),
                                  st.tuples(st.just("crop"), st.integers(0, 4))), max_size=8))
def test_random_appends_selects_and_crops_keep_every_row_and_the_page_counts(page_size, prompt, actions):
    """Oracle: each row's tokens kept as a list. After every step, each row reads back exactly its tokens, every
    page's reference count is the number of table entries naming it, and free pages are the unreferenced ones."""
    dim, counter = 2, iter(range(1, 10_000))
    paged = PagedKV.empty(1, 1, dim, page_size=page_size)
    rows = [[]]

    def append(count):
        new = torch.tensor([[next(counter) for _ in range(count)] for _ in rows], dtype=torch.float32)
        keys = new[:, None, :, None].expand(-1, 1, -1, dim)  # [b, 1, count, dim]: each token its own number
        paged.update(keys, -keys, torch.zeros(len(rows), count, dtype=torch.long), None, None)
        for row, values in zip(rows, new.tolist()):
            row.extend(values)

    append(prompt)
    for action, arg in actions:
        if action == "append":
            append(arg)
        elif action == "select":
            index = [i % len(rows) for i in arg]
            paged, rows = paged.select(torch.tensor(index)), [list(rows[i]) for i in index]
        elif paged.seen > arg:
            paged.rewind(arg)
            rows = [row[:len(row) - arg] for row in rows]
        keys, values = paged._gather(paged.seen)
        assert keys[:, 0, :, 0].tolist() == rows and torch.equal(values, -keys)
        entries = collections.Counter(page for table in paged.tables for page in table)
        assert paged.refs == [entries[p] for p in range(len(paged.refs))]
        assert sorted(paged.free) == [p for p in range(len(paged.refs)) if not paged.refs[p]]


def test_a_parallel_layer_selects_its_paged_part():
    model = tiny_model(layer_types=["attention+mamba2", "mamba"], num_hidden_layers=2)
    ids = random_ids(2, 9)
    out = []
    for policy in [None, CachePolicy(page_size=2)]:
        cache = model.new_cache(2, policy=policy)
        with torch.no_grad():
            model(ids[:, :6], cache=cache)
            cache = cache.select(torch.tensor([1, 1, 0]))
            out.append(model(ids[[1, 1, 0], 6:], cache=cache).logits)
    assert isinstance(cache.states[0].parts["attention"], PagedKV)
    assert out[0].abs().max() > 0 and torch.equal(out[0], out[1])


def test_beam_search_and_sampling_with_a_paged_cache_equal_the_contiguous_cache():
    model = tiny_model(layer_pattern="AM")
    ids = random_ids(2, 7)
    common = dict(max_new_tokens=6, pad_token_id=0)
    for options in [dict(num_beams=3, do_sample=False, num_return_sequences=2),
                    dict(do_sample=True, num_return_sequences=3)]:
        outputs = []
        for policy in [None, CachePolicy(page_size=3)]:
            torch.manual_seed(0)
            outputs.append(model.generate(ids, cache_policy=policy, **common, **options))
        assert torch.equal(outputs[0], outputs[1]), options


def test_crop_gives_back_pages_and_continues_exactly():
    model = tiny_model(layer_pattern="A")
    ids = random_ids(2, 14)
    paged = model.new_cache(2, policy=CachePolicy(page_size=4))
    with torch.no_grad():
        model(ids[:, :11], cache=paged)
        paged.crop(6)
        state = paged.states[0]
        assert [len(t) for t in state.tables] == [2, 2] and state.pages_in_use() == 4 and len(state.free) >= 2
        got = model(ids[:, 6:14], cache=paged).logits
    contiguous = model.new_cache(2)
    with torch.no_grad():
        model(ids[:, :6], cache=contiguous)
        reference = model(ids[:, 6:14], cache=contiguous).logits
    assert reference.abs().max() > 0 and torch.equal(got, reference)


def test_sliding_window_layers_keep_their_ring():
    model = tiny_model(layer_pattern="AA", sliding_window=4, num_hidden_layers=2)
    cache = model.new_cache(1, policy=CachePolicy(page_size=4))
    assert all(isinstance(s, RingKV) for s in cache.states)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_page_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="page_size"):
        CachePolicy(page_size=bad)
    with pytest.raises(ValueError, match="page_size"):
        PagedKV.empty(1, 1, 4, page_size=bad)


@pytest.mark.parametrize("others", [dict(kv_bits=4), dict(window=8), dict(sink_tokens=2, window=8),
                                    dict(heavy_hitters=2, window=4)])
def test_paging_with_quantization_or_bounded_windows_is_refused(others):
    with pytest.raises(ValueError, match="page_size=4 with kv_bits / window / sink_tokens / heavy_hitters"):
        CachePolicy(page_size=4, **others)


def test_a_default_policy_keeps_the_contiguous_layout():
    model = tiny_model(layer_pattern="A")
    assert isinstance(model.new_cache(1, policy=CachePolicy()).states[0], KVState)
    assert not CachePolicy(page_size=4).is_default


def test_cli_generate_takes_a_page_size(capsys, tmp_path):
    from hybridlm.cli import main

    tiny_model(layer_pattern="AM").save_pretrained(tmp_path)
    outputs = []
    for extra in [[], ["--page-size", "2"]]:
        main(["generate", "--model", str(tmp_path), "--ids", "3,4,5", "--max-new-tokens", "6", *extra])
        outputs.append(capsys.readouterr().out.split())
    assert len(outputs[0]) == 6 and outputs[0] == outputs[1]
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--ids", "3", "--page-size", "0"])
    assert "--page-size: must be >= 1, got 0" in capsys.readouterr().err  # the parser names the option


@pytest.mark.filterwarnings("ignore")
def test_greedy_speculative_decoding_on_a_paged_cache_equals_greedy(monkeypatch):
    """transformers' assisted generation crops the cache after each verification: a paged cache gives back its
    rejected pages and the output is plain greedy's."""
    rewound = []
    rewind = PagedKV.rewind
    monkeypatch.setattr(PagedKV, "rewind", lambda self, tokens: rewound.append(tokens) or rewind(self, tokens))
    model = tiny_model(layer_pattern="AM")
    ids = random_ids(1, 12)
    plain = model.generate(ids, max_new_tokens=10, do_sample=False)
    for options in [dict(prompt_lookup_num_tokens=3), dict(assistant_model=tiny_model(seed=1, layer_pattern="A"))]:
        cache = model.new_cache(1, policy=CachePolicy(page_size=4))
        out = model.generate(ids, max_new_tokens=10, do_sample=False, cache=cache, **options)
        assert isinstance(cache.states[0], PagedKV) and torch.equal(out, plain), options
        assert any(rewound), options  # some draft tokens were rejected and cropped
        rewound.clear()
