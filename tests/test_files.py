"""hybridlm.files: a file or a set of files written with it holds the old bytes or the new, whole, after a kill
at any file-system step; reads name the file."""

from __future__ import annotations

import pytest

from hybridlm.files import DamagedFileError, load_safetensors, read_json, save_pretrained_aside, write_file

from .fault_injection import kill_points, run_killed


def test_a_file_written_crash_safely_is_old_or_new_after_a_kill(tmp_path):
    path = tmp_path / "data.bin"
    old, new = b"old" * 1000, b"new" * 2000
    seen = set()
    for k in kill_points(write_file, tmp_path / "count.bin", new):
        path.write_bytes(old)
        run_killed(write_file, path, new, kill_at=k)
        assert path.read_bytes() in (old, new), k
        seen.add(path.read_bytes())
    assert seen == {old, new}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "settings.json"
    write_file(path, "{}")

    class Unencodable(str):
        def encode(self, *args):
            raise RuntimeError("cannot encode")

    with pytest.raises(RuntimeError, match="cannot encode"):
        write_file(path, Unencodable("[]"))
    assert path.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["settings.json"]


def test_a_file_written_aside_gets_the_mode_open_gives(tmp_path):
    """Not a temporary file's owner-only mode: checkpoints and bundled models are read by others too."""
    (tmp_path / "plain").write_bytes(b"")
    write_file(tmp_path / "aside", b"")
    assert (tmp_path / "aside").stat().st_mode == (tmp_path / "plain").stat().st_mode


class TwoFiles:
    """Stands in for a tokenizer or a model: ``save_pretrained`` writes two files."""

    def __init__(self, text: str):
        self.text = text

    def save_pretrained(self, directory):
        (directory / "tokenizer.json").write_text(self.text * 100)
        (directory / "tokenizer_config.json").write_text(self.text)


def test_save_pretrained_aside_leaves_each_file_old_or_new_after_a_kill(tmp_path):
    directory = tmp_path / "tokenizer"
    for k in kill_points(save_pretrained_aside, TwoFiles("new"), tmp_path / "count"):
        save_pretrained_aside(TwoFiles("old"), directory)
        run_killed(save_pretrained_aside, TwoFiles("new"), directory, kill_at=k)
        assert (directory / "tokenizer.json").read_text() in ("old" * 100, "new" * 100), k
        assert (directory / "tokenizer_config.json").read_text() in ("old", "new"), k
    save_pretrained_aside(TwoFiles("new"), directory)  # a later save clears what a killed one left
    assert sorted(p.name for p in directory.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_reads_name_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"a": ')
    with pytest.raises(DamagedFileError, match=f"{path}: not valid JSON"):
        read_json(path)
    with pytest.raises(DamagedFileError, match=f"{path}: not a complete safetensors file"):
        load_safetensors(b"\x10\x00\x00\x00\x00\x00\x00\x00{}", path)
