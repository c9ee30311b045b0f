"""The serving planner (``hybridlm memory --serve``): per-request bytes of six public configs against formulas written
out here from their config.json fields, the bytes a real HybridCache allocates for N requests, and bad input."""

import json
import math
from pathlib import Path

import pytest
import torch

from hybridlm import CachePolicy
from hybridlm.model import serving
from hybridlm.model.memory import read_any_config
from hybridlm.model.serving import plan_serving, serving_cache, serving_contexts
from tests.helpers import tiny_config

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
GIB, CONTEXT = 2**30, 32768


def public(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# --- the independent formula: bytes of one request, from config.json fields alone (bf16 KV and conv, fp32 state) --

def kv(layers: int, kv_heads: int, head_dim: int, context: int) -> int:
    return layers * (2 * kv_heads * head_dim * context * 2 + 8)  # keys + values, and each layer's int64 padding count


def mamba2(layers, heads, head_dim, groups, state, kernel) -> dict:
    inner = heads * head_dim
    return {"conv": layers * (inner + 2 * groups * state) * (kernel - 1) * 2, "state": layers * inner * state * 4}


def expected_parts(name: str, context: int) -> dict:
    c = public(name)
    if name == "jamba-v0.1":
        attention = sum(i % c["attn_layer_period"] == c["attn_layer_offset"] for i in range(c["num_hidden_layers"]))
        inner, layers = c["mamba_expand"] * c["hidden_size"], c["num_hidden_layers"] - attention
        return {"attention KV": kv(attention, c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"],
                                   context),
                "mamba conv": layers * inner * (c["mamba_d_conv"] - 1) * 2,
                "mamba state": layers * inner * c["mamba_d_state"] * 4}
    if name == "nemotron-h-8b":
        pattern = c["hybrid_override_pattern"]
        m = mamba2(pattern.count("M"), c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"],
                   c["conv_kernel"])
        return {"attention KV": kv(pattern.count("*"), c["num_key_value_heads"], c["attention_head_dim"], context),
                "mamba2 conv": m["conv"], "mamba2 state": m["state"]}
    if name == "qwen3-next-80b-a3b":
        attention = c["num_hidden_layers"] // c["full_attention_interval"]
        delta = c["num_hidden_layers"] - attention
        keys, values = c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_num_value_heads"] * c[
            "linear_value_head_dim"]
        return {"attention KV": kv(attention, c["num_key_value_heads"], c["head_dim"], context),
                "gated_deltanet conv": delta * (2 * keys + values) * (c["linear_conv_kernel_dim"] - 1) * 2,
                "gated_deltanet state": delta * c["linear_num_value_heads"] * c["linear_key_head_dim"]
                * c["linear_value_head_dim"] * 4}
    if name == "granite-4.0-h-small":
        attention = c["layer_types"].count("attention")
        m = mamba2(c["layer_types"].count("mamba"), c["mamba_n_heads"], c["mamba_d_head"], c["mamba_n_groups"],
                   c["mamba_d_state"], c["mamba_d_conv"])
        return {"attention KV": kv(attention, c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"],
                                   context), "mamba2 conv": m["conv"], "mamba2 state": m["state"]}
    if name == "falcon-h1-7b":  # attention and Mamba-2 side by side in every layer
        layers = c["num_hidden_layers"]
        assert c["mamba_d_ssm"] == c["mamba_n_heads"] * c["mamba_d_head"]
        m = mamba2(layers, c["mamba_n_heads"], c["mamba_d_head"], c["mamba_n_groups"], c["mamba_d_state"],
                   c["mamba_d_conv"])
        return {"attention KV": kv(layers, c["num_key_value_heads"], c["head_dim"], context), "mamba2 conv": m["conv"],
                "mamba2 state": m["state"]}
    assert name == "llama-3-70b"
    return {"attention KV": kv(c["num_hidden_layers"], c["num_key_value_heads"],
                               c["hidden_size"] // c["num_attention_heads"], context)}


# published parameter counts (model cards; Qwen3-Next's and Granite's from their safetensors totals)
PUBLIC = {"jamba-v0.1": (51.6e9, 8), "nemotron-h-8b": (8.1e9, 16), "qwen3-next-80b-a3b": (79.67e9, 8),
          "granite-4.0-h-small": (32.2e9, 16), "falcon-h1-7b": (7.59e9, 16), "llama-3-70b": (70.55e9, 8)}


@pytest.fixture(scope="module")
def plans():
    found = {}
    for name, (_, bits) in PUBLIC.items():
        config = read_any_config(public(name))
        found[name] = plan_serving(config, 80, serving_contexts(config, CONTEXT), weight_bits=bits, name=name)
    return found


@pytest.mark.parametrize("name", list(PUBLIC))
def test_public_configs_match_the_formula_written_from_their_fields(plans, name):
    plan = plans[name]
    assert [r["context"] for r in plan.rows] == [2**k for k in range(10, 16)]
    for row in plan.rows:
        assert row["bytes_by_part"] == {**expected_parts(name, row["context"]), "counters": 8}
        assert row["bytes_per_request"] == sum(row["bytes_by_part"].values())
        assert row["requests"] == (80 * GIB - plan.weight_bytes) // row["bytes_per_request"]
    parameters, bits = PUBLIC[name]
    assert abs(plan.weight_bytes * 8 / bits - parameters) < 0.01 * parameters


def test_headline_requests_at_32k_on_80_gib(plans):
    # 16-bit weights where they fit on 80 GiB, 8-bit otherwise (Jamba's 96 GiB of 16-bit weights do not)
    fit = {name: plan.row(CONTEXT)["requests"] for name, plan in plans.items()}
    assert fit == {"jamba-v0.1": 62, "nemotron-h-8b": 109, "qwen3-next-80b-a3b": 7, "granite-4.0-h-small": 31,
                   "falcon-h1-7b": 43, "llama-3-70b": 1}


def test_8_bit_kv_gains_less_on_a_hybrid_than_on_a_transformer():
    """vLLM #55196's observation, from hybridlm's own accounting: quantized KV shrinks only the KV part."""
    gains = {}
    for name in ("llama-3-70b", "nemotron-h-8b"):
        config = read_any_config(public(name))
        full, eight = (plan_serving(config, 640, [8192], kv_bits=bits).row(8192)["requests"] for bits in (16, 8))
        gains[name] = eight / full
    assert 1.7 < gains["llama-3-70b"] < 1.8  # KIVI codes plus fp16 scales and zeros: 1.125 B per element, not 1
    assert 1.2 < gains["nemotron-h-8b"] < 1.4  # the Mamba-2 states (fp32) do not shrink


# --- planner = allocation: a real cache for N requests, filled to the context -----------------------------------

ALL_KINDS = "AMSRPLDKTC"  # attention, mamba, mamba2, mamba3, performer, linformer, gated_deltanet, kda, mla, short_conv


@pytest.mark.parametrize("policy", [dict(), dict(kv_bits=8), dict(page_size=16)], ids=["16-bit", "8-bit", "paged"])
def test_planner_equals_what_a_real_cache_allocates(policy):
    from hybridlm import HybridForCausalLM

    config = tiny_config(layer_pattern=ALL_KINDS, hidden_size=64, num_attention_heads=2)  # head_dim 32: KIVI groups
    torch.manual_seed(0)
    model = HybridForCausalLM(config).eval()
    requests, context = 3, 200  # past KIVI's 128 full-precision tokens; the last page of 16 is rounded up
    plan = plan_serving(config, 1, [context], dtype=torch.float32, **policy)
    (row,) = plan.rows
    cache = serving_cache(config, dtype=torch.float32, batch=requests, max_length=context, device="cpu",
                          model=model, **policy)
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (requests, context)), cache=cache, use_cache=True)
    assert cache.seen == context
    assert cache.nbytes() == requests * row["bytes_per_request"]
    if "kv_bits" not in policy:  # preallocated slots and the paged pool, sized for the context, all in use
        assert cache.reserved_nbytes() == requests * row["bytes_per_request"]
    else:  # KIVI's code buffers grow ahead of the groups they hold (docs/serving-memory.md)
        assert cache.reserved_nbytes() > cache.nbytes()
    assert sum(cache.nbytes_by_kind().values()) + 8 * requests == cache.nbytes()
    if "page_size" in policy:
        pages = math.ceil(context / 16)
        attention_layers = sum(kind == "attention" for kind in config.layer_types)
        rounding = attention_layers * (pages * 16 - context) * 2 * config.num_key_value_heads * config.head_dim * 4
        assert row["paged_overhead_bytes"] == rounding + attention_layers * 4 * pages  # + int32 block-table entries
    else:
        assert row["paged_overhead_bytes"] == 0


