"""The memory-tax report reproduces published figures from published config.json values (written inline)."""

import pytest

from hybridlm.model.memory import memory_rows, read_any_config

LLAMA_2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, rms_norm_eps=1e-5,
                  max_position_embeddings=4096)
# Mistral-7B-Instruct-v0.2's config (sliding_window null, as the Jamba paper's figure assumes)
MISTRAL_7B = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1e6,
                  sliding_window=None, max_position_embeddings=32768)
JAMBA_V01 = dict(model_type="jamba", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=65536, attn_layer_period=8,
                 attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1, num_experts=16,
                 num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256,
                 mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 max_position_embeddings=262144)
LLAMA_3_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                   max_position_embeddings=8192)

GIB, CONTEXT = 2**30, 256 * 1024


def row(config, bits=16, context=CONTEXT):
    (only,) = memory_rows(read_any_config(config), [context], kv_bits=[bits])
    return only


@pytest.mark.parametrize("config, gigabytes", [(LLAMA_2_7B, 128), (MISTRAL_7B, 32), (JAMBA_V01, 4)],
                         ids=["llama-2-7b", "mistral-7b", "jamba"])
def test_jamba_paper_kv_cache_table_at_256k(config, gigabytes):
    r = row(config)
    assert r["kv_bytes"] - r["kv_bytes"] % GIB == gigabytes * GIB  # KV alone: exactly the table's figure
    assert round(r["bytes_per_request"] / GIB) == gigabytes  # with Jamba's Mamba states: still 4 GB
    attention_layers = 4 if config is JAMBA_V01 else 32
    kv_heads = config["num_key_value_heads"]
    assert r["bytes_per_token"] == attention_layers * 2 * kv_heads * 128 * 2


def test_llama_3_70b_is_320_kib_per_token_with_gqa():
    assert row(LLAMA_3_70B, context=4096)["bytes_per_token"] == 320 * 1024


def test_weights_match_the_published_parameter_counts():
    assert abs(row(LLAMA_2_7B, context=1)["weight_bytes"] / 2 - 6.74e9) < 0.01e9
    assert 51e9 < row(JAMBA_V01, context=1)["weight_bytes"] / 2 < 52.5e9  # "52B total parameters"


def test_quantized_and_windowed_rows():
    four = row(LLAMA_2_7B, bits=4)
    # 4-bit codes plus fp16 scales and zeros per group of 32: 160 of 512 bytes per token per head and layer, but
    # the newest 128 tokens (the default kv_residual) stay in 16 bits
    quantized = CONTEXT - 128
    assert four["bytes_per_token"] * CONTEXT == 32 * 32 * (quantized * 160 + 128 * 512)
    windowed = row(dict(MISTRAL_7B, sliding_window=4096))  # Mistral-7B-v0.1: a 4096-token window
    assert windowed["kv_bytes"] == 32 * 2 * 8 * 4095 * 128 * 2 + 32 * 8


def test_bad_report_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="context"):
        memory_rows(read_any_config(LLAMA_2_7B), [0])
    with pytest.raises(FileNotFoundError, match="--model"):
        read_any_config(tmp_path / "missing")


def test_memory_command_prints_json_rows(tmp_path, capsys):
    import json

    from hybridlm.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_70B))
    main(["memory", "--model", str(tmp_path), "--context", "1024", "262144", "--kv-bits", "16", "4", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [(r["context"], r["kv_bits"]) for r in rows] == [(1024, 16), (262144, 16), (1024, 4), (262144, 4)]
    assert rows[0]["bytes_per_token"] == 320 * 1024
    assert rows[1]["bytes_per_request"] == 80 * GIB + 80 * 8 + 8  # + int64 counters
    assert all({"batch", "bytes_per_token", "bytes_per_request"} <= set(r) for r in rows)


def test_context_bench_rows_measure_held_bytes():
    from hybridlm import CachePolicy
    from hybridlm.decoding.bench import context_rows
    from tests.helpers import tiny_model

    policies = {"fp": None, "4-bit": CachePolicy(kv_bits=4, kv_group_size=8, kv_residual=0),
                "sinks": CachePolicy(sink_tokens=2, window=6)}
    rows = context_rows({"AM": tiny_model(layer_pattern="AM")}, policies, [16, 48], steps=1, warmup=0)
    size = {(r["policy"], r["context"]): r["cache_bytes"] for r in rows}
    assert size["sinks", 16] == size["sinks", 48] < size["4-bit", 48] < size["fp", 48]
    assert all(r["decode"].median_ms > 0 and r["peak_rss_mib"] > 0 for r in rows)


# Published config.json values: Mixtral-8x7B-v0.1, Qwen2-7B, Qwen3-8B (46.7B, 7.62B and 8.2B parameters)
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=None, rope_theta=1e6, tie_word_embeddings=False)
QWEN2_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1e6,
                use_sliding_window=False, sliding_window=131072, tie_word_embeddings=False)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6,
                tie_word_embeddings=False)


@pytest.mark.parametrize("config, layers, kv_heads, parameters", [
    (MIXTRAL_8X7B, 32, 8, 46.70e9), (QWEN2_7B, 28, 4, 7.62e9), (QWEN3_8B, 36, 8, 8.19e9)],
    ids=["mixtral-8x7b", "qwen2-7b", "qwen3-8b"])
def test_plain_transformers_are_read_as_all_attention(config, layers, kv_heads, parameters):
    r = row(config, context=4096)
    assert r["bytes_per_token"] == r["bytes_per_token_by_kind"]["attention"] == layers * 2 * kv_heads * 128 * 2
    assert abs(r["weight_bytes"] / 2 - parameters) < 0.01e9
    assert r["kv_bytes"] == layers * (4096 * 2 * kv_heads * 128 * 2 + 8)  # + each layer's int64 padding counter
    assert r["fixed_bytes"] == 8  # nothing that does not grow but the cache's own counter


