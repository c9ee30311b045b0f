"""The mixer registry is the single source of truth about each kind: a kind registered in a user's module works
in a model with no other change, the declarations of the built-in kinds are true, parallel layers combine
their parts' properties, and the docs' table is the registry's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridlm import HybridConfig, HybridForCausalLM, HybridModel
from hybridlm.cache import LayerState
from hybridlm.mixers import MIXERS, Mixer, mixer_class, register
from hybridlm.mixers.base import zero_padding
from tests.helpers import assert_close_rel, random_ids, tiny_config, tiny_model

DOCS = Path(__file__).resolve().parents[2] / "docs"
BUILT_IN = sorted(kind for kind, cls in MIXERS.items() if cls.__module__.startswith("hybridlm."))


@pytest.fixture
def registry():
    """Restores the registry after a test that registers kinds of its own."""
    saved = dict(MIXERS)
    yield MIXERS
    MIXERS.clear()
    MIXERS.update(saved)


@dataclasses.dataclass
class PreviousTokenState(LayerState):
    """``last [batch, hidden]``: the latest real input (zeros before the first)."""

    last: torch.Tensor


def define_previous_token_mixer():
    """A user's mixer, as a user's module would write it: ``y_t = proj(x_{t-1})`` (zero at t = 0)."""

    @register("previous_token")
    class PreviousToken(Mixer):
        pattern_letter = "Z"
        causal = True
        grows_with_context = False

        def __init__(self, config, layer_idx: int = 0):
            super().__init__()
            self.proj = nn.Linear(config.hidden_size, config.hidden_size)

        def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> PreviousTokenState:
            return PreviousTokenState(last=torch.zeros(batch_size, self.proj.in_features, device=device, dtype=dtype))

        def forward(self, x, state=None, *, mask=None, positions=None):
            x = zero_padding(x, mask)  # only left padding reaches a state: a zero is what an empty state holds
            first = state.last[:, None] if state is not None else x.new_zeros(x.shape[0], 1, x.shape[2])
            shifted = torch.cat([first, x[:, :-1]], dim=1)  # [batch, time, hidden]
            if state is not None:
                state.last = x[:, -1]
            return self.proj(shifted)

    return PreviousToken


def test_a_kind_registered_by_the_user_works_in_a_model(registry):
    """No change outside the user's module: the config accepts the kind (its letter too, and in a parallel
    layer), the model builds it, decoding one token at a time equals the full forward, and the cache knows its
    state does not grow."""
    define_previous_token_mixer()
    config = tiny_config(layer_pattern="ZA", layer_types=["previous_token", "attention"])
    assert config.layer_types == ["previous_token", "attention"]
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config(layer_types=["previous_token", "attention+previous_token", "mamba"]))
    model.eval()
    ids = random_ids(2, 9)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(9)], dim=1)
    assert full.abs().max() > 0
    assert_close_rel(steps, full)
    assert cache.is_linear == [True, False, True]


def test_register_refuses_bad_declarations(registry):
    define_previous_token_mixer()

    def declare(name="other", **attributes):
        return register(name)(type("Other", (Mixer,), attributes))

    with pytest.raises(ValueError, match="already registered"):
        declare("previous_token")
    with pytest.raises(ValueError, match="pattern_letter 'Z'"):
        declare(pattern_letter="Z")
    with pytest.raises(ValueError, match="identifier"):
        declare("a+b")
    with pytest.raises(ValueError, match="pattern_letter must be"):
        declare(pattern_letter="zz")
    with pytest.raises(ValueError, match="config_fields"):
        declare(config_fields="hidden_size")
    with pytest.raises(ValueError, match="causal must be"):
        declare(causal=1)
    with pytest.raises(ValueError, match="causal_field 'linformer_causal'"):
        declare(causal_field="linformer_causal")
    assert "other" not in MIXERS


def test_config_fields_must_exist(registry):
    register("reader")(type("Reader", (Mixer,), {"config_fields": ("no_such_field",)}))
    with pytest.raises(ValueError, match="no_such_field"):
        HybridConfig(layer_types=["reader"])


@pytest.mark.parametrize("kind", BUILT_IN)
def test_built_in_kinds_declare_their_properties(kind):
    """Each built-in kind states its causality and state growth itself (not by inheriting the defaults), and
    reads only HybridConfig fields."""
    cls = MIXERS[kind]
    own = vars(cls)
    assert "causal" in own or "causal_field" in own, f"{kind}: declare causal or causal_field"
    assert "grows_with_context" in own, f"{kind}: declare grows_with_context"
    assert set(cls.config_fields) <= set(HybridConfig.__dataclass_fields__)


def causal_kinds() -> list[str]:
    config = tiny_config()
    return [kind for kind in BUILT_IN if MIXERS[kind].is_causal(config)] + ["attention+mamba2", "mamba+performer"]


@pytest.mark.parametrize("entry", causal_kinds())
def test_a_causal_kind_is_causal(entry):
    """Appending tokens leaves the outputs at earlier positions unchanged; a state that does not grow keeps its
    size, one that grows does not."""
    model = tiny_model(layer_types=[entry])
    ids = random_ids(1, 12)
    with torch.no_grad():
        short, long = model(ids[:, :5]).logits, model(ids).logits[:, :5]
        sizes = [model(ids[:, :n], use_cache=True).cache.nbytes() for n in (4, 8)]
    assert_close_rel(long, short)
    assert (sizes[1] > sizes[0]) == mixer_class(entry).grows_with_context


def test_bidirectional_linformer_in_a_parallel_layer():
    """The bug a string test caused: ``"linformer" in layer_types`` missed ``"attention+linformer"``, so a
    causal LM was built whose earlier logits depend on later tokens. The kind's own declaration now decides."""
    config = tiny_config(layer_types=["attention+linformer"], linformer_causal=False, linformer_max_length=16)
    assert not config.is_causal and config.max_length_limit == 16
    with pytest.raises(ValueError, match="linformer_causal=False"):
        HybridForCausalLM(config)
    torch.manual_seed(0)
    encoder = HybridModel(config).eval()
    x = torch.randn(1, 12, config.hidden_size)
    with torch.no_grad():
        earlier = encoder(inputs_embeds=x[:, :5]).last_hidden_state
        later = encoder(inputs_embeds=x).last_hidden_state[:, :5]
        assert (later - earlier).abs().max() > 1e-3  # truly bidirectional: the refusal above is needed
        with pytest.raises(ValueError, match="linformer_max_length"):
            encoder(inputs_embeds=torch.randn(1, 17, config.hidden_size))


