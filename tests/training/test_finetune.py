"""Supervised fine-tuning: response-only targets, whole examples packed, LoRA on every linear layer (each adapter
changes the logits), merged logits equal to the adapter model's, and end-to-end runs on a Jamba checkpoint
(exported back to Jamba) and on a hybridlm model with chat examples (adapters saved and reloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridlm.training.finetune import (
    DEFAULT_CHAT_TEMPLATE,
    encode_example,
    main,
    pack_examples,
    read_examples,
    with_targets,
)
from hybridlm.training.loop import evaluate
from hybridlm.training.tokenizer import train_bpe_tokenizer

from ..formats.compare import randomize
from ..helpers import TINY, assert_close_rel, random_ids, relative_error, tiny_model

peft = pytest.importorskip("peft")

PAIRS = [{"prompt": f"def f{i}(x):\n", "response": f"    return x * {i} + {i % 3}\n"} for i in range(30)]
CHATS = [{"messages": [{"role": "user", "content": f"double {i}"}, {"role": "assistant", "content": str(2 * i)},
                       {"role": "user", "content": "and again"}, {"role": "assistant", "content": str(4 * i)}]}
         for i in range(30)]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [e["prompt"] + e["response"] for e in PAIRS] + ["double and again user assistant 0123456789"]
    tokenizer = train_bpe_tokenizer(texts * 4, vocab_size=300)
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def _decode_targets(tokenizer, ids, trained):
    return tokenizer.decode([i for i, t in zip(ids, trained) if t])


def test_only_the_response_and_end_of_text_are_targets(tokenizer):
    ids, trained = encode_example(tokenizer, PAIRS[7])
    assert _decode_targets(tokenizer, ids, trained) == PAIRS[7]["response"] + tokenizer.eos_token
    assert tokenizer.decode([i for i, t in zip(ids, trained) if not t]) == PAIRS[7]["prompt"]


def test_chat_targets_are_the_assistant_turns(tokenizer):
    ids, trained = encode_example(tokenizer, CHATS[5])
    assert _decode_targets(tokenizer, ids, trained) == "10\n20\n" + tokenizer.eos_token
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHATS[5]["messages"], tokenize=False) + \
        tokenizer.eos_token


def test_packing_keeps_examples_whole_and_labels_only_targets(tokenizer):
    encoded = [encode_example(tokenizer, e) for e in PAIRS[:12]]
    seq_len = max(len(ids) for ids, _ in encoded) * 2 + 1
    rows = pack_examples(encoded, seq_len, tokenizer.eos_token_id)
    batch = rows.batch(torch.arange(len(rows)), "documents")
    starts = (batch["position_ids"] == 0).sum()
    assert len(rows) < len(encoded) and starts >= len(encoded)  # several examples per row, none cut
    labelled = batch["labels"][batch["labels"] != -100]
    expected = torch.tensor([i for ids, trained in encoded for i, t in zip(ids, trained) if t])
    assert torch.equal(labelled, expected)


def test_bad_examples_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_examples(path)


@pytest.mark.parametrize("line", [
    "not json", '{"prompt": "x", "response": "y"', '["x", "y"]', '{"prompt": 3, "response": "y"}',
    '{"messages": ["hello"]}', '{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}',
    '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]}',
    '{"messages": [{"role": "user", "content": "x"}]}'])
def test_a_malformed_line_is_named_by_option_file_and_line(tmp_path, line):
    """Malformed JSON, a chat message without string role and content, or a chat with no assistant turn: an error
    naming the option, the file and the line (not a JSONDecodeError or AttributeError, nor silently trained)."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match="--eval-data .*bad.jsonl:2: "):
        read_examples(path, "--eval-data")
    with pytest.raises(FileNotFoundError, match="--eval-data .*missing.jsonl: no such file"):
        read_examples(tmp_path / "missing.jsonl", "--eval-data")


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(PAIRS[0]).encode() + b"\n" + '{"prompt": "café", "response": "x"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"--data {path}:2: not UTF-8 text"):
        read_examples(path)


def test_examples_cut_by_seq_len_are_counted_and_those_left_without_a_target_dropped(tokenizer, capsys):
    """Cut to --seq-len, an example with a long response keeps its first response tokens; one whose prompt fills
    the row keeps none, and trains nothing: it is left out (a row of such examples alone would have no target)."""
    short, long_response, long_prompt = ({"prompt": "def f(x):\n", "response": "    return x\n"},
                                         {"prompt": "def f(x):\n", "response": "    return x\n" * 20},
                                         {"prompt": "def f(x):\n" * 20, "response": "    return x\n"})
    encoded = [encode_example(tokenizer, e) for e in (short, long_response, long_prompt)]
    seq_len = len(encoded[0][0]) + 1
    assert len(encoded[1][0]) > seq_len and not any(encoded[2][1][:seq_len])
    kept, counts = with_targets(encoded, seq_len)
    assert kept == encoded[:2]
    assert counts == {"examples_cut": 2, "examples_without_target": 1}
    assert capsys.readouterr().out == (f"--data: 2 of 3 examples are longer than --seq-len {seq_len} and were cut; "
                                       "1 of them kept no response token and are left out\n")


