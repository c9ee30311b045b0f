"""The ``hybridlm`` command, run in-process (and in a subprocess where what it imports matters)."""

import argparse
import copy
import json
import re
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridlm.cli import COMMANDS, build_parser, main
from hybridlm.decoding.bench import Timing, time_calls
from hybridlm.decoding.incremental import IncrementalDecoder
from hybridlm.presets import PRESETS
from tests.helpers import tiny_model

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(59)]


def test_demo_writes_python_and_compares_the_bundled_models(capsys):
    main(["demo", "--contexts", "256", "1024", "--steps", "2", "--warmup", "1", "--eval-rows", "2",
          "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("def fibonacci(n):")  # the prompt, then the streamed continuation
    assert "held-out bits/byte" in out and "decode ms/token @1K" in out and "min / median" in out
    assert "4.0x fewer cache bytes per token" in out  # two attention layers in eight against eight
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("hybrid ", "attention "))}
    assert set(rows) == {"hybrid", "attention"}
    assert all(float(row[2]) < 2.0 for row in rows.values())  # trained: an untrained model scores ~3.5 bits/byte


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


def test_info_reads_a_config_far_larger_than_memory(capsys, tmp_path):
    """``info`` counts parameters and cache bytes without allocating weights: a config whose embedding alone is
    2**36 x 32 floats (8 TiB; allocating it was an error inside torch) is reported, parameters exactly."""
    vocab, hidden = 2**36, 32
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"layer_pattern": "AS", "hidden_size": hidden, "num_attention_heads": 4,
                                  "mamba2_head_dim": 16, "vocab_size": vocab, "tie_word_embeddings": True}))
    main(["info", "--config", str(config), "--context", "10"])
    out = capsys.readouterr().out
    from hybridlm import HybridConfig, HybridForCausalLM

    small = HybridForCausalLM(HybridConfig(**{**json.loads(config.read_text()), "vocab_size": 50}))
    rest = sum(p.numel() for p in small.parameters()) - 50 * hidden  # all but the (tied) embedding
    assert f"parameters: {(vocab * hidden + rest) / 1e6:.2f} M" in out and "+ 256 B per token of context" in out


def test_info_without_arguments_names_its_preset(capsys):
    main(["info", "--context", "16"])
    assert capsys.readouterr().out.startswith("preset: jamba-small (the default")


def test_info_reads_what_save_pretrained_writes(capsys, tmp_path):
    model = tiny_model(layer_pattern="SA", mamba2_dt_limit=(0.0, float("inf")))
    model.save_pretrained(tmp_path)
    assert "Infinity" in (tmp_path / "config.json").read_text()  # the encoding that used to break it
    expected = model.new_cache(1)
    for source in (tmp_path, tmp_path / "config.json"):
        main(["info", "--config", str(source), "--context", "10"])
        out = capsys.readouterr().out
        assert f"config: {source}" in out and f"{expected.nbytes():,} B fixed" in out


def test_info_config_that_does_not_exist(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["info", "--config", str(tmp_path / "nope")])
    assert "no such file or directory" in capsys.readouterr().err


def test_a_mistyped_local_path_says_the_directory_does_not_exist(capsys, tmp_path, monkeypatch):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("a local path must not reach the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    for path in (str(tmp_path / "chekpoint"), "checkpoints/run-1", "./run-1", "runs/a/b"):
        with pytest.raises(SystemExit):
            main(["generate", "--model", path, "--ids", "1"])
        assert f"directory {path} does not exist" in capsys.readouterr().err


def test_info_rejects_a_bad_config_file(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"layer_pattern": "AZ"}))
    with pytest.raises(SystemExit):
        main(["info", "--config", str(config)])
    assert "layer_pattern" in capsys.readouterr().err


