"""One loader: ``hybridlm.load``, ``HybridForCausalLM.from_pretrained`` and transformers' Auto classes read a
checkpoint's ``config.json`` once, and neither of hybridlm's entry points goes through the other."""

import os
import sys

import pytest
import torch
import transformers

import hybridlm
import hybridlm.model.loading
from hybridlm import HybridForCausalLM

from ..helpers import random_ids, tiny_model
from .compare import tiny_transformers_model

_opened: list[str] | None = None  # config.json paths opened while a test collects them


def _count_config_opens(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        if os.path.basename(os.fsdecode(args[0])) == "config.json":
            _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_count_config_opens)  # audit hooks cannot be removed; this one records only inside opens_of()


def opens_of(load, *args, **kwargs) -> tuple[object, int]:
    """``load(*args, **kwargs)`` and how many times it opened a file named config.json."""
    global _opened
    _opened = []
    try:
        return load(*args, **kwargs), len(_opened)
    finally:
        _opened = None


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    model = tiny_model(layer_pattern="SA")
    directory = tmp_path_factory.mktemp("own")
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4, num_heads=4,
                                       head_dim=16, n_groups=1, chunk_size=4)
    hf = tiny_transformers_model(transformers.Mamba2ForCausalLM, config)
    directory = tmp_path_factory.mktemp("foreign")
    hf.save_pretrained(directory)
    return directory, hf


LOADERS = {"hybridlm.load": hybridlm.load, "from_pretrained": HybridForCausalLM.from_pretrained,
           "AutoModelForCausalLM": transformers.AutoModelForCausalLM.from_pretrained}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_own_checkpoint_reads_config_json_once(own, loader):
    directory, model = own
    loaded, opens = opens_of(LOADERS[loader], directory)
    assert opens == 1
    ids = random_ids(model.config.vocab_size, 1, 6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("loader", ["hybridlm.load", "from_pretrained"])
def test_foreign_checkpoint_reads_config_json_once(foreign, loader):
    directory, hf = foreign
    loaded, opens = opens_of(LOADERS[loader], directory)
    assert opens == 1
    ids = random_ids(64, 1, 6)
    with torch.no_grad():
        expected = hf(ids).logits
        assert expected.abs().max() > 0 and torch.allclose(loaded(ids).logits, expected, atol=1e-5)


def test_load_and_from_pretrained_do_not_call_each_other(own, foreign, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("one loader entry point called the other")

    with monkeypatch.context() as patch:
        patch.setattr(HybridForCausalLM, "from_pretrained", forbidden)
        for directory, _ in (own, foreign):
            hybridlm.load(directory)
    monkeypatch.setattr(hybridlm.model.loading, "load", forbidden)
    monkeypatch.setattr(hybridlm, "load", forbidden)
    for directory, _ in (own, foreign):
        HybridForCausalLM.from_pretrained(directory)


def test_config_fields_given_to_from_pretrained_override_the_saved_ones(own):
    directory, model = own
    assert model.config.router_aux_loss_coef != 0.25
    assert HybridForCausalLM.from_pretrained(directory, router_aux_loss_coef=0.25).config.router_aux_loss_coef == 0.25