def test_fine_tuning_is_refused_when_no_example_keeps_a_target(tokenizer, tmp_path):
    config, tokenizer_dir = _config_and_tokenizer(tmp_path, tokenizer, "SA")
    data = _write_jsonl(tmp_path / "d.jsonl", [dict(e, prompt=e["prompt"] * 20) for e in PAIRS])
    with pytest.raises(ValueError, match="--data: none of the 27 examples keeps a response token within --seq-len 64"):
        main(["--model", str(config), "--tokenizer", str(tokenizer_dir)] + _common(tmp_path, data))
    assert not (tmp_path / "out").exists()


#: Two stacks that hold every mixer kind between them, the first with MoE layers.
STACKS = {
    "mamba-mamba2-attention-performer-moe": dict(layer_pattern="MSAP", expert_layer_period=2, expert_layer_offset=1),
    "linformer-deltanet-kda-mla-short_conv-mamba3": dict(
        layer_types=["linformer", "gated_deltanet", "kda", "mla", "short_conv", "mamba3"]),
}


def test_the_recipe_reports_bad_input_in_one_line(tokenizer, tmp_path, monkeypatch, capsys):
    """``python recipes/finetune.py`` with a missing data file: one line naming --data, exit status 2, no
    traceback (as ``hybridlm`` answers)."""
    import runpy

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "finetune.py"
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr("sys.argv", [str(recipe), "--model", str(tmp_path), "--data", str(tmp_path / "missing.jsonl"),
                                     "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(recipe), run_name="__main__")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"recipes/finetune.py: --data {tmp_path / 'missing.jsonl'}: no such file\n"


@pytest.mark.parametrize("rank, alpha", [(0, None), (-1, None), (4, 0.0), (4, -1.0), (4, float("nan"))])
def test_bad_lora_settings_are_named(rank, alpha):
    """A rank below 1, or a scale numerator of 0 (adapters silently off), negative or NaN (NaN weights) is refused."""
    from hybridlm.training.lora import add_lora

    with pytest.raises(ValueError, match="--lora-alpha must be" if rank > 0 else "--lora rank must be"):
        add_lora(tiny_model(layer_pattern="SA"), rank, alpha)


def _lora_model(stack: str = "mamba-mamba2-attention-performer-moe"):
    from hybridlm.training.lora import add_lora

    # every weight perturbed: at initialisation the SSM paths (dt, B, C) add too little to the residual stream for
    # a change of x_proj / dt_proj to reach the logits above float32 noise
    base = randomize(tiny_model(seed=3, **STACKS[stack]), scale=0.3)
    return base, add_lora(base, rank=4).eval()


def test_the_stacks_hold_every_mixer_kind():
    from hybridlm.mixers import MIXERS

    kinds = {kind for stack in STACKS.values() for kind in tiny_model(**stack).config.layer_types}
    assert kinds == set(MIXERS)


@pytest.mark.parametrize("stack", list(STACKS))
def test_every_adapter_changes_the_logits(stack):
    """Each adapted layer on its own, its B matrix made non-zero: the logits move. Covers every mixer kind's
    projections (Mamba's and Mamba-2's in/out projections, MLA's kv_b_proj, ...), dense MLPs, every MoE expert
    and router."""
    from hybridlm.training.lora import linear_module_names, lora_modules

    _, model = _lora_model(stack)
    modules = lora_modules(model)
    assert len(modules) == len(linear_module_names(tiny_model(**STACKS[stack]))) > 0
    kinds = {name.split(".")[-1] for name in modules}
    if stack.endswith("moe"):
        assert {"in_proj", "out_proj", "x_proj", "dt_proj", "q_proj", "o_proj", "router", "up_proj"} <= kinds
        assert sum(".experts." in name for name in modules) == 2 * 4 * 3  # 2 MoE layers x 4 experts x gate/up/down
    else:
        assert {"kv_b_proj", "in_proj_qkvz", "f_a_proj", "g_b_proj", "in_proj", "out_proj"} <= kinds
    ids = random_ids(2, 24)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        unchanged = []
        for name, module in modules.items():
            weight = module.lora_B["default"].weight
            weight.normal_(generator=torch.Generator().manual_seed(len(name)))
            if not relative_error(model(input_ids=ids).logits, reference) > 1e-3:
                unchanged.append(name)
            weight.zero_()
    assert not unchanged, f"adapters without effect: {unchanged}"


@pytest.mark.parametrize(("stack", "dtype", "rel"), [
    ("mamba-mamba2-attention-performer-moe", torch.float32, 1e-5),
    # in float32 this stack's randomised Gated DeltaNet layer amplifies rounding to ~1.3e-5 (adapter model against
    # merged weights); float64 shows the merge itself exact
    ("linformer-deltanet-kda-mla-short_conv-mamba3", torch.float64, 1e-10),
])
def test_merged_logits_equal_the_adapter_models(stack, dtype, rel):
    from hybridlm.training.lora import lora_modules, merge_lora

    base, model = _lora_model(stack)
    model.to(dtype)
    ids = random_ids(2, 24)
    with torch.no_grad():
        before = base(input_ids=ids).logits.clone()
        generator = torch.Generator().manual_seed(0)
        for module in lora_modules(model).values():
            weight = module.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
        adapted = model(input_ids=ids).logits
        assert relative_error(adapted, before) > 1e-2
        merged = merge_lora(model)
        assert type(merged).__name__ == "HybridForCausalLM" and not lora_modules(merged)
        assert_close_rel(merged(input_ids=ids).logits, adapted, rel=rel)


def _config_and_tokenizer(tmp_path, tokenizer, layer_pattern):
    """A tiny model's config.json and the tokenizer saved beside it: the ``--model`` and ``--tokenizer`` paths."""
    config, tokenizer_dir = tmp_path / "config.json", tmp_path / "tokenizer"
    config.write_text(json.dumps(dict(TINY, layer_pattern=layer_pattern)))
    tokenizer.save_pretrained(tokenizer_dir)
    return config, tokenizer_dir


def _write_jsonl(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def _common(tmp_path, data, **flags):
    argv = ["--data", str(data), "--seq-len", "64", "--batch-size", "4", "--steps", "8", "--lr", "3e-3",
            "--warmup", "0", "--eval-every", "100", "--save-every", "100", "--log-every", "4", "--out",
            str(tmp_path / "out")]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return argv


@pytest.mark.slow
def test_lora_merge_on_a_jamba_checkpoint_exports_to_jamba(tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.formats.compare import tiny_transformers_model
    from tests.formats.test_jamba import tiny_jamba_config

    source = tmp_path / "jamba"
    tiny_transformers_model(transformers.JambaForCausalLM, tiny_jamba_config(vocab_size=300)).save_pretrained(source)
    tokenizer.save_pretrained(source)
    result = main(["--model", str(source)] + _common(tmp_path, _write_jsonl(tmp_path / "d.jsonl", PAIRS),
                                                      lora=4, merge=True))
    assert result["eval_loss_after"] < result["eval_loss_before"]
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["model_type"] == "jamba"
    import hybridlm

    ours = hybridlm.load(out).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(theirs, transformers.JambaForCausalLM)
    ids = random_ids(2, 13, vocab=300)
    with torch.no_grad():
        assert_close_rel(theirs(ids).logits, ours(input_ids=ids).logits, rel=1e-4)
        original = hybridlm.load(source).eval()(input_ids=ids).logits
    assert relative_error(ours(input_ids=ids).logits.detach(), original) > 1e-4  # the fine-tuning is in it


@pytest.mark.slow
def test_chat_lora_adapters_save_and_reload(tokenizer, tmp_path):
    from hybridlm.training.finetune import pack_examples as pack
    from hybridlm.training.pretrain import build_model

    config, tokenizer_dir = _config_and_tokenizer(tmp_path, tokenizer, "SA")
    data = _write_jsonl(tmp_path / "chat.jsonl", CHATS[:24])
    held_out = _write_jsonl(tmp_path / "chat_eval.jsonl", CHATS[24:])
    result = main(["--model", str(config), "--tokenizer", str(tokenizer_dir)]
                  + _common(tmp_path, data, eval_data=held_out, lora=4, seed=5))
    out = tmp_path / "out"
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    base = build_model(str(config), len(tokenizer), seed=5)
    reloaded = peft.PeftModel.from_pretrained(base, out)
    rows = pack([encode_example(tokenizer, e) for e in CHATS[24:]], 64, tokenizer.eos_token_id)
    assert evaluate(reloaded, rows, "documents") == pytest.approx(result["eval_loss_after"], rel=1e-5)
    assert result["eval_loss_after"] < result["eval_loss_before"]


@pytest.mark.slow
def test_docstring_task_holds_out_the_held_out_files():
    """Prompt (signature + docstring) and response (body) are consecutive source lines of one function; the
    evaluation examples are the functions of HELD_OUT_STDLIB and none of them is a training example."""
    import ast
    import textwrap

    from hybridlm.training.docstring_task import docstring_examples

    held_out, train = docstring_examples(held_out=True), docstring_examples(held_out=False)
    assert len(held_out) > 100 and len(train) > 1000
    push = next(e for e in held_out if e["prompt"].startswith("def heappush(heap, item):"))
    assert '"""Push item onto heap' in push["prompt"] and "heap.append(item)" in push["response"]
    for example in held_out[:50] + train[:50]:
        function = ast.parse(textwrap.dedent(example["prompt"] + example["response"])).body[-1]
        assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(function)
        assert example["response"].strip() and '"""' not in example["response"].split("\n")[0]
    assert not {e["prompt"] for e in held_out} & {e["prompt"] for e in train}


@pytest.mark.slow
def test_full_fine_tuning_saves_the_whole_model(tokenizer, tmp_path):
    import hybridlm
    from hybridlm.training.pretrain import build_model

    config, tokenizer_dir = _config_and_tokenizer(tmp_path, tokenizer, "MA")
    result = main(["--model", str(config), "--tokenizer", str(tokenizer_dir), "--seed", "5"]
                  + _common(tmp_path, _write_jsonl(tmp_path / "d.jsonl", PAIRS)))
    assert result["eval_loss_after"] < result["eval_loss_before"]
    out = tmp_path / "out"
    assert not (out / "adapter_config.json").exists()
    assert json.loads((out / "finetune.json").read_text()) == result
    tuned, base = hybridlm.load(out).eval(), build_model(str(config), len(tokenizer), seed=5).eval()
    ids = random_ids(2, 13, vocab=300)
    with torch.no_grad():
        assert relative_error(tuned(input_ids=ids).logits, base(input_ids=ids).logits) > 1e-3  # every weight trained
    rows = pack_examples([encode_example(tokenizer, e) for e in PAIRS[::10]], 64, tokenizer.eos_token_id)
    assert evaluate(tuned, rows, "documents") == pytest.approx(result["eval_loss_after"], rel=1e-5)


def test_bad_fine_tuning_options_fail_before_training(tokenizer, tmp_path):
    config, tokenizer_dir = _config_and_tokenizer(tmp_path, tokenizer, "SA")  # Mamba-2: Jamba cannot hold it
    data = _write_jsonl(tmp_path / "d.jsonl", PAIRS)
    start = ["--model", str(config), "--tokenizer", str(tokenizer_dir)]
    with pytest.raises(ValueError, match="--merge needs --lora"):
        main(start + _common(tmp_path, data, merge=True))
    with pytest.raises(ValueError, match="cannot be written as jamba"):
        main(start + _common(tmp_path, data, format="jamba"))
    with pytest.raises(ValueError, match="--format 'gguf'"):
        main(start + _common(tmp_path, data, format="gguf"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        main(start + _common(tmp_path, tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="--seq-len must be at least 2"):
        main(start + _common(tmp_path, data, seq_len=1))
    untokenized = tmp_path / "untokenized"
    tiny_model(layer_pattern="SA").save_pretrained(untokenized)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        main(["--model", str(untokenized)] + _common(tmp_path, data))
    assert not (tmp_path / "out").exists()  # nothing written


def test_the_hybridlm_finetune_command_is_the_recipe(tokenizer, tmp_path, capsys):
    from hybridlm import cli

    config, tokenizer_dir = _config_and_tokenizer(tmp_path, tokenizer, "SA")
    argv = ["--model", str(config), "--tokenizer", str(tokenizer_dir), "--seed", "5", "--lora", "2"] \
        + _common(tmp_path, _write_jsonl(tmp_path / "d.jsonl", PAIRS), steps=2)
    cli.main(["finetune"] + argv)
    from_the_command = json.loads((tmp_path / "out" / "finetune.json").read_text())
    (tmp_path / "out").rename(tmp_path / "out-command")
    assert from_the_command == main(argv)  # same options, same seed: the same run
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        cli.main(["finetune", "--model", str(tmp_path / "missing"), "--data", "docstrings", "--out",
                  str(tmp_path / "out2")])
    last = capsys.readouterr().err.splitlines()[-1]
    assert stopped.value.code == 2 and last.startswith("hybridlm finetune: ") and "missing" in last