def test_info_and_memory_reject_json_that_is_not_a_config(capsys, tmp_path):
    """A JSON list was an AttributeError traceback."""
    (tmp_path / "config.json").write_text("[1, 2]")
    for argv in (["info", "--config", str(tmp_path)], ["info", "--config", str(tmp_path / "config.json")],
                 ["memory", "--model", str(tmp_path)]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "holds a JSON list, not a config" in capsys.readouterr().err


def test_bench_prints_the_comparison(capsys):
    main(["bench", "--contexts", "32", "64", "--steps", "2", "--scan-length", "64"])
    out = capsys.readouterr().out
    for name in ("all-attention", "jamba 1:7", "all-mamba2", "qwen3-next 3:1", "selective_scan", "ssd_chunk_scan",
                 "speedup (median)", "speedup (min)", "min / median"):
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
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt", "hello"])
    assert "--prompt needs tokenizer files" in capsys.readouterr().err


@pytest.mark.slow  # one inductor compile of a one-layer model (10-30 s)
def test_generate_compile_prints_the_eager_tokens(capsys, tmp_path):
    tiny_model(layer_pattern="A", mlp_types=["none"]).save_pretrained(tmp_path)
    printed = []
    for extra in ([], ["--compile"]):
        main(["generate", "--model", str(tmp_path), "--ids", "3,4,5", "--max-new-tokens", "6", *extra])
        printed.append(capsys.readouterr().out.split())
    assert printed[0] == printed[1] and printed[0]


def test_generate_gives_byte_level_models_text(capsys, tmp_path):
    model = tiny_model(vocab_size=256, layer_pattern="SA")
    model.save_pretrained(tmp_path)
    main(["generate", "--model", str(tmp_path), "--prompt", "héllo", "--max-new-tokens", "5"])
    out = capsys.readouterr().out.rstrip("\n")
    ids = list("héllo".encode())
    tokens = IncrementalDecoder(model).generate([ids], max_new_tokens=5)[0, len(ids):].tolist()
    assert out == bytes(tokens).decode("utf-8", errors="replace")


def test_generate_defaults_to_the_bundled_hybrid(capsys):
    """Without --model: the bundled hybrid's greedy continuation, as transformers' generate gives it."""
    from transformers import AutoTokenizer

    from hybridlm import bundled_model_dir, load

    prompt = "import os\nimport sys\n"
    main(["generate", "--prompt", prompt, "--max-new-tokens", "12"])
    tokenizer, model = AutoTokenizer.from_pretrained(bundled_model_dir()), load(bundled_model_dir()).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:])
    assert expected.strip() and capsys.readouterr().out.rstrip("\n") == expected.rstrip("\n")


def test_convert_round_trip(tmp_path):
    model = tiny_model(layer_pattern="AM")
    model.save_pretrained(tmp_path / "src")
    main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "hybridlm"])
    from hybridlm import load

    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "dst")(ids).logits, model(ids).logits)


