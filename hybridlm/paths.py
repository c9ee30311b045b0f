"""Telling a local checkpoint path from a hub id (or a GGUF file), without importing torch or transformers: the
loader (:func:`hybridlm.formats.base.resolve_directory`) and the command line (which answers a mistyped path
before it imports anything heavy) share it."""

from __future__ import annotations

import os
from pathlib import Path


def looks_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` can only mean a local directory: absolute, starting with ``.`` or ``~``, or inside a
    directory that exists here (``checkpoints/run1`` when ``checkpoints/`` exists). A hub id is
    ``name`` or ``owner/name``."""
    text = os.fspath(path)
    local = Path(text)
    return (local.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text
            or (len(local.parts) > 1 and local.parent.is_dir()))


def local_directory(path: str | os.PathLike) -> Path | None:
    """``path`` as a local directory; None when it is not one here but may be a hub id. Raises when it names a
    file, or cannot be a hub id (:func:`looks_local`) and does not exist."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"{path} is a file; a checkpoint is a directory holding config.json and weights")
    if looks_local(path):
        raise FileNotFoundError(f"directory {path} does not exist")
    return None


def existing_config(path: str | os.PathLike, option: str) -> Path:
    """The ``config.json`` that ``path`` names (that file, or a directory holding one); raises naming ``option``
    when there is none."""
    given = Path(path).expanduser()
    if not given.exists():
        raise FileNotFoundError(f"{option} {path}: no such file or directory")
    file = given / "config.json" if given.is_dir() else given
    if not file.is_file():
        raise FileNotFoundError(f"{option} {path}: no config.json in that directory")
    return file


def split_gguf_path(path: str | os.PathLike, gguf_file: str | None) -> tuple[Path, str] | None:
    """``(directory, file name)`` when ``path`` (or ``path / gguf_file``) is a GGUF file; None otherwise."""
    given = Path(path).expanduser()
    if gguf_file is not None:
        file = given / gguf_file if given.is_dir() else given
        if given.is_file() and given.name != Path(gguf_file).name:
            raise ValueError(f"{given} is a file and gguf_file={gguf_file!r} names another")
    elif given.suffix == ".gguf":
        file = given
    else:
        return None
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {file} does not exist")
    return file.parent, file.name
