"""Packed documents (padding-free batches): every document of a packed row gets the logits and the gradients it
gets alone, for any stack; transformers' DataCollatorWithFlattening output works as is."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

from hybridlm.mixers import MIXERS
from tests.helpers import assert_close_rel, random_ids, relative_error, tiny_model

KINDS = sorted(MIXERS)
LAYERS = st.tuples(
    st.sampled_from([*KINDS, "none"]) | st.lists(st.sampled_from(KINDS), min_size=2, max_size=2, unique=True)
    .map("+".join),
    st.sampled_from(["dense", "moe", "none"]),
).filter(lambda layer: layer != ("none", "none"))


def rows_of_documents(total: int, cuts_per_row: list[list[int]]) -> list[list[int]]:
    """Document lengths of each row: ``total`` tokens cut at the given places."""
    rows = []
    for cuts in cuts_per_row:
        bounds = [0, *sorted({c for c in cuts if 0 < c < total}), total]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    return rows


def packed_batch(rows: list[list[int]], seed: int):
    """``ids [rows, total]``, restarting ``position_ids`` and each document's ids."""
    documents = [[random_ids(1, n, seed=seed + 31 * r + i) for i, n in enumerate(row)] for r, row in enumerate(rows)]
    ids = torch.cat([torch.cat(row, dim=1) for row in documents])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    return ids, positions, documents


def per_document_gradients(model, documents, probe):
    """The gradients of ``sum(logits * probe)`` with every document run alone (``probe`` laid out as the packed
    batch)."""
    model.zero_grad()
    for r, row in enumerate(documents):
        start = 0
        for doc in row:
            (model(doc).logits * probe[r:r + 1, start:start + doc.shape[1]]).sum().backward()
            start += doc.shape[1]
    return gradients(model)


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(got, expected):
    """Each parameter's gradient within 1e-5 of its reference; where the reference is exactly zero (attention's
    q/k projections with one-token documents), within float64 rounding of the largest gradient."""
    assert set(got) == set(expected)
    scale = max(g.abs().max() for g in expected.values())
    assert scale > 0
    for name in expected:
        if expected[name].abs().max() == 0:
            assert got[name].abs().max() <= 1e-12 * scale, name
        else:
            assert_close_rel(got[name], expected[name], 1e-5)


@settings(max_examples=12)
@given(stack=st.lists(LAYERS, min_size=1, max_size=3), total=st.integers(2, 20),
       cuts=st.lists(st.lists(st.integers(1, 19), max_size=3), min_size=1, max_size=2), seed=st.integers(0, 500))
def test_packed_rows_equal_each_document_alone(stack, total, cuts, seed):
    """Logits in float32; gradients in float64, where summing a parameter's gradient over rows in another order
    cannot hide behind float32 rounding (a Performer's q_proj gradient cancels to ~1e-5 of its terms)."""
    model = tiny_model(seed % 5, layer_types=[m for m, _ in stack], mlp_types=[f for _, f in stack])
    rows = rows_of_documents(total, cuts)
    ids, positions, documents = packed_batch(rows, seed)
    with torch.no_grad():
        alone = torch.cat([torch.cat([model(doc).logits for doc in row], dim=1) for row in documents])
        assert_close_rel(model(ids, position_ids=positions).logits, alone)
        if any(len(row) > 1 for row in rows) and any(m != "none" for m, _ in stack):
            # the comparison can fail: the same rows read as one document each differ
            assert relative_error(model(ids).logits, alone) > 1e-4

    model.double()
    probe = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64)
    alone_grads = per_document_gradients(model, documents, probe)
    model.zero_grad()
    (model(ids, position_ids=positions).logits * probe).sum().backward()
    assert_same_gradients(gradients(model), alone_grads)


def test_shared_blocks_see_their_own_document_only():
    model = tiny_model(1, layer_pattern="MSA", shared_block_layers=[0, 2], shared_block_adapter_rank=4)
    ids, positions, documents = packed_batch([[6, 1, 9]], seed=3)
    with torch.no_grad():
        alone = torch.cat([model(doc).logits for doc in documents[0]], dim=1)
        assert_close_rel(model(ids, position_ids=positions).logits, alone)


def collated(lengths, seed=0, **options):
    features = [{"input_ids": random_ids(1, n, seed=seed + i)[0].tolist()} for i, n in enumerate(lengths)]
    return DataCollatorWithFlattening(**options)(features), [torch.tensor([f["input_ids"]]) for f in features]