def test_convert_carries_the_tokenizer_and_generation_config(tmp_path, capsys):
    """A converted checkpoint keeps its source's tokenizer (with the chat template) and generation config, so
    AutoTokenizer and ``hybridlm generate --prompt`` work on it; the text generated is the source's."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from hybridlm import bundled_model_dir

    source = tmp_path / "src"
    shutil.copytree(bundled_model_dir(), source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(source)
    GenerationConfig(max_new_tokens=7, eos_token_id=0, temperature=0.5, do_sample=True).save_pretrained(source)
    main(["convert", str(source), str(tmp_path / "dst"), "--to", "bamba"])
    assert "with its tokenizer" in capsys.readouterr().out
    copied = AutoTokenizer.from_pretrained(tmp_path / "dst")
    assert copied.chat_template == tokenizer.chat_template
    assert copied("def f(x):")["input_ids"] == tokenizer("def f(x):")["input_ids"]
    assert GenerationConfig.from_pretrained(tmp_path / "dst").temperature == 0.5
    outputs = []
    for model in (source, tmp_path / "dst"):
        main(["generate", "--model", str(model), "--prompt", "import os", "--max-new-tokens", "6"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0].strip() and outputs[0] == outputs[1]


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


def option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_option_has_help_with_its_default():
    commands = subparsers(build_parser())
    assert list(commands) == list(COMMANDS) and {"demo", "info", "bench", "generate", "convert"} <= set(commands)
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in option_actions(sub):
            action = copy.copy(action)
            action.help = formatter._get_help_string(action)  # what --help prints, the default appended
            text = formatter._expand_help(action) if action.help else ""
            where = f"hybridlm {name} {'/'.join(action.option_strings) or action.dest}"
            assert text, f"{where} has no help"
            if action.option_strings and not action.required and action.nargs != 0:
                assert "default" in text or "without it" in text, f"{where}: help does not state the default: {text!r}"
            if action.default is not None and action.default is not False:
                shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
                shown = repr(shown) if not shown.isprintable() else shown  # a newline is shown escaped
                assert shown in text, f"{where}: help does not show the default {action.default!r}"


def test_help_lists_the_presets_and_has_no_markup():
    top = build_parser().format_help()
    assert all(name in top for name in COMMANDS)
    info = subparsers(build_parser())["info"].format_help()
    assert all(name in info for name in PRESETS)
    for text in [top] + [sub.format_help() for sub in subparsers(build_parser()).values()]:
        for markup in ("``", ":func:", ":class:", ":mod:", ":data:"):
            assert markup not in text


def modules_after(argv: list[str]) -> tuple[int, str, set[str]]:
    """Exit status, stderr and the imported top-level modules of ``hybridlm ARGV`` run in a fresh interpreter."""
    script = ("import sys\nfrom hybridlm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
              "    code = e.code\nprint(sorted({m.split('.')[0] for m in sys.modules}), file=sys.stderr)\n"
              "raise SystemExit(code)")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    *message, modules = done.stderr.strip().splitlines()
    return done.returncode, "\n".join(message), set(eval(modules))


@pytest.mark.parametrize("argv", [["--help"], ["info", "--help"], ["info", "--preset", "no-such-preset"],
                                  ["bench", "--steps", "many"], []])
def test_help_and_usage_errors_import_neither_torch_nor_transformers(argv):
    code, err, modules = modules_after(argv)
    assert code in (0, 2)
    assert "torch" not in modules and "transformers" not in modules
    if argv[1:2] == ["--preset"]:
        assert "invalid choice" in err and "jamba-small" in err


@pytest.mark.parametrize("argv, message", [
    (["info", "--context", "0"], "argument --context: must be >= 1, got 0"),  # was a ZeroDivisionError traceback
    (["info", "--context", "-5"], "argument --context: must be >= 1, got -5"),  # was a table for -5 tokens
    (["bench", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["demo", "--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["memory", "--model", "x", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["generate", "--ids", "3,x"], "argument --ids: '3,x' is not a comma-separated list of token ids"),
    (["generate", "--ids", "3,-1"], "argument --ids: token ids must be >= 0, got -1"),
    (["generate", "--ids", "3", "--kv-bits", "3"], "argument --kv-bits: invalid choice: 3"),
    (["generate", "--ids", "3", "--window", "0"], "argument --window: must be >= 1, got 0"),
    (["generate", "--ids", "3", "--top-p", "2"], "argument --top-p: must be in (0.0, 1.0], got 2"),
    (["generate", "--ids", "3", "--top-p", "nan"], "argument --top-p: must be in (0.0, 1.0], got nan"),
    (["generate", "--ids", "3", "--temperature", "-1"], "argument --temperature: must be in [0.0, inf], got -1"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_out_of_range_numbers_are_usage_errors_naming_the_option(argv, message, capsys):
    """Refused by the parser (before anything is loaded), naming the option."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "{missing}", "--ids", "1"], "directory {missing} does not exist"),
    (["convert", "{missing}", "{missing}-out", "--to", "jamba"], "directory {missing} does not exist"),
    (["info", "--config", "{missing}"], "--config {missing}: no such file or directory"),
    (["memory", "--model", "{missing}"], "--model {missing}: no such file or directory"),
    (["info", "--config", "{empty}"], "--config {empty}: no config.json in that directory"),
], ids=["generate", "convert", "info", "memory", "info-empty-dir"])
def test_a_mistyped_path_is_answered_before_torch_is_imported(argv, message, tmp_path):
    paths = {"missing": str(tmp_path / "no-such-dir"), "empty": str(tmp_path)}
    code, err, modules = modules_after([arg.format(**paths) for arg in argv])
    assert code == 2 and message.format(**paths) in err
    assert "torch" not in modules and "transformers" not in modules