# --- bad input ----------------------------------------------------------------------------------------------------

def test_a_device_smaller_than_the_weights_names_both_numbers():
    config = read_any_config(public("llama-3-70b"))
    with pytest.raises(ValueError, match=r"--device-gib 80 \(85,899,345,920 B\) is smaller than the 16-bit weights "
                                         r"alone: 131\.42 GiB \(141,107,412,992 B\)"):
        plan_serving(config, 80, [1024])


def test_unknown_layer_kinds_are_refused_by_name(monkeypatch):
    monkeypatch.delitem(serving.KIND_PARTS, "mamba")
    monkeypatch.delitem(serving.KIND_PARTS, "short_conv")
    with pytest.raises(ValueError, match="does not know the layer kinds mamba, short_conv"):
        plan_serving(tiny_config(layer_pattern="AMC"), 1, [64])


def test_other_bad_arguments(tmp_path):
    config = tiny_config(layer_pattern="AM")
    for kwargs, message in [(dict(device_gib=0), "--device-gib"), (dict(weight_bits=3), "--weight-bits"),
                            (dict(contexts=[0]), "--context"), (dict(kv_bits=8, page_size=16), "--page-size 16")]:
        with pytest.raises(ValueError, match=message):
            plan_serving(config, **{"device_gib": 1, "contexts": [64], **kwargs})
    assert serving_contexts(config, 3000) == [1024, 2048, 3000] and serving_contexts(config, 500) == [500]
    assert CachePolicy(page_size=16).page_size == 16


