"""The ``hybridlm`` command, run in-process."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridlm.cli import main
from hybridlm.generation import IncrementalDecoder
from tests.helpers import tiny_model

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(59)]


def test_demo_reports_cache_and_speed(capsys):
    main(["demo", "--context", "256", "--steps", "2"])
    out = capsys.readouterr().out
    assert "cache B/token" in out and "decode ms/token" in out
    assert "8.0x fewer cache bytes per token" in out  # one attention layer in eight
    assert "Generating 16 tokens" in out


def test_info_by_kind_for_a_preset_and_a_config_file(capsys, tmp_path):
    main(["info", "--preset", "jamba-small", "--context", "128"])
    out = capsys.readouterr().out
    assert "attention" in out and "mamba" in out and "B per token of context" in out
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"layer_pattern": "AS", "hidden_size": 32, "num_attention_heads": 4,
                                  "mamba2_head_dim": 16, "vocab_size": 50}))
    main(["info", "--config", str(config), "--context", "10"])
    out = capsys.readouterr().out
    # attention: 2 (keys, values) * 4 heads * 8 head_dim * 4 bytes per token; Mamba-2 adds nothing per token
    assert "+ 256 B per token of context" in out


def test_info_rejects_a_bad_config_file(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"layer_pattern": "AZ"}))
    with pytest.raises(SystemExit):
        main(["info", "--config", str(config)])
    assert "layer_pattern" in capsys.readouterr().err


def test_bench_prints_the_comparison(capsys):
    main(["bench", "--contexts", "32", "64", "--steps", "2", "--scan-length", "64"])
    out = capsys.readouterr().out
    for name in ("all-attention", "jamba 1:7", "all-mamba2", "selective_scan", "ssd_chunk_scan", "speedup"):
        assert name in out


def save_with_tokenizer(directory):
    model = tiny_model(layer_pattern="MA", eos_token_id=1)
    model.save_pretrained(directory)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def test_generate_streams_text_with_the_checkpoint_tokenizer(capsys, tmp_path):
    model, tokenizer = save_with_tokenizer(tmp_path)
    main(["generate", "--model", str(tmp_path), "--prompt", "w3 w7 w9", "--max-new-tokens", "6"])
    out = capsys.readouterr().out.strip()
    ids = tokenizer("w3 w7 w9")["input_ids"]
    tokens = IncrementalDecoder(model).generate([ids], max_new_tokens=6, stop_tokens=[1])[0, len(ids):].tolist()
    expected = tokenizer.decode([t for t in tokens[: tokens.index(1) if 1 in tokens else 6]], skip_special_tokens=True)
    assert out == expected and out


def test_generate_without_tokenizer_takes_ids(capsys, tmp_path):
    tiny_model(layer_pattern="S").save_pretrained(tmp_path)
    main(["generate", "--model", str(tmp_path), "--ids", "3,4,5", "--max-new-tokens", "4"])
    assert len(capsys.readouterr().out.split()) == 4
    with pytest.raises(SystemExit, match="tokenizer"):
        main(["generate", "--model", str(tmp_path), "--prompt", "hello"])


def test_convert_round_trip(tmp_path):
    model = tiny_model(layer_pattern="AM")
    model.save_pretrained(tmp_path / "src")
    main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "hybridlm"])
    from hybridlm import load

    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "dst")(ids).logits, model(ids).logits)


def test_missing_checkpoint_is_a_clear_error(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--ids", "1"])
    assert "config.json" in capsys.readouterr().err


def test_info_backends_lists_every_op(capsys):
    main(["info", "--backends"])
    out = capsys.readouterr().out
    for op in ("selective_scan", "ssd_chunk_scan", "causal_conv1d", "causal_linear_attention", "attention"):
        assert op in out
    assert "torch" in out


def test_convert_to_a_foreign_format_that_transformers_reads(tmp_path):
    import transformers

    from tests.formats.test_jamba import tiny_jamba_config

    torch.manual_seed(0)
    source = transformers.JambaForCausalLM(tiny_jamba_config()).eval()
    source.save_pretrained(tmp_path / "src")
    main(["convert", str(tmp_path / "src"), str(tmp_path / "mid"), "--to", "hybridlm"])
    main(["convert", str(tmp_path / "mid"), str(tmp_path / "dst"), "--to", "jamba"])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert type(back) is transformers.JambaForCausalLM
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert (back(ids).logits - source(ids).logits).abs().max() < 1e-5
