"""Checks shared by every format test: a tiny transformers model against the same weights loaded by hybridlm,
and a hybridlm model exported to a foreign format against transformers' reading of it.

Typical use::

    tiny_jamba = tiny_model_maker(transformers.JambaForCausalLM, transformers.JambaConfig, vocab_size=256, ...)
    jamba = checkpoint_fixture("jamba", tiny_jamba)  # module-scoped: (hf, ours, directory)

    def test_jamba_runs_like_transformers(jamba):
        hf, ours, _ = jamba
        check_all(hf, ours, vocab_size=256)
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

import hybridlm

LOGITS_ATOL = 1e-4


def save_and_load(hf_model, directory) -> hybridlm.HybridForCausalLM:
    """``save_pretrained`` with transformers, load with hybridlm (through the public entry point)."""
    hf_model.save_pretrained(directory)
    return hybridlm.HybridForCausalLM.from_pretrained(directory).eval()


@torch.no_grad()
def randomize(model, seed: int = 0, scale: float = 0.1):
    """Add N(0, scale²) noise to every parameter in place, so that none keeps a constant initial value (norm
    weights of one, dt biases of one, ...) that would hide a mapping error. Returns ``model``."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    return model


def tiny_transformers_model(model_class, config, randomizer=randomize):
    """``model_class(config)`` built with seed 0, every parameter randomised (by ``randomizer``, default
    :func:`randomize`), in eval mode."""
    torch.manual_seed(0)
    return randomizer(model_class(config).eval())


def tiny_model_maker(model_class, config_class, randomizer=randomize, **settings):
    """A function ``make(**overrides)``: :func:`tiny_transformers_model` of ``config_class(**settings)`` with
    ``overrides`` replacing or adding settings."""

    def make(**overrides):
        return tiny_transformers_model(model_class, config_class(**{**settings, **overrides}), randomizer)

    return make


def checkpoint_fixture(name: str, make):
    """A module-scoped fixture called ``name``: ``(hf, ours, directory)``, the model ``make()`` builds, saved by
    transformers in ``directory`` and loaded by hybridlm."""

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        hf = make()
        directory = tmp_path_factory.mktemp(name)
        return hf, save_and_load(hf, directory), directory

    return fixture


def check_settings_refused(directory, target, match: str, **config_changes) -> None:
    """Loading a copy (at ``target``) of the checkpoint in ``directory`` whose ``config.json`` has
    ``config_changes`` fails with an error matching ``match``."""
    shutil.copytree(directory, target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        hybridlm.HybridForCausalLM.from_pretrained(target)


#: A one-layer vision tower for the multimodal checkpoints whose language model hybridlm reads.
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
                   temporal_patch_size=1, spatial_merge_size=1)


def multimodal_checkpoint(model_class, config_class, text_config: dict, directory):
    """``(hf, ours)``: a tiny multimodal transformers model (text ``text_config``, :data:`TINY_VISION`) and its
    language model as hybridlm loads it from ``directory``."""
    hf = tiny_transformers_model(model_class, config_class(text_config=text_config, vision_config=TINY_VISION))
    return hf, save_and_load(hf, directory)


def random_ids(vocab_size: int, batch: int, length: int, seed: int = 0, low: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size, (batch, length), generator=generator)


@torch.no_grad()
def check_logits(hf_model, ours, ids: torch.Tensor, atol: float = LOGITS_ATOL) -> float:
    expected = hf_model(ids).logits.float()
    assert expected.abs().max() > 0, "the reference logits are all zero: the comparison would prove nothing"
    got = ours(ids).logits.float()
    diff = (expected - got).abs().max().item()
    assert diff <= atol, f"max |logits difference| {diff:.3g} > {atol}"
    return diff


@torch.no_grad()
def check_greedy(hf_model, ours, prompt: torch.Tensor, new_tokens: int = 16) -> None:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    expected = hf_model.generate(prompt, **kwargs)
    got = ours.generate(prompt, **kwargs)
    assert torch.equal(expected, got), f"greedy tokens differ:\n{expected}\n{got}"