# --- the command ----------------------------------------------------------------------------------------------------

def test_memory_serve_prints_the_plan_and_draws_it(tmp_path, capsys):
    from hybridlm.cli import main

    config = tiny_config(layer_pattern="AMSD", hidden_size=64, num_attention_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    plot = tmp_path / "serve.png"
    main(["memory", "--model", str(tmp_path), "--serve", "--device-gib", "0.5", "--context", "4096",
          "--kv-bits", "16", "8", "--plot", str(plot)])
    printed = capsys.readouterr().out
    assert "weights (16-bit)" in printed and "attention KV" in printed and "gated_deltanet state" in printed
    assert "requests (16-bit KV)" in printed and "requests (8-bit KV)" in printed
    assert [line.split()[0] for line in printed.splitlines() if line[:7].strip().replace(",", "").isdigit()] == [
        "1,024", "2,048", "4,096"]
    if "wrote" in printed:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    main(["memory", "--model", str(tmp_path), "--serve", "--page-size", "16", "--context", "1000", "--json"])
    (plan,) = json.loads(capsys.readouterr().out)
    assert plan["page_size"] == 16 and plan["rows"][0]["paged_overhead_bytes"] > 0


def test_memory_serve_bad_input_is_a_usage_error(tmp_path, capsys):
    from hybridlm.cli import main

    (tmp_path / "config.json").write_text(json.dumps(public("llama-3-70b")))
    with pytest.raises(SystemExit):
        main(["memory", "--model", str(tmp_path), "--serve"])
    assert "smaller than the 16-bit weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["memory", "--model", str(tmp_path), "--page-size", "16"])
    assert "--page-size needs --serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["memory", "--model", str(tmp_path), "--serve", "--state-bits", "4"])
    assert "must be 8 or fp8" in capsys.readouterr().err


# --- quantized recurrent states (CachePolicy.state_bits, where this build has it) --------------------------------

HAS_STATE_BITS = "state_bits" in {field.name for field in __import__("dataclasses").fields(CachePolicy)}
needs_state_bits = pytest.mark.skipif(not HAS_STATE_BITS, reason="this build's CachePolicy has no state_bits")


@needs_state_bits
@pytest.mark.filterwarnings("ignore:cache_policy. state_bits is not applied")
@pytest.mark.parametrize("policy", [dict(state_bits=8), dict(state_bits=8, state_rounding="feedback", kv_bits=8)],
                         ids=["int8", "int8-feedback-kivi"])
def test_planner_equals_allocation_with_quantized_states(policy):
    from hybridlm import HybridForCausalLM

    config = tiny_config(layer_pattern=ALL_KINDS, hidden_size=64, num_attention_heads=2)
    torch.manual_seed(0)
    model = HybridForCausalLM(config).eval()
    (row,) = plan_serving(config, 1, [200], dtype=torch.float32, **policy).rows
    cache = serving_cache(config, dtype=torch.float32, batch=3, max_length=200, device="cpu", model=model, **policy)
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (3, 200)), cache=cache, use_cache=True)
    assert cache.nbytes() == 3 * row["bytes_per_request"]
    plain = plan_serving(config, 1, [200], dtype=torch.float32).rows[0]["bytes_by_part"]
    assert row["bytes_by_part"]["mamba2 state"] < plain["mamba2 state"]


@needs_state_bits
def test_int8_states_on_nemotron_h_match_the_formula():
    c = public("nemotron-h-8b")
    layers, heads = c["hybrid_override_pattern"].count("M"), c["mamba_num_heads"]
    entries = heads * c["mamba_head_dim"] * c["ssm_state_size"]
    plan = plan_serving(read_any_config(c), 80, [4096], state_bits=8)
    assert plan.row(4096)["bytes_by_part"]["mamba2 state"] == layers * (entries + 4 * heads)  # codes, fp32 scales
    # the conv window: int8 codes, one fp32 scale per held token (kernel - 1 of them)
    channels, held = heads * c["mamba_head_dim"] + 2 * c["n_groups"] * c["ssm_state_size"], c["conv_kernel"] - 1
    assert plan.row(4096)["bytes_by_part"]["mamba2 conv"] == layers * (channels * held + 4 * held)


def test_state_bits_without_the_field_is_refused(monkeypatch):
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class OldPolicy:
        kv_bits: int = 16

    monkeypatch.setattr(serving, "CachePolicy", OldPolicy)
    with pytest.raises(ValueError, match="--state-bits: this hybridlm's CachePolicy has no state_bits"):
        plan_serving(tiny_config(layer_pattern="AM"), 1, [64], state_bits=8)
