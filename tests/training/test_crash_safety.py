"""What a training run writes survives a kill at any file-system step and reads back exactly or as an error
naming the file: the checkpoint (single-process and sharded), run_settings.json and metrics.jsonl."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridlm.files import DamagedFileError
from hybridlm.training import finetune, loop, pretrain
from hybridlm.training.checkpoint import CHECKPOINT_DIR, check_new_run, load_checkpoint, recover_checkpoint
from hybridlm.training.config import TrainConfig
from hybridlm.training.distributed import SingleProcess, load_sharded, save_sharded
from hybridlm.training.loop import train
from hybridlm.training.packing import rows_for_step

from ..fault_injection import flipped, kill_points, run_killed, truncated
from ..helpers import tiny_model
from .test_loop import tiny_rows

CONFIG = TrainConfig(steps=4, batch_size=2, lr=1e-2, warmup=1, log_every=1, eval_every=100, save_every=2)
FILES = ("model.safetensors", "trainer_state.pt", "config.json", "manifest.json")


def new_model():
    return tiny_model(layer_pattern="A").train()


def metrics_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``whole``: an uninterrupted 4-step run (checkpoints at steps 2 and 4); ``half``: the same run stopped
    after its step-2 checkpoint."""
    whole, half = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("half")
    model = new_model()
    train(model, tiny_rows(), CONFIG, whole)

    def stop_at_step_2(step, *args, **kwargs):
        if step == 2:
            raise KeyboardInterrupt
        return rows_for_step(step, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "rows_for_step", stop_at_step_2)
        with pytest.raises(KeyboardInterrupt):
            train(new_model(), tiny_rows(), CONFIG, half)
    return {"whole": whole, "half": half, "weights": model.state_dict()}


def resume(out):
    model = new_model()
    train(model, tiny_rows(), CONFIG, out, resume=True)
    return model


def assert_same_weights(model, weights) -> None:
    got = model.state_dict()
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name


def test_a_run_killed_at_any_step_of_its_writes_resumes_exactly(runs, tmp_path, monkeypatch):
    """Killed at every file-system step of a resumed run (the metrics and the step-4 checkpoint over the step-2
    one; the loss plot is left out, its writes are those of test_files.py), the directory always holds a
    checkpoint: a new run refuses it, and --resume ends with the weights and metrics of the whole run."""
    monkeypatch.setattr(loop, "plot_loss", lambda rows, path: False)

    def copy(k):
        out = tmp_path / f"killed-at-{k}"
        shutil.copytree(runs["half"], out)
        return out

    points = kill_points(resume, copy("count"))
    assert len(points) > 20
    for k in points:
        out = copy(k)
        run_killed(resume, out, kill_at=k)
        with pytest.raises(FileExistsError, match="already holds a checkpoint"):
            check_new_run(out)
        assert_same_weights(resume(out), runs["weights"])
        assert metrics_steps(out) == metrics_steps(runs["whole"]) == [1, 2, 3, 4], k


def test_resume_finishes_a_save_killed_between_its_renames(runs, tmp_path):
    """The complete new checkpoint is in checkpoint.tmp and the old one in checkpoint.old (no checkpoint/): the
    state that, with delete-then-rename, lost the checkpoint."""
    out = tmp_path / "out"
    shutil.copytree(runs["whole"], out)
    (out / CHECKPOINT_DIR).rename(out / "checkpoint.tmp")
    shutil.copytree(runs["half"] / CHECKPOINT_DIR, out / "checkpoint.old")
    with pytest.raises(FileExistsError, match="checkpoint.tmp"):
        check_new_run(out)
    recover_checkpoint(out)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(CHECKPOINT_DIR)) == [CHECKPOINT_DIR]
    model = new_model()
    optimizer = torch.optim.AdamW(loop._param_groups(model, CONFIG.weight_decay))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CONFIG.schedule)
    assert load_checkpoint(out, model, optimizer, scheduler)["step"] == 4
    assert_same_weights(model, runs["weights"])


