"""Distillation at toy scale: the student's initialisation is the documented mapping, stage 1 lowers every new
mixer's error against its attention without touching the stack, stage 2's loss is the KL to the teacher, the
recipe writes the student with the teacher's tokenizer and resumes exactly, and bad input fails before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridlm import HybridConfig, HybridForCausalLM
from hybridlm.training import distill
from hybridlm.training.distill_student import GATE_BIAS, build_student, kept_layers, parse_layers
from hybridlm.training.distill_transfer import AttentionTransfer, fit_output_scales, held_out_errors
from hybridlm.training.finetune import DEFAULT_CHAT_TEMPLATE
from hybridlm.training.packing import pack_documents
from hybridlm.training.tokenizer import train_bpe_tokenizer

from ..formats.compare import randomize
from ..helpers import assert_close_rel

#: An all-attention teacher with grouped-query attention (4 query heads share 2 K/V heads).
TEACHER = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, head_dim=8,
               tie_word_embeddings=True, max_position_embeddings=256)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread (the recipe runs take --threads 1 too): tiny ops on a busy machine are much faster
    without OpenMP barriers; the setting is restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_teacher(vocab_size: int = 61, layers: int = 4, seed: int = 0, **overrides) -> HybridForCausalLM:
    torch.manual_seed(seed)
    config = HybridConfig(**{**TEACHER, "vocab_size": vocab_size, "layer_types": ["attention"] * layers, **overrides})
    return randomize(HybridForCausalLM(config), seed, scale=0.05).eval()


@pytest.fixture(scope="module")
def teacher_dir(corpus, tmp_path_factory) -> Path:
    """A tiny teacher checkpoint with its tokenizer and chat template."""
    texts = [path.read_text() for path in sorted(corpus.iterdir())]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    directory = tmp_path_factory.mktemp("teacher")
    tiny_teacher(len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def recipe_args(teacher: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    """Both stages, 4 steps each of 4 rows x 32 tokens, a checkpoint and an evaluation (of 4 held-out rows) every
    2 steps, metrics every step."""
    return ["--teacher", str(teacher), "--keep-attention", "1", "--data", str(corpus / "csv.py"),
            str(corpus / "heapq.py"), "--eval-data", str(corpus / "textwrap.py"), "--held-out-rows", "4",
            "--seq-len", "32", "--batch-size", "4", "--steps", "4", "--warmup", "1", "--eval-every", "2",
            "--eval-rows", "2", "--save-every", "2", "--log-every", "1", "--threads", "1", "--out", str(out), *extra]


def _repeated(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """K/V rows written out head by head: query head h reads K/V head h // (heads / kv_heads)."""
    kv_heads = weight.shape[0] // head_dim
    return torch.cat([weight[(h * kv_heads // heads) * head_dim:][:head_dim] for h in range(heads)])


@pytest.mark.parametrize("mixer", ["mamba2", "gated_deltanet", "mamba"])
def test_the_student_is_the_documented_mapping(mixer):
    bias = mixer != "gated_deltanet"  # q/k/v/o biases are copied where the mixer has projection biases
    teacher = tiny_teacher(attention_bias=bias)
    student = build_student(teacher, [1], mixer)
    assert student.config.layer_types == [mixer, "attention", mixer, mixer]
    ours, theirs = student.state_dict(), teacher.state_dict()
    new = ("model.layers.0.mixer.", "model.layers.2.mixer.", "model.layers.3.mixer.")
    copied = [name for name in theirs if not name.startswith(new)]
    assert len(copied) == len(theirs) - 3 * (8 if bias else 4)
    for name in copied:  # embeddings, head, norms, MLPs, the kept attention layer
        assert torch.equal(ours[name], theirs[name]), name
    heads, head_dim, hidden = 4, 8, 32
    for i in (0, 2, 3):
        a, m = teacher.model.layers[i].mixer, student.model.layers[i].mixer
        q, k, v = (a.q_proj.weight, *(_repeated(p.weight, heads, head_dim) for p in (a.k_proj, a.v_proj)))
        if bias:
            qb, kb, vb = (a.q_proj.bias, *(_repeated(p.bias, heads, head_dim) for p in (a.k_proj, a.v_proj)))
        if mixer == "mamba2":  # in_proj rows: z, x, B, C, dt; one B/C group per query head of head_dim states
            assert (m.num_heads, m.head_dim, m.n_groups, m.d_state) == (heads, head_dim, heads, head_dim)
            z, x, B, C, dt = m.in_proj.weight.split([32, 32, 32, 32, heads])
            zb, xb, Bb, Cb, dtb = m.in_proj.bias.split([32, 32, 32, 32, heads])
            assert torch.equal(x, v) and torch.equal(B, k) and torch.equal(C, q)
            assert torch.equal(xb, vb) and torch.equal(Bb, kb) and torch.equal(Cb, qb)
            assert not z.any() and torch.equal(zb, torch.full_like(zb, GATE_BIAS)) and not dtb.any()
        elif mixer == "gated_deltanet":  # in_proj_qkvz rows: q, k, v, z
            assert (m.key_heads, m.heads, m.dim_k, m.dim_v) == (heads, heads, head_dim, head_dim)
            q_rows, k_rows, v_rows, _ = m.in_proj_qkvz.weight.split([32, 32, 32, 32])
            assert torch.equal(q_rows, q) and torch.equal(k_rows, k) and torch.equal(v_rows, v)
        else:  # in_proj rows: x, z
            assert m.d_inner == heads * head_dim == hidden
            x, z = m.in_proj.weight.split([32, 32])
            xb, zb = m.in_proj.bias.split([32, 32])
            assert torch.equal(x, v) and torch.equal(xb, vb)
            assert not z.any() and torch.equal(zb, torch.full_like(zb, GATE_BIAS))
        assert torch.equal(m.out_proj.weight, a.o_proj.weight)
        if bias:
            assert torch.equal(m.out_proj.bias, a.o_proj.bias)
        identity = torch.zeros_like(m.conv1d.weight)
        identity[:, 0, -1] = 1
        assert torch.equal(m.conv1d.weight, identity)
    assert abs(torch.nn.functional.silu(torch.tensor(GATE_BIAS)).item() - 1) < 1e-6
    fresh = build_student(teacher, [1], mixer, init="random")
    assert fresh.config.to_dict() == student.config.to_dict()
    for name in copied:
        assert torch.equal(fresh.state_dict()[name], theirs[name]), name
    assert not torch.equal(fresh.model.layers[0].mixer.out_proj.weight, teacher.model.layers[0].mixer.o_proj.weight)


def test_a_llama_to_mamba2_student_exports_to_bamba(tmp_path):
    """Query heads x head_dim = hidden_size (as in Llama, SmolLM2): the Mamba-2 width is an expansion of 1, which
    Bamba's format writes; transformers' Bamba layout reads back to the same logits."""
    from hybridlm import load
    from hybridlm.training.finetune import check_exportable

    student = build_student(tiny_teacher(), [1], "mamba2").eval()
    check_exportable(student, "bamba")
    student.save_pretrained(tmp_path, format="bamba")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "bamba"
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_rel(load(tmp_path).eval()(ids).logits, student(ids).logits, rel=1e-5)


def test_the_layers_to_keep_and_the_mappings_that_cannot_apply_are_checked():
    config = tiny_teacher(layers=8).config
    assert kept_layers(config, every=4) == [3, 7]
    assert kept_layers(config, parse_layers("5, 1,1")) == [1, 5]
    with pytest.raises(ValueError, match=r"--keep-attention 1,9: \[9\] out of range \(the teacher has 8 layers"):
        kept_layers(config, [1, 9])
    with pytest.raises(ValueError, match="--keep-attention is empty"):
        parse_layers(" , ")
    with pytest.raises(ValueError, match="exactly one of --keep-attention"):
        kept_layers(config, [1], 4)
    hybrid = HybridConfig(**{**TEACHER, "vocab_size": 61, "layer_types": ["attention", "mamba2", "attention"]})
    with pytest.raises(ValueError, match=r"layers \[1\] are not attention layers of the teacher \(mamba2\)"):
        kept_layers(hybrid, [1])
    with pytest.raises(ValueError, match="the teacher has no attention layers"):
        kept_layers(HybridConfig(**{**TEACHER, "vocab_size": 61, "layer_types": ["mamba2"] * 2}), every=2)
    biased = tiny_teacher(attention_bias=True)
    with pytest.raises(ValueError, match="gated_deltanet cannot be initialised .*biases.*pass --init random"):
        build_student(biased, [1], "gated_deltanet")
    assert build_student(biased, [1], "gated_deltanet", init="random").config.layer_types[0] == "gated_deltanet"
    narrow = tiny_teacher(head_dim=4)  # values 4 x 4 = 16 wide: no whole Mamba-1 expansion of hidden_size 32
    with pytest.raises(ValueError, match="mamba cannot be initialised .*heads x head_dim = 16.*--init random"):
        build_student(narrow, [1], "mamba")
    with pytest.raises(ValueError, match="keeps every attention layer"):
        build_student(tiny_teacher(), [0, 1, 2, 3], "mamba2")


def _rows(vocab: int, count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(1, vocab, (count * 32,), generator=generator)
    stream[torch.rand(stream.shape, generator=generator) < 0.05] = 0
    return pack_documents(stream, 32, 0)


def test_stage_1_lowers_each_layers_error_without_a_backward_through_the_stack(tmp_path):
    from hybridlm.training.distill_transfer import transfer_losses
    from hybridlm.training.loop import TrainConfig, train

    teacher = tiny_teacher()
    teacher.requires_grad_(False)
    student = build_student(teacher, [3], "mamba2").requires_grad_(False)
    model = AttentionTransfer(student, teacher, [0, 1, 2]).requires_grad_(True)
    assert {name for name, _ in model.named_parameters()} == {  # the new mixers, nothing else
        f"mixers.{k}.{name}" for k, i in enumerate((0, 1, 2))
        for name, _ in student.model.layers[i].mixer.named_parameters()}
    rows, held_out = _rows(61, 24, 0), _rows(61, 8, 1)
    fit = fit_output_scales(model, rows.batch(torch.arange(8), "documents"))
    assert all(error <= 1 + 1e-6 for error in fit)  # a zero output (error 1) is among the scales fitted
    before = held_out_errors(model, held_out, "documents", 8)
    # the teacher runs up to the last replaced layer only: the layers above (and the LM head) are not run
    above = []
    handle = teacher.model.layers[3].register_forward_hook(lambda *args: above.append(1))
    train(model, rows, TrainConfig(steps=12, batch_size=8, lr=3e-3, warmup=0, weight_decay=0.0, eval_every=100,
                                   save_every=100), tmp_path, losses=transfer_losses)
    handle.remove()
    assert not above
    after = held_out_errors(model, held_out, "documents", 8)
    assert all(a < 0.9 * b for a, b in zip(after, before)), (before, after)
    assert all(p.grad is None for p in [*teacher.parameters(), *student.model.layers[3].parameters(),
                                        *student.model.embed_tokens.parameters()])


def test_stage_2_loss_is_the_kl_to_the_teacher_plus_the_weighted_cross_entropy():
    teacher, student = tiny_teacher(seed=0), tiny_teacher(seed=1)
    rows = _rows(61, 4, 2)
    batch = rows.batch(torch.arange(4), "documents")
    targets = batch["labels"][:, 1:] != -100
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with torch.no_grad():
        p = teacher(**inputs).logits[:, :-1][targets].div(2).log_softmax(-1)
        q = student(**inputs).logits[:, :-1][targets]
    kl = torch.nn.functional.kl_div(q.div(2).log_softmax(-1), p, log_target=True, reduction="sum") * 4
    ce = torch.nn.functional.cross_entropy(q, batch["labels"][:, 1:][targets], reduction="sum")
    loss, count, aux = distill.kl_losses(teacher, temperature=2.0, ce_weight=0.5)(student, batch)
    assert count == int(targets.sum()) and aux is None
    assert_close_rel(loss.detach(), kl + 0.5 * ce, rel=1e-5)
    same, _, _ = distill.kl_losses(teacher)(teacher, batch)
    assert abs(float(same)) < 1e-4  # the teacher is its own perfect student


def test_steps_0_writes_the_initialised_student_through_hybridlm_distill(teacher_dir, corpus, tmp_path):
    from hybridlm.cli import main

    main(["distill", *recipe_args(teacher_dir, corpus, tmp_path / "init", "--steps", "0")])
    summary = json.loads((tmp_path / "init" / "distill.json").read_text())
    assert set(summary) == {"teacher", "kv_bytes_per_token", "init"}
    expected = build_student(distill.load_teacher(str(teacher_dir)), [1], "mamba2").state_dict()
    written = load_file(tmp_path / "init" / "model.safetensors")
    assert all(torch.equal(written[name], expected[name]) for name in written)
    kv = summary["kv_bytes_per_token"]  # 16-bit K and V of 2 heads x 8 per attention layer: 4 layers, then 1
    assert kv["teacher"]["bytes_per_token"] == 4 * kv["student"]["bytes_per_token"] == 4 * 2 * 2 * 2 * 8


def test_both_stages_write_the_student_and_resume_exactly_in_either(teacher_dir, corpus, tmp_path, monkeypatch):
    """Both stages: the student with the teacher's tokenizer and chat template, distill.json, the metrics with the
    teacher's bits per byte beside the student's; a run killed after stage 1's step-2 checkpoint, resumed, killed
    after stage 2's, and resumed again ends with the weights and the metrics of the uninterrupted run."""
    from transformers import AutoTokenizer

    from hybridlm.training import loop
    from hybridlm.training.packing import rows_for_step

    whole, split, steps = tmp_path / "whole", tmp_path / "split", ("--steps", "3", "--save-every", "1")
    summary = distill.main(recipe_args(teacher_dir, corpus, whole, *steps))
    assert summary["transfer"]["tokens"] == 3 * 4 * 32 and summary["finetune"]["tokens"] == 2 * 3 * 4 * 32
    assert summary["transfer"]["layer_error"] < 1 and len(summary["transfer"]["layer_errors"]) == 3
    for stage in ("transfer", "finetune"):
        evaluations = [json.loads(line) for line in (whole / stage / "metrics.jsonl").read_text().splitlines()
                       if "bits_per_byte" in line]
        assert [r["step"] for r in evaluations] == [2, 3]
        assert all(r["teacher_bits_per_byte"] > 0 and r["cpu_hours"] > 0 for r in evaluations)
    assert (whole / "distill.png").is_file() and json.loads((whole / "distill.json").read_text()) == summary
    assert HybridForCausalLM.from_pretrained(whole).config.layer_types == ["mamba2", "attention", "mamba2", "mamba2"]
    tokenizer = AutoTokenizer.from_pretrained(whole)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(teacher_dir).get_vocab()
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE

    for stage_seed in (0, 1):  # stage 1 orders its rows with --seed, stage 2 with --seed + 1

        def stop_at_step_2(step, batch_size, num_rows, seed, stage_seed=stage_seed):
            if step == 2 and seed == stage_seed:
                raise KeyboardInterrupt  # as if the process were killed after the step-2 checkpoint
            return rows_for_step(step, batch_size, num_rows, seed)

        with monkeypatch.context() as patch:
            patch.setattr(loop, "rows_for_step", stop_at_step_2)
            with pytest.raises(KeyboardInterrupt):
                distill.main(recipe_args(teacher_dir, corpus, split, *steps, *(["--resume"] if stage_seed else [])))
    resumed = distill.main(recipe_args(teacher_dir, corpus, split, *steps, "--resume"))
    expected, got = load_file(whole / "model.safetensors"), load_file(split / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert (got[name] - expected[name]).abs().max() <= 1e-6, name
    for stage in ("transfer", "finetune"):
        rows = [[json.loads(line) for line in (run / stage / "metrics.jsonl").read_text().splitlines()]
                for run in (whole, split)]
        assert [r["step"] for r in rows[1]] == [r["step"] for r in rows[0]]
        losses = [[r["loss"] for r in run_rows if "loss" in r] for run_rows in rows]  # evaluation rows have none
        assert losses[0] and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert resumed["finetune"]["bits_per_byte"] == pytest.approx(summary["finetune"]["bits_per_byte"], rel=1e-5)


def test_lora_on_the_new_mixers_leaves_the_rest_as_the_teacher(teacher_dir, corpus, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    distill.main(recipe_args(teacher_dir, corpus, out, "--stage", "finetune", "--steps", "2", "--lora", "2",
                             "--lora-on", "new", "--lr", "1e-2"))
    teacher, student = load_file(teacher_dir / "model.safetensors"), load_file(out / "model.safetensors")
    init = build_student(distill.load_teacher(str(teacher_dir)), [1], "mamba2").state_dict()
    new = ("model.layers.0.mixer.", "model.layers.2.mixer.", "model.layers.3.mixer.")
    for name, tensor in student.items():
        if not name.startswith(new) and name in teacher:
            assert torch.equal(tensor, teacher[name]), name
    changed = [name for name in student if name.startswith(new) and not torch.equal(student[name], init[name])]
    assert changed and all(name.endswith(("in_proj.weight", "out_proj.weight")) for name in changed)


def test_bad_input_is_an_error_before_training(teacher_dir, corpus, tmp_path):
    def fails(message: str, *argv: str, teacher: Path = teacher_dir, out: Path | None = None, error=ValueError):
        target = out if out is not None else tmp_path / "new"
        with pytest.raises(error, match=message):
            distill.main(recipe_args(teacher, corpus, target, *argv))
        assert out is not None or not target.exists()

    no_attention = tmp_path / "ssm"
    HybridForCausalLM(HybridConfig(**{**TEACHER, "vocab_size": 300, "layer_types": ["mamba2"] * 2})) \
        .save_pretrained(no_attention)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_attention / name).write_bytes((teacher_dir / name).read_bytes())
    fails("the teacher has no attention layers", teacher=no_attention)
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    fails("--teacher .*unreadable: hybridlm cannot read it", teacher=unreadable)
    fails(r"--keep-attention 1,7: \[7\] out of range", "--keep-attention", "1,7")
    fails("--keep-attention is empty", "--keep-attention", ",")
    fails("exactly one of --keep-attention", "--attention-every", "2")
    beyond = tmp_path / "beyond.jsonl"
    beyond.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n" + json.dumps({"input_ids": [5, 399]}) + "\n")
    fails("beyond.jsonl:2: token id 399 is not one of the teacher tokenizer's 300 ids", "--data", str(beyond))
    # ids in range, but another tokenizer's (trained on other text, so its merges differ)
    other = train_bpe_tokenizer(["completely different text " * 50, "zzz qqq xxx"], vocab_size=300)
    text = (corpus / "heapq.py").read_text()
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("".join(json.dumps({"input_ids": other(text[i:i + 400])["input_ids"]}) + "\n"
                               for i in range(0, 4000, 400)))
    fails("foreign.jsonl: these token ids are not the teacher tokenizer's", "--data", str(foreign))
    own = tmp_path / "own.jsonl"  # the teacher tokenizer's ids pass
    tokenizer = distill.teacher_tokenizer(str(teacher_dir), 300)
    own.write_text("".join(json.dumps({"input_ids": tokenizer(text[i:i + 400])["input_ids"]}) + "\n"
                           for i in range(0, 4000, 400)))
    from hybridlm.training.distill_data import check_ids, read_jsonl_documents

    check_ids(read_jsonl_documents(own, tokenizer), tokenizer)
    done = tmp_path / "done"
    distill.main(recipe_args(teacher_dir, corpus, done, "--steps", "0"))
    fails("--resume: .* other settings .*--mixer gated_deltanet \\(the run used mamba2\\)", "--resume", "--steps",
          "0", "--mixer", "gated_deltanet", out=done)
    fails("already holds a distillation", "--steps", "0", out=done, error=FileExistsError)


def test_the_passkey_prompt_hides_the_key_at_its_depth_in_a_prompt_of_the_length_asked(teacher_dir):
    from hybridlm.training.distill_measure import FILLER, INTRO, QUESTION, passkey_prompt

    tokenizer = distill.teacher_tokenizer(str(teacher_dir), 300)
    for depth in (0.1, 0.5, 0.9):
        ids = passkey_prompt(tokenizer, 1000, depth, 31337)
        text = tokenizer.decode(ids)
        assert len(ids) == 1000 and text.startswith(INTRO) and text.endswith(QUESTION) and text.count("31337") == 2
        end = text.index("31337 is the pass key.") + len("31337 is the pass key.")
        before, after = text.index(" The pass key is 31337") - len(INTRO), len(text) - len(QUESTION) - end
        assert abs(before / (before + after) - depth) <= len(FILLER) / (before + after)  # within a filler group