# transformers' default config of each foreign format, made hybrid where the default is all-SSM and with fewer
# experts where many make the meta model slow to build
FOREIGN_OVERRIDES = {
    "bamba": dict(attn_layer_indices=[4, 12, 20]),
    "granitemoehybrid": dict(num_local_experts=8, layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 28),
    "kimi_linear": dict(num_experts=8),
    "lfm2_moe": dict(num_experts=4, layer_types=["conv", "full_attention"] * 16),
    "mistral": dict(sliding_window=None),  # its default 4096-token window bounds the growth the formula counts
    "qwen3_5_moe": dict(text_config=dict(num_experts=8)),
    "qwen3_5_moe_text": dict(num_experts=8),
    "qwen3_next": dict(num_experts=10),
}
# mamba-ssm's own config.json (no model_type): a Mamba-2 stack with 6 attention layers of 5 KV heads
MAMBA_SSM_HYBRID = dict(d_model=2560, n_layer=64, vocab_size=50277, ssm_cfg=dict(layer="Mamba2"),
                        attn_layer_idx=[9, 18, 27, 36, 45, 56], d_intermediate=0, tie_embeddings=True,
                        attn_cfg=dict(causal=True, head_dim=128, num_heads=30, num_heads_kv=5, rotary_emb_dim=64))


#: flash-linear-attention's mamba3 (transformers has no config class for it): its defaults plus one of its own fields
FLA_MAMBA3 = dict(model_type="mamba3", fuse_norm=True, num_hidden_layers=4)


def foreign_config(model_type: str) -> dict:
    if model_type == "mamba_ssm":
        return MAMBA_SSM_HYBRID
    if model_type == "mamba3":
        return FLA_MAMBA3
    import transformers

    return transformers.AutoConfig.for_model(model_type, **FOREIGN_OVERRIDES.get(model_type, {})).to_dict()


def expected_growth(config) -> dict:
    """Bytes per token of each growing kind, from the config alone (16-bit): 2 vectors per KV head and token in
    every attention layer and shared-block application, one latent plus rotary key per token in an MLA layer."""
    kv = 2 * config.num_key_value_heads * config.head_dim * 2
    parts = [part for kind in config.layer_types for part in kind.split("+")]
    growth = {"attention": parts.count("attention") * kv,
              "shared_attention": len(config.shared_block_layers or []) * kv,
              "mla": parts.count("mla") * (config.mla_kv_lora_rank + config.mla_qk_rope_head_dim) * 2}
    return {kind: float(b) for kind, b in growth.items() if b}


def test_every_foreign_format_is_reported():
    from hybridlm.formats.base import FORMATS

    reported = {}
    for model_type in sorted(FORMATS):
        config = read_any_config(foreign_config(model_type))
        (r,) = memory_rows(config, [4096], kv_bits=[16])
        assert r["bytes_per_token_by_kind"] == expected_growth(config), model_type
        assert r["bytes_per_token"] == sum(r["bytes_per_token_by_kind"].values())
        assert r["bytes_per_request"] == r["fixed_bytes"] + r["kv_bytes"] and r["weight_bytes"] > 0
        reported[model_type] = r["bytes_per_token"]
    assert reported["mamba_ssm"] == 6 * 2 * 5 * 128 * 2 and reported["jamba"] == 4 * 2 * 8 * 128 * 2
    assert reported["mamba2"] == reported["mamba"] == 0  # nothing grows: fixed-size states only
    assert reported["zamba2"] > 0 and reported["kimi_linear"] > 0  # shared attention blocks; MLA latents


def test_context_bench_peak_rss_is_each_rows_own():
    """A bounded cache measured after a large one reports its own peak, not the process's high-water mark."""
    from hybridlm import CachePolicy
    from hybridlm.decoding.bench import context_rows
    from tests.helpers import tiny_model

    model = tiny_model(layer_pattern="A", hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
    policies = {"fp": None, "sinks": CachePolicy(sink_tokens=2, window=6)}
    full, bounded = context_rows({"A": model}, policies, [65536], steps=1, warmup=0)
    assert full["cache_bytes"] > 2**27  # 128 MiB of keys and values (2 KiB per token)
    assert full["peak_rss_mib"] - bounded["peak_rss_mib"] > 0.5 * full["cache_bytes"] / 2**20


def test_bench_context_command_prints_the_table_and_draws_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from hybridlm.cli import main

    plot = tmp_path / "context.png"
    main(["bench", "context", "--contexts", "200", "--steps", "1", "--warmup", "0", "--plot", str(plot)])
    printed = capsys.readouterr().out
    for stack, policy in [("all-attention", "fp"), ("all-attention", "4-bit"), ("jamba 1:7", "8-bit"),
                          ("jamba 1:7", "sinks 4 + window 1020"), ("all-mamba2", "fp")]:
        assert any(stack in line and policy in line for line in printed.splitlines()), (stack, policy)
    assert "peak RSS MiB" in printed and f"wrote {plot}" in printed
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_table_shows_each_layer_kind(tmp_path, capsys):
    import json

    from hybridlm.cli import main

    (tmp_path / "config.json").write_text(json.dumps(JAMBA_V01))
    main(["memory", "--model", str(tmp_path), "--context", "262144", "--kv-bits", "16"])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("262,144")]
    assert line.endswith("mamba 15.3 MiB; attention 4.00 GiB (16,384 B/token)")  # 28 Mamba states; 4 KV layers
