"""MQAR: the generator's rows, its refusals, the answer-only loss against the full one, state bytes, and the
recipe end to end (attention must learn recall)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridlm.training.mqar as mqar
from hybridlm import HybridForCausalLM
from hybridlm.training.loop import token_losses

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "mqar.py"


def test_rows_hold_pairs_then_each_key_queried_once_with_its_value():
    vocab, seq_len, kv_pairs = 64, 48, 6
    rows = mqar.mqar_rows(200, seq_len, kv_pairs, vocab, seed=3)
    assert rows.ids.shape == rows.labels.shape == (200, seq_len) and len(rows) == 200
    assert int(rows.ids.min()) >= 0 and int(rows.ids.max()) < vocab
    context = 2 * kv_pairs
    for ids, labels in zip(rows.ids.tolist(), rows.labels.tolist()):
        keys, values = ids[0:context:2], ids[1:context:2]
        assert all(1 <= k < vocab // 2 for k in keys) and len(set(keys)) == kv_pairs
        assert all(vocab // 2 <= v < vocab for v in values) and len(set(values)) == kv_pairs
        answers = [t for t, label in enumerate(labels) if label != mqar.IGNORE]
        assert len(answers) == kv_pairs
        queried = []
        for t in answers:
            assert t > context and (t - context) % 2 == 1  # the answer follows its query at context + 2 g
            assert ids[t - 1] in keys and labels[t] == ids[t] == values[keys.index(ids[t - 1])]
            queried.append(ids[t - 1])
        assert sorted(queried) == sorted(keys)


def test_shifted_rows_hold_each_row_whole_at_its_own_offset():
    rows = mqar.mqar_rows(300, 32, 4, 64, seed=1)
    shifted = mqar.shift_rows(rows, 5, 64, seed=2)
    assert shifted.ids.shape == shifted.labels.shape == (300, 37)
    offsets = []
    for inner, inner_labels, ids, labels in zip(rows.ids, rows.labels, shifted.ids, shifted.labels):
        answers = (labels != mqar.IGNORE).nonzero().flatten()
        offset = int(answers[0]) - int((inner_labels != mqar.IGNORE).nonzero()[0])
        assert 0 <= offset <= 5 and len(answers) == 4
        assert torch.equal(ids[offset:offset + 32], inner) and torch.equal(labels[offset:offset + 32], inner_labels)
        assert (labels[:offset] == mqar.IGNORE).all() and (labels[offset + 32:] == mqar.IGNORE).all()
        offsets.append(offset)
    assert set(offsets) == set(range(6))  # every offset occurs: the pairs sit at no fixed place
    assert torch.equal(mqar.shift_rows(rows, 0).ids, rows.ids)
    with pytest.raises(ValueError, match="max_shift"):
        mqar.shift_rows(rows, -1)


def test_query_gaps_follow_the_zoology_power_law():
    slots, power_a = 30, 0.01
    zoology = power_a * np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1)  # Zoology's formula
    expected = zoology / zoology.sum()
    assert np.allclose(mqar.query_gap_probabilities(slots, power_a).numpy(), expected, rtol=1e-12)
    assert expected[0] > 10 * expected[-1]  # not uniform: the test below could not pass by accident
    # With one pair, the gap is a single draw from the distribution.
    rows = mqar.mqar_rows(20000, 2 + 2 * slots, 1, 64, power_a=power_a, seed=0)
    answer = (rows.labels != mqar.IGNORE).int().argmax(1)
    gaps = (answer - 3) // 2
    observed = torch.bincount(gaps, minlength=slots).double().numpy() / len(gaps)
    assert 0.5 * np.abs(observed - expected).sum() < 0.02  # total variation distance


def test_mixed_rows_split_evenly_over_the_pair_ladder():
    assert mqar.pair_ladder(32, 4) == [32, 16, 8, 4] and mqar.pair_ladder(4, 4) == [4, 2, 1]
    assert mqar.pair_ladder(8, 1) == [8]
    with pytest.raises(ValueError, match="rungs"):
        mqar.pair_ladder(8, 0)
    rows = mqar.mixed_mqar_rows(10, 64, [8, 2], 128, seed=0)
    answers = (rows.labels != mqar.IGNORE).sum(1).tolist()
    assert answers == [8] * 5 + [2] * 5  # one block per pair count; the loop shuffles the order
    mixed = mqar.mixed_mqar_rows(10, 64, [8, 2], 128, seed=0)
    assert torch.equal(rows.ids, mixed.ids) and torch.equal(rows.labels, mixed.labels)  # a function of the seed


def test_rows_are_a_function_of_the_seed():
    a, b, c = (mqar.mqar_rows(8, 64, 4, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.ids, c.ids)


@pytest.mark.parametrize("vocab_size, seq_len, kv_pairs, field", [
    (8192, 63, 16, "kv_pairs"),  # 16 pairs and their queries need 64 tokens
    (8192, 64, 0, "kv_pairs"),
    (16, 64, 8, "vocab_size"),  # keys are [1, 8): only 7
    (8192, 64.0, 4, "seq_len"),
])
def test_bad_shapes_are_refused_naming_the_argument(vocab_size, seq_len, kv_pairs, field):
    with pytest.raises(ValueError, match=field):
        mqar.check_mqar_shape(vocab_size, seq_len, kv_pairs)
    with pytest.raises(ValueError, match=field):
        mqar.mqar_rows(2, seq_len, kv_pairs, vocab_size)


def test_bad_model_choices_are_refused():
    with pytest.raises(ValueError, match="mixer"):
        mqar.mqar_config("transformer", 64, None, 64)
    with pytest.raises(ValueError, match="state_size"):
        mqar.mqar_config("mamba2", 64, None, 64)
    with pytest.raises(ValueError, match="state_size"):
        mqar.mqar_config("attention", 64, 16, 64)
    with pytest.raises(ValueError, match="state_size"):
        mqar.mqar_config("conv-attention", 64, 16, 64)


def test_only_models_with_a_fixed_recurrent_state_take_a_state_size():
    unsized = {m for m in mqar.MIXER_PATTERNS if not mqar.needs_state_size(m)}
    assert unsized == {"attention", "conv-attention"}
    assert mqar.needs_state_size("hybrid-1:3") and mqar.needs_state_size("mamba2")


def test_answer_loss_and_accuracy_equal_the_full_logits_reference():
    torch.manual_seed(0)
    model = HybridForCausalLM(mqar.mqar_config("hybrid-1:1", 32, 8, 32, vocab_size=128)).eval()
    rows = mqar.mqar_rows(6, 32, 4, 128, seed=1)
    batch = rows.batch(torch.arange(6), "stream")
    with torch.no_grad():
        reference, count, _ = token_losses(model, batch)  # cross-entropy over every position, -100 ignored
        fast, fast_count, _ = mqar.answer_losses(model, batch)
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    assert count == fast_count == 24 and float(reference) > 1.0
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    targets = batch["labels"][:, 1:]
    answered = targets != mqar.IGNORE
    expected = float((logits.argmax(-1) == targets)[answered].float().mean())
    assert mqar.answer_accuracy(model, rows, batch_size=4) == pytest.approx(expected)


def test_state_bytes_grow_with_length_for_attention_only():
    torch.manual_seed(0)
    attention = HybridForCausalLM(mqar.mqar_config("attention", 64, None, 128, vocab_size=128))
    # 2 layers x (keys + values) x seq_len x 64 channels x 4 bytes, plus each layer's length and the cache's
    # position counter (int64)
    assert mqar.state_bytes_per_sequence(attention, 128) == 2 * 2 * 128 * 64 * 4 + 2 * 8 + 8
    assert mqar.state_bytes_per_sequence(attention, 64) == 2 * 2 * 64 * 64 * 4 + 2 * 8 + 8
    # conv-attention: one attention layer's KV cache plus one short-conv window (64 channels x 2 inputs, fp32)
    conv_attention = HybridForCausalLM(mqar.mqar_config("conv-attention", 64, None, 128, vocab_size=128))
    assert mqar.state_bytes_per_sequence(conv_attention, 128) == 2 * 128 * 64 * 4 + 8 + 8 + 64 * 2 * 4
    mamba2 = HybridForCausalLM(mqar.mqar_config("mamba2", 64, 16, 128, vocab_size=128))
    short, long = mqar.state_bytes_per_sequence(mamba2, 32), mqar.state_bytes_per_sequence(mamba2, 128)
    # per layer: the SSM state (128 channels x 16) and the conv window (3 x (128 + 2 x 16)), fp32
    assert short == long == 2 * (128 * 16 + 3 * (128 + 2 * 16)) * 4 + 8
    mamba3 = HybridForCausalLM(mqar.mqar_config("mamba3", 64, 16, 128, vocab_size=128))
    # per layer, 4 heads of 32 channels: the angles (16 * 0.5 // 2 = 4 per head) and the SSM state (32 x 16) in
    # fp32, and the previous token's key (16 per head) and x (32 per head), fp32 here; no conv
    assert mqar.state_bytes_per_sequence(mamba3, 32) == 2 * (4 * (4 + 32 * 16) + 4 * (16 + 32)) * 4 + 8
    assert set(mqar.MIXER_PATTERNS) >= {"attention", "mamba", "mamba2", "mamba3", "performer", "linformer",
                                        "hybrid-1:1", "hybrid-1:3", "hybrid3-1:3"}


@torch.no_grad()
def test_the_mamba2_output_norm_sets_what_the_hybrid_adds_to_the_residual_at_init():
    """Why the 1:3 hybrid learns the lookup slowly with Mamba-2's gated RMSNorm (docs/mqar.md): the norm scales
    each Mamba-2 layer's output up to the out-projection's scale whatever the SSM computed, so three of them
    bury the token embeddings the attention layer must match; without it (``mamba2_norm="none"``) they add
    almost nothing at initialisation."""
    ids = mqar.mqar_rows(4, 64, 16, 8192, seed=1).batch(torch.arange(4), "stream")["input_ids"]
    added = {}
    for norm in ("gated", "none"):
        torch.manual_seed(0)
        model = HybridForCausalLM(mqar.mqar_config("hybrid-1:3", 64, 16, 64, mamba2_norm=norm)).eval()
        assert model.config.mamba2_norm == norm
        outputs = []
        for layer in model.model.layers[:3]:
            layer.mixer.register_forward_hook(lambda module, args, out, kept=outputs: kept.append(out))
        model(input_ids=ids)
        embedding_rms = float(model.get_input_embeddings()(ids).pow(2).mean().sqrt())
        added[norm] = [float(out.pow(2).mean().sqrt()) / embedding_rms for out in outputs]
    assert min(added["gated"]) > 2.0 and max(added["none"]) < 0.05, added


def _recipe():
    spec = importlib.util.spec_from_file_location("mqar_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_attention_learns_recall(tmp_path):
    recipe = _recipe()
    # Zoology's attention baseline (2 layers: a short convolution, then attention) where the pairs fill the row
    # (8 pairs, 8 queries, no filler) over a vocabulary of 256 (Zoology's 8,192 makes the LM head most of the
    # cost): about 10 cpu-seconds. The lookup is learnt in a jump whose step varies with the seed and the thread
    # count (in the cell 64:16 from 400 to over 700 steps); here it came by step 250 in each of 4 runs (seeds 0-2,
    # 1 and 2 threads, 0.99 held-out accuracy; chance: 1/128). With 8,192 tokens, Mamba-2 and Performer of state
    # size 16 stay near 0.02 in the cell 64:16 after 1,500 steps (docs/mqar.md).
    argv = ["--out", str(tmp_path), "--mixers", "conv-attention", "--widths", "64", "--cells", "32:8", "--lrs",
            "1e-2", "--steps", "400", "--test-rows", "512", "--vocab-size", "256"]
    rows = recipe.main(argv)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == rows and len(rows) == 1
    row = rows[0]
    assert {"mixer", "layer_types", "hidden_size", "state_size", "seq_len", "kv_pairs", "accuracy",
            "state_bytes_per_sequence"} <= set(row)
    assert row["layer_types"] == ["short_conv", "attention"] and row["state_size"] is None
    assert row["mamba2_norm"] == "gated"
    assert row["accuracy"] > 0.9, row
    with pytest.raises(SystemExit, match="--resume"):
        recipe.main(argv)  # nothing is overwritten without --resume
    assert recipe.main(argv + ["--resume"]) == rows  # every run is done: nothing trains again
    with pytest.raises(SystemExit, match="--steps 400 .now 401.*--vocab-size 256 .now 4096"):
        recipe.main(argv + ["--resume", "--steps", "401", "--vocab-size", "4096"])  # another experiment


def test_recipe_cells_with_a_max_shift_keep_the_cell_length_and_move_the_pairs():
    train, test = _recipe().cell_rows(64, 12, 8192, 96, 32, 0, 1, 16)  # (48, 12) rows shifted 0..16 into 64
    for rows in (train, test):
        assert rows.ids.shape[1] == 64 and ((rows.labels != mqar.IGNORE).sum(1) == 12).all()
        key_then_value = ((rows.ids[:, 0] < 4096) & (rows.ids[:, 1] >= 4096)).float().mean()
        assert key_then_value < 0.5  # unshifted rows all start with a key and its value
    unshifted, _ = _recipe().cell_rows(64, 16, 8192, 8, 8, 0)
    assert torch.equal(unshifted.ids, mqar.mqar_rows(8, 64, 16, seed=1).ids)  # Zoology's layout by default
    assert ((unshifted.ids[:, 0] < 4096) & (unshifted.ids[:, 1] >= 4096)).all()


def test_recipe_refuses_cells_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="kv_pairs"):
        _recipe().main(["--out", str(tmp_path), "--cells", "64:32"])
    with pytest.raises(ValueError, match="kv_pairs"):  # the warm-up cell too
        _recipe().main(["--out", str(tmp_path), "--cells", "64:4", "--warm-cell", "16:8", "--warm-steps", "5"])
    with pytest.raises(SystemExit):
        _recipe().main(["--out", str(tmp_path), "--cells", "64:4", "--warm-cell", "64:4"])  # no --warm-steps
    with pytest.raises(ValueError, match="the cell 64:12 less --max-shift 20: kv_pairs=12 do not fit"):
        _recipe().main(["--out", str(tmp_path), "--cells", "64:12", "--max-shift", "20"])  # 44 < 4 x 12 tokens
    with pytest.raises(SystemExit):
        _recipe().main(["--out", str(tmp_path), "--max-shift", "-1"])
    assert not (tmp_path / "results.json").exists()


def _run(mixer, lr, accuracy, **settings):
    return dict(mixer=mixer, hidden_size=64, state_size=None if mixer == "attention" else 16, seq_len=64,
                kv_pairs=16, lr=lr, accuracy=accuracy, cpu_s=100.0, state_bytes_per_sequence=1000, parameters=10,
                steps=1500, mamba2_norm="none", **settings)


def test_report_tables_the_best_learning_rate_of_each_model_without_training(tmp_path):
    runs = [_run("attention", 3e-3, 0.9), _run("attention", 1e-2, 0.95), _run("mamba2", 3e-3, 0.25)]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    rows = _recipe().main(["--out", str(tmp_path), "--report"])
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    best = {row["mixer"]: row for row in rows}
    assert best["attention"]["lr"] == 1e-2 and best["attention"]["accuracy"] == 0.95
    assert best["attention"]["accuracy_by_lr"] == {"0.003": 0.9, "0.01": 0.95}
    assert best["attention"]["cpu_s_all_lrs"] == 200.0 and best["mamba2"]["cpu_s_all_lrs"] == 100.0
    lines = _recipe().table(rows).splitlines()
    assert lines[0].split(" | ")[-4:] == ["acc. lr 0.003", "acc. lr 0.01", "best", "CPU s |"]
    assert "| 0.900 | 0.950 | **0.950** | 200 |" in lines[2] and "| 0.250 | — | **0.250** | 100 |" in lines[3]


def test_report_refuses_runs_of_different_settings_and_a_missing_file(tmp_path):
    with pytest.raises(SystemExit, match="runs.json does not exist"):
        _recipe().main(["--out", str(tmp_path), "--report"])
    runs = [_run("attention", 3e-3, 0.9), _run("mamba2", 3e-3, 0.2, batch_size=16), _run("mamba2", 1e-2, 0.3)]
    runs[2]["steps"] = 3000
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    with pytest.raises(SystemExit, match="mixes settings: --steps 1500/3000$"):  # batch_size: one row has it
        _recipe().main(["--out", str(tmp_path), "--report"])
    assert not (tmp_path / "results.json").exists()