@torch.no_grad()
def check_left_padding(ours, vocab_size: int, lengths=(3, 9, 6), new_tokens: int = 8) -> None:
    """A left-padded batch generates what each prompt generates alone."""
    prompts = [random_ids(vocab_size, 1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, prompt in enumerate(prompts):
        batch[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    together = ours.generate(batch, attention_mask=mask, **kwargs)[:, width:]
    for row, prompt in enumerate(prompts):
        alone = ours.generate(prompt[None], **kwargs)[0, len(prompt):]
        assert torch.equal(together[row], alone), f"row {row}: padded batch {together[row]} vs alone {alone}"


@torch.no_grad()
def check_continuation(ours, ids: torch.Tensor, splits=(5, 1, 4), rel: float = 1e-5) -> None:
    """Chunked prefill (chunk lengths ``splits``) then token-by-token decode equals one full forward."""
    full = ours(ids).logits
    cache = ours.new_cache(ids.shape[0])
    pieces, start = [], 0
    for size in list(splits) + [1] * ids.shape[1]:
        if start >= ids.shape[1]:
            break
        pieces.append(ours(ids[:, start:start + size], cache=cache).logits)
        start += size
    steps = torch.cat(pieces, dim=1)
    err = ((steps - full).abs().max() / full.abs().max()).item()
    assert err <= rel, f"cache continuation differs from the full forward: relative error {err:.3g}"


def check_export_round_trip(ours, source_directory, out_directory, model_type: str, hf_class, vocab_size: int,
                            length: int = 19) -> None:
    """hybridlm -> ``model_type`` -> transformers: the exact tensors under the names transformers saved in
    ``source_directory``, and transformers reloads the export as ``hf_class`` with the same logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ours.save_pretrained(out_directory, format=model_type)
    original = load_file(source_directory / "model.safetensors")
    exported = load_file(out_directory / "model.safetensors")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[name], exported[name]) for name in original)
    back = AutoModelForCausalLM.from_pretrained(out_directory).eval()
    assert isinstance(back, hf_class)
    check_logits(back, ours, random_ids(vocab_size, 2, length))


def check_all(hf_model, ours, vocab_size: int, length: int = 13, float64_continuation: bool = False) -> None:
    """Logits (batch of two, length not a multiple of any chunk size), greedy decoding, padding, continuation.
    ``float64_continuation``: the continuation is checked on a float64 copy of ``ours`` to a relative 1e-12
    (for delta-rule models, whose fp32 rounding the model amplifies past 1e-5; see docs/formats.md)."""
    ids = random_ids(vocab_size, 2, length)
    check_logits(hf_model, ours, ids)
    check_greedy(hf_model, ours, ids[:1, :7])
    check_left_padding(ours, vocab_size)
    if float64_continuation:
        check_continuation(copy.deepcopy(ours).double(), ids, rel=1e-12)
    else:
        check_continuation(ours, ids)


def check_logits_and_continuation(hf_model, ours, vocab_size: int, length: int) -> None:
    """Logits of a batch of two sequences of ``length``, and the cache continuation of the same ids (for variants
    whose greedy decoding transformers does not run alike, or that need not be decoded again)."""
    ids = random_ids(vocab_size, 2, length)
    check_logits(hf_model, ours, ids)
    check_continuation(ours, ids)


def check_logits_and_greedy(hf_model, ours, vocab_size: int, length: int) -> None:
    """Logits of a batch of two sequences of ``length``, and greedy decoding from the first 7 tokens of one."""
    ids = random_ids(vocab_size, 2, length)
    check_logits(hf_model, ours, ids)
    check_greedy(hf_model, ours, ids[:1, :7])


def check_export(ours, directory, model_type: str):
    """``ours`` written as ``model_type``; transformers reads it back and gives the same logits (two sequences of
    10 ids). Returns transformers' model."""
    from transformers import AutoModelForCausalLM

    ours.save_pretrained(directory, format=model_type)
    back = AutoModelForCausalLM.from_pretrained(directory).eval()
    check_logits(back, ours, random_ids(ours.config.vocab_size, 2, 10))
    check_public_fields(directory, back.config)
    return back


def check_public_fields(directory, transformers_config) -> None:
    """The exported ``config.json`` holds every field transformers' ``save_pretrained`` writes for the config it
    read from it (what public checkpoints carry, for readers without transformers' defaults), with the same
    values, and RoPE's base at the top level too."""
    written = json.loads((directory / "config.json").read_text())
    expected = json.loads(json.dumps(transformers_config.to_diff_dict()))  # bare Infinity, as export writes it
    missing = sorted(set(expected) - set(written) - {"transformers_version"})
    assert not missing, f"config.json lacks {missing}"
    for name in ("rope_parameters", "rope_theta"):
        expected.pop(name, None)
    differing = {name: (written[name], value) for name, value in expected.items()
                 if name != "transformers_version" and written[name] != value}
    assert not differing, f"config.json differs from transformers' reading (written, read): {differing}"
    if "rope_parameters" in written:
        assert written["rope_theta"] == written["rope_parameters"]["rope_theta"]


def export_refusal(model, directory, model_type: str) -> str:
    """The error of writing ``model`` as ``model_type`` (which must refuse it), after checking that nothing was
    written."""
    target = directory / "out"
    with pytest.raises(ValueError, match=f"cannot be written as {model_type}: ") as error:
        model.save_pretrained(target, format=model_type)
    assert not target.exists()
    return str(error.value)


@torch.no_grad()
def check_beam_search(hf_model, ours, prompt: torch.Tensor, new_tokens: int = 6, beams: int = 3) -> None:
    """Beam search, which reorders the cache rows at every step, returns the same beams as transformers."""
    kwargs = dict(num_beams=beams, num_return_sequences=2, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    expected, got = hf_model.generate(prompt, **kwargs), ours.generate(prompt, **kwargs)
    assert torch.equal(expected, got), f"beams differ:\n{expected}\n{got}"