def test_timing_reports_min_and_median_after_warmup():
    assert Timing.of([0.003, 0.001, 0.002]) == Timing(1.0, 2.0)
    assert format(Timing(1.0, 2.5), ".1f") == "1.0 / 2.5"
    calls = []
    timing = time_calls(lambda: calls.append(1), repeats=4, warmup=3)
    assert len(calls) == 7 and 0 <= timing.min_ms <= timing.median_ms
    with pytest.raises(ValueError, match="repeats"):
        time_calls(lambda: None, repeats=0)


def test_help_lists_each_command_once(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert len(re.findall(rf"^\s+{re.escape(name)}\b", out, flags=re.M)) == 1, name


def test_a_default_with_a_newline_is_shown_escaped(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "fibonacci(n):\\n')" in capsys.readouterr().out  # the old help printed "fibonacci(n): )"


def test_generate_without_a_prompt_refuses_before_loading_weights(tmp_path):
    code, err, modules = modules_after(["generate"])
    assert code == 2 and "give --prompt TEXT or --ids" in err and "torch" not in modules


def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """``finetune --lora`` without peft, ``generate`` from a GGUF file without gguf: one line saying what to
    install, exit status 2, no traceback."""
    from hybridlm import bundled_model_dir

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(SystemExit) as exit_:
        main(["finetune", "--model", str(bundled_model_dir()), "--data", "docstrings", "--lora", "4", "--steps", "1",
              "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "hybridlm finetune: LoRA needs peft: pip install 'hybridlm[lora]'"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tmp_path / "m.gguf"), "--ids", "1"])
    assert "pip install 'hybridlm[gguf]'" in capsys.readouterr().err.strip().splitlines()[-1]


def test_interleaved_timings_take_turns():
    from hybridlm.decoding.bench import interleaved_timings

    order = []
    timings = interleaved_timings({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3,
                                  warmup=2)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3 and set(timings) == {"a", "b"}


@pytest.mark.parametrize("baseline, candidate, expected", [
    ({4096: (2.0, 2.1), 32768: (8.0, 8.2)}, {4096: (1.0, 1.05), 32768: (2.0, 2.05)}, "; it grows with the context."),
    ({4096: (2.0, 2.1), 32768: (2.0, 2.1)}, {4096: (1.0, 1.05), 32768: (1.5, 1.55)}, "does not grow"),
    ({4096: (1.36, 1.4), 32768: (0.1, 1.0)}, {4096: (1.0, 1.0), 32768: (1.0, 1.0)}, "The machine is busy"),
])
def test_speedup_verdict_is_worded_from_the_numbers(baseline, candidate, expected):
    """Steady runs get a conclusion that follows the ratios; a wide spread gets none (a demo once printed
    "grows with the context" beside 1.36x at 4K and 1.01x at 32K)."""
    from hybridlm.decoding.bench import speedup_verdict

    verdict = speedup_verdict({c: Timing(*t) for c, t in baseline.items()},
                              {c: Timing(*t) for c, t in candidate.items()})
    assert expected in verdict
    assert ("grows" in verdict) == (expected == "; it grows with the context.")


def test_memory_takes_a_preset_states_its_convention_and_aligns_text(capsys):
    main(["memory", "--preset", "hybrid-tiny", "--context", "4096", "--kv-bits", "16", "4"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    header, rows = lines[0], lines[2:4]
    start = header.index("cache by layer kind")
    assert all(row[start:].startswith("mamba2") for row in rows), out  # text columns left-aligned, not ragged
    assert "bfloat16 cache" in out and "hybridlm info" in out
    main(["info", "--preset", "hybrid-tiny"])
    assert "hybridlm memory` counts 16-bit KV" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["memory"])
    assert "give --model CONFIG_OR_DIR or --preset NAME" in capsys.readouterr().err