@pytest.mark.parametrize("leftover", ["checkpoint.tmp", "checkpoint.old"])
def test_a_new_run_refuses_an_out_holding_what_a_killed_save_left(runs, tmp_path, leftover):
    """A complete checkpoint left beside no checkpoint/ is recoverable: train and finetune refuse to start over
    it (a new run's first save would delete it)."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(runs["half"] / CHECKPOINT_DIR, out / leftover)
    with pytest.raises(FileExistsError, match=f"{leftover}\\): pass --resume"):
        pretrain.main(["--out", str(out)])
    with pytest.raises(FileExistsError, match=f"{leftover}\\): choose another --out"):
        finetune.main(["--model", "hybrid-tiny", "--data", "docstrings", "--out", str(out)])


@pytest.mark.parametrize("name", FILES)
def test_a_damaged_checkpoint_file_is_an_error_naming_it(runs, tmp_path, name):
    """Truncated, or any of a file's bytes flipped: --resume fails naming the file, never resumes otherwise."""
    path = runs["half"] / CHECKPOINT_DIR / name
    size = path.stat().st_size
    damages = [(truncated, size // 2), (truncated, 0)] + [(flipped, offset) for offset in
                                                          sorted({0, size // 3, size // 2, size - 1})]
    for damage, where in damages:
        out = tmp_path / f"{damage.__name__}-{where}"
        shutil.copytree(runs["half"], out)
        damage(out / CHECKPOINT_DIR / name, where)
        with pytest.raises(DamagedFileError, match=str(out / CHECKPOINT_DIR)):
            resume(out)


def test_a_truncated_checkpoint_without_a_manifest_names_the_file(runs, tmp_path):
    """A checkpoint written before manifests existed is still read, and a truncated weights file is named."""
    out = tmp_path / "out"
    shutil.copytree(runs["half"], out)
    (out / CHECKPOINT_DIR / "manifest.json").unlink()
    truncated(out / CHECKPOINT_DIR / "model.safetensors", 1000)
    with pytest.raises(DamagedFileError, match=f"{out / CHECKPOINT_DIR / 'model.safetensors'}: not a complete"):
        resume(out)


def _sharded_training_state(seed: int):
    """A model, optimizer and scheduler after one step (the weights differ by ``seed``)."""
    model = tiny_model(seed=seed, layer_pattern="A").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CONFIG.schedule)
    batch = torch.randint(1, 60, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_a_sharded_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path):
    old, new = _sharded_training_state(1), _sharded_training_state(2)
    template = tmp_path / "template"
    save_sharded(template, *old, {"step": 1}, SingleProcess())

    def copy(k):
        out = tmp_path / f"killed-at-{k}"
        shutil.copytree(template, out)
        return out

    points = kill_points(save_sharded, copy("count"), *new, {"step": 2}, SingleProcess())
    found, loaded = set(), _sharded_training_state(3)
    for k in points:
        out = copy(k)
        run_killed(save_sharded, out, *new, {"step": 2}, SingleProcess(), kill_at=k)
        recover_checkpoint(out)
        step = load_sharded(out / CHECKPOINT_DIR, *loaded)["step"]
        assert_same_weights(loaded[0], (old, new)[step - 1][0].state_dict())
        assert loaded[1].state_dict()["state"][0]["exp_avg"].equal(
            (old, new)[step - 1][1].state_dict()["state"][0]["exp_avg"])
        found.add(step)
    assert found == {1, 2}  # early kills keep the old checkpoint, late ones the new


def test_run_settings_read_back_exactly_or_fail_naming_the_file(tmp_path):
    """Killed while replacing the file, it holds the old settings or the new; truncated or with any byte flipped,
    --resume either sees exactly the settings written or refuses, naming the file."""
    settings = {"--seq-len": 32, "--batch-size": 4, "--layout": "documents", "--seed": 0,
                "training rows (--data)": "0123abcd"}
    path = tmp_path / "run_settings.json"
    pretrain.record_settings(tmp_path, {**settings, "--seed": 1})
    for k in kill_points(pretrain.record_settings, tmp_path, settings):
        pretrain.record_settings(tmp_path, {**settings, "--seed": 1})
        run_killed(pretrain.record_settings, tmp_path, settings, kill_at=k)
        assert json.loads(path.read_text())["--seed"] in (0, 1)
    written = path.read_bytes()
    for offset in range(len(written)):
        path.write_bytes(written)
        flipped(path, offset)
        try:
            pretrain.check_same_settings(tmp_path, settings)
        except ValueError as error:
            assert str(path) in str(error), offset
        else:
            assert json.loads(path.read_bytes()) == settings, offset
    path.write_bytes(written[:len(written) // 2])
    with pytest.raises(DamagedFileError, match=str(path)):
        pretrain.check_same_settings(tmp_path, settings)


def test_a_damaged_tokenizer_is_an_error_naming_its_directory(tmp_path):
    from hybridlm.training.tokenizer import load_tokenizer, train_bpe_tokenizer

    train_bpe_tokenizer(["def f(x):\n    return x\n"] * 8, vocab_size=260).save_pretrained(tmp_path)
    truncated(tmp_path / "tokenizer.json", 500)
    with pytest.raises(DamagedFileError, match=f"{tmp_path}: its tokenizer files cannot be read"):
        load_tokenizer(tmp_path)


def test_a_torn_last_metrics_row_is_dropped_on_resume(runs, tmp_path):
    """A kill during the append of a metrics row leaves part of it: --resume drops it with a warning and
    continues exactly."""
    out = tmp_path / "out"
    shutil.copytree(runs["half"], out)
    with (out / "metrics.jsonl").open("a") as log:
        log.write('{"step": 3, "loss": 4.1')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: dropped a partial last row"):
        model = resume(out)
    assert_same_weights(model, runs["weights"])
    assert metrics_steps(out) == [1, 2, 3, 4]


@pytest.mark.parametrize("damage", ['{"step": 1, "lo\n{"step": 2}\n', '{"step": 1}\n[2]\n', b'{"step": 1}\n\xff\n'])
def test_other_damage_to_metrics_is_an_error_naming_file_and_line(runs, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(runs["half"], out)
    (out / "metrics.jsonl").write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    with pytest.raises(DamagedFileError, match=f"{out / 'metrics.jsonl'}:[12]: not a"):
        resume(out)


def test_a_run_copied_to_another_folder_resumes_but_not_with_another_model(tmp_path):
    from hybridlm.training.checkpoint import check_resumable

    config = TrainConfig(steps=2, batch_size=2, save_every=1, log_every=1, eval_every=100)
    model = tiny_model()
    model.config._name_or_path = str(tmp_path / "first" / "transfer")  # what from_pretrained records
    train(model, tiny_rows(), config, tmp_path / "first")
    shutil.copytree(tmp_path / "first", tmp_path / "moved")
    moved = tiny_model()
    moved.config._name_or_path = str(tmp_path / "moved" / "transfer")
    assert check_resumable(tmp_path / "moved", moved) == tmp_path / "moved" / CHECKPOINT_DIR
    with pytest.raises(ValueError, match="of another model.*hidden_size"):
        check_resumable(tmp_path / "moved", tiny_model(hidden_size=48))