@pytest.mark.parametrize("options", [
    {},
    {"return_flash_attn_kwargs": True},
    {"return_seq_idx": True},
    {"return_flash_attn_kwargs": True, "return_seq_idx": True, "return_position_ids": False},
])
def test_data_collator_with_flattening(options):
    """``model(**batch)`` of the collator's output: per-document logits, and the loss of the documents' own
    next-token predictions (the collator's -100 at each document start keeps predictions from crossing)."""
    model = tiny_model(2, layer_pattern="MSAP", mlp_types=["dense", "moe", "dense", "none"])
    batch, documents = collated([4, 7, 1, 5], **options)
    assert options.get("return_position_ids", True) == ("position_ids" in batch)
    with torch.no_grad():
        out = model(**batch)
        alone = [model(doc).logits for doc in documents]
    assert_close_rel(out.logits, torch.cat(alone, dim=1))
    nll = sum(torch.nn.functional.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
              for logits, doc in zip(alone, documents))
    targets = sum(doc.shape[1] - 1 for doc in documents)
    language_loss = out.loss - model.config.router_aux_loss_coef * out.aux_loss
    assert_close_rel(language_loss, nll / targets)


def test_explicit_boundaries_without_position_ids_count_positions_per_document():
    model = tiny_model(4, layer_pattern="AL")  # RoPE and Linformer's position-indexed projections
    ids, _, documents = packed_batch([[5, 8, 3]], seed=9)
    with torch.no_grad():
        alone = torch.cat([model(doc).logits for doc in documents[0]], dim=1)
        assert_close_rel(model(ids, cu_seqlens=torch.tensor([0, 5, 13, 16])).logits, alone)


def test_unpacked_rows_take_the_ordinary_path():
    model = tiny_model(0, layer_pattern="AS")
    ids = random_ids(2, 9)
    with torch.no_grad():
        plain = model(ids).logits
        assert torch.equal(model(ids, position_ids=torch.arange(9)[None]).logits, plain)
        assert torch.equal(model(ids, seq_idx=torch.zeros(2, 9, dtype=torch.int32)).logits, plain)


@pytest.mark.parametrize(("extra", "message"), [
    (dict(use_cache=True), "cannot use a cache"),
    (dict(seq_idx=torch.tensor([[0] * 4 + [1] * 6])), "describe different packed documents"),
    (dict(cu_seq_lens_q=torch.tensor([0, 3, 10]), cu_seq_lens_k=torch.tensor([0, 5, 10])), "differ"),
    (dict(cu_seqlens=torch.tensor([0, 3, 9])), "cu_seqlens must rise"),
    (dict(seq_idx=torch.tensor([[0] * 3 + [2] * 7])), "without gaps"),
])
def test_bad_packing_is_named(extra, message):
    model = tiny_model(0, layer_pattern="AS")
    ids, positions = random_ids(1, 10), torch.cat([torch.arange(3), torch.arange(7)])[None]
    with pytest.raises(ValueError, match=message):
        model(ids, position_ids=positions, **extra)


def test_packing_with_a_padding_mask_is_refused():
    model = tiny_model(0, layer_pattern="AS")
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="no padding attention_mask"):
        model(random_ids(1, 10), attention_mask=mask, cu_seqlens=torch.tensor([0, 3, 10]))


def test_performer_stabiliser_restarts_at_each_document():
    """A document of moderate keys followed by one of huge keys (log-features near -3e4): carried over, the first
    document's running maximum would scale the second's features to exp(-3e4) = 0, and its output to 0."""
    from hybridlm.mixers.segments import Segments

    performer = tiny_model(0, layer_pattern="P").model.layers[0].mixer
    torch.manual_seed(0)
    quiet, loud = 0.05 * torch.randn(1, 5, 32), 3000 * torch.randn(1, 6, 32)
    segments = Segments.from_cu_seqlens(torch.tensor([0, 5, 11]), 1, 11)
    with torch.no_grad():
        packed = performer(torch.cat([quiet, loud], dim=1), segments=segments)
        assert_close_rel(packed[:, :5], performer(quiet))
        assert_close_rel(packed[:, 5:], performer(loud))


def test_a_kind_without_segments_runs_once_per_document():
    """mix() for a mixer whose forward takes no ``segments`` (a user's kind): each document in its own call."""
    from hybridlm.mixers.segments import Segments, mix, takes_segments

    mamba = tiny_model(0, layer_pattern="M").model.layers[0].mixer

    class Unpacked(torch.nn.Module):
        def forward(self, x, state=None, *, mask=None, positions=None):
            return mamba(x, state, mask=mask, positions=positions)

    assert not takes_segments(Unpacked) and takes_segments(type(mamba))
    x = torch.randn(2, 7, 32)
    segments = Segments.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 0]]))
    with torch.no_grad():
        alone = torch.cat([mamba(x[r:r + 1, a:b]) for r, cuts in ((0, (0, 3, 5, 7)), (1, (0, 6, 7)))
                           for a, b in zip(cuts, cuts[1:])], dim=1).view(2, 7, 32)
        assert_close_rel(mix(Unpacked(), x, positions=segments.positions(), segments=segments), alone)
        assert_close_rel(mix(mamba, x, positions=segments.positions(), segments=segments), alone)
