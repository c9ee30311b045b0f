"""Bad model inputs are an error naming the argument, raised before any mixer runs (never a crash deep inside
one): empty batch or time, token ids of a type that wraps, embeddings of another dtype, tensors or a cache on
another device, labels that do not fit the logits, float position ids, a negative ``logits_to_keep``."""

import pytest
import torch

from ..helpers import tiny_model

HIDDEN = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model(layer_pattern="SA", hidden_size=HIDDEN)


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)], ids=["no tokens", "no rows"])
def test_empty_input_ids(model, shape):
    with pytest.raises(ValueError, match=r"input_ids must hold at least one row and one token"):
        model(torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("shape", [(1, 0, HIDDEN), (0, 2, HIDDEN)], ids=["no tokens", "no rows"])
def test_empty_inputs_embeds(model, shape):
    with pytest.raises(ValueError, match=r"inputs_embeds must hold at least one row and one token"):
        model(inputs_embeds=torch.zeros(shape))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool, torch.float32])
def test_token_ids_of_a_type_other_than_long_or_int32(model, dtype):
    with pytest.raises(TypeError, match=rf"input_ids must hold integer token ids as torch.long .* got {dtype}"):
        model(torch.tensor([[1, 2, 3]]).to(dtype))


def test_int32_ids_give_the_same_logits_as_long(model):
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = model(ids).logits
        assert expected.abs().max() > 0 and torch.equal(model(ids.int()).logits, expected)


def test_inputs_embeds_of_another_dtype(model):
    with pytest.raises(TypeError, match=r"inputs_embeds is torch.float64 but the model computes in torch.float32"):
        model(inputs_embeds=torch.randn(1, 3, HIDDEN, dtype=torch.float64))


@pytest.mark.parametrize("argument", ["input_ids", "inputs_embeds"])
def test_inputs_on_another_device(model, argument):
    value = torch.ones(1, 2, dtype=torch.long) if argument == "input_ids" else torch.zeros(1, 2, HIDDEN)
    with pytest.raises(ValueError, match=rf"{argument} is on meta but the model on cpu"):
        model(**{argument: value.to("meta")})


@pytest.mark.parametrize("argument", ["input_ids", "inputs_embeds"])
def test_inputs_that_are_not_tensors(model, argument):
    with pytest.raises(TypeError, match=rf"{argument} must be a torch.Tensor, got list"):
        model(**{argument: [[1, 2]] if argument == "input_ids" else [[[0.0] * HIDDEN] * 2]})


@pytest.mark.parametrize("batch_size, max_length", [(0, None), (-1, None), ("2", None), (1, -1), (1, 2.0)])
def test_new_cache_sizes_are_counts(model, batch_size, max_length):
    name = "batch_size" if batch_size != 1 else "max_length"
    with pytest.raises(ValueError, match=rf"new_cache: {name} must be an integer >= \d, got"):
        model.new_cache(batch_size, max_length)


def test_cache_on_another_device(model):
    with pytest.raises(ValueError, match=r"cache is on meta but the model on cpu: move it with cache.to\('cpu'\)"):
        model(torch.tensor([[1, 2]]), cache=model.new_cache(1, device="meta"))


@pytest.mark.parametrize("labels, error, message", [
    (torch.tensor([[1, 2]]), ValueError, r"labels must be \[batch, time\] = \(1, 3\) like the logits, got \(1, 2\)"),
    (torch.tensor([[1.0, 2.0, 3.0]]), TypeError, r"labels must hold integer token ids .* got torch.float32"),
    (torch.tensor([[1, 2, 9999]]), ValueError, r"labels must lie in \[0, vocab_size=\d+\) or be -100"),
    (torch.tensor([[1, -1, 2]]), ValueError, r"labels must lie in .* got values in \[-1, 2\]"),
], ids=["shape", "float", "too large", "negative"])
def test_bad_labels(model, labels, error, message):
    with pytest.raises(error, match=message):
        model(torch.tensor([[1, 2, 3]]), labels=labels)


def test_int32_labels_and_ignored_targets_give_the_long_loss(model):
    ids, labels = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[-100, 2, -100, 4]])
    with torch.no_grad():
        expected = model(ids, labels=labels).loss
        assert expected > 0 and torch.equal(model(ids, labels=labels.int()).loss, expected)


def test_position_ids_of_a_float_type(model):
    """Float positions used to be accepted (rotary tables take them; a Linformer indexing by them would not)."""
    with pytest.raises(TypeError, match=r"position_ids must be torch.long \(or torch.int32\), got torch.float32"):
        model(torch.tensor([[1, 2, 3]]), position_ids=torch.tensor([[0.0, 1.0, 2.0]]))


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_logits_to_keep_must_be_a_count(model, value):
    """-1 used to keep the logits of every position but the first (``hidden[:, 1:]``), silently."""
    with pytest.raises(ValueError, match="logits_to_keep must be an int >= 0"):
        model(torch.tensor([[1, 2, 3]]), logits_to_keep=value)