def test_parallel_layers_combine_their_parts():
    cls = mixer_class("attention+linformer")
    causal, bidirectional = tiny_config(), tiny_config(linformer_causal=False, linformer_max_length=32)
    assert cls.is_causal(causal) and not cls.is_causal(bidirectional)
    assert cls.max_positions(bidirectional) == 32
    assert cls.grows_with_context and not mixer_class("mamba+performer").grows_with_context
    assert set(cls.config_fields) == set(MIXERS["attention"].config_fields) | set(MIXERS["linformer"].config_fields)
    with pytest.raises(ValueError, match="partial_rotary_factor"):  # each part's own check runs
        HybridConfig(hidden_size=48, num_attention_heads=4, partial_rotary_factor=0.25,
                     layer_types=["mamba+attention"])
    for entry in ("attention+unknown", "attention+attention"):
        with pytest.raises(ValueError, match=re.escape("layer_types[0]")):
            HybridConfig(layer_types=[entry])


@pytest.mark.parametrize("change", [dict(sliding_window=3), dict(rope_theta=500.0), dict(partial_rotary_factor=0.5),
                                    dict(attention_qk_norm=True)])
def test_a_cache_is_refused_by_a_model_whose_state_means_something_else(change):
    """Same shapes, but keys kept under another window, rotation or norm: the signature (the kind's
    ``state_fields``) tells them apart."""
    other, model = tiny_model(layer_types=["attention", "mamba"], **change), tiny_model(layer_types=["attention",
                                                                                                        "mamba"])
    ids = random_ids(1, 6)
    with torch.no_grad():
        cache = other(ids, use_cache=True).cache
        with pytest.raises(ValueError, match="different model"):
            model(ids[:, :1], cache=cache)
        model(ids[:, :1], cache=model(ids, use_cache=True).cache)  # its own cache continues


def mixer_table() -> str:
    """The table of docs/mixers-and-cache.md, from the registry."""

    def fields(names):
        return ", ".join(f"`{name}`" for name in names) or "—"

    rows = ["| kind | letter | causal | position limit | state grows with context | config fields | state fields |",
            "|---|---|---|---|---|---|---|"]
    for kind in BUILT_IN:
        cls = MIXERS[kind]
        causal = f"`{cls.causal_field}`" if cls.causal_field else ("yes" if cls.causal else "no")
        limit = f"`{cls.max_positions_field}`" if cls.max_positions_field else "—"
        rows.append(f"| `{kind}` | {cls.pattern_letter or '—'} | {causal} | {limit} | "
                    f"{'yes' if cls.grows_with_context else 'no'} | {fields(cls.config_fields)} | "
                    f"{fields(cls.state_fields)} |")
    return "\n".join(rows)


def test_docs_table_is_the_registry():
    """docs/mixers-and-cache.md carries the registry's table verbatim; docs/config.md names every kind and
    letter. (Print the table with ``python -m tests.mixers.test_registry``.)"""
    assert mixer_table() in (DOCS / "mixers-and-cache.md").read_text(), "regenerate the table: see the docstring"
    config_doc = (DOCS / "config.md").read_text()
    for kind in BUILT_IN:
        letter = MIXERS[kind].pattern_letter
        assert f"`{kind}`" in config_doc and (letter is None or f"`{letter}` {kind}" in config_doc), kind


if __name__ == "__main__":
    print(mixer_table())
