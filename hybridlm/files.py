"""Crash-safe writes and verified reads of the files hybridlm writes (stdlib, torch and safetensors only, both
imported on first use).

A file is written aside (a temporary file in its directory), fsynced, renamed over the old one, and its directory
fsynced: a kill at any point leaves the old file or the new one, whole. A directory (a training checkpoint) is
staged as ``NAME.tmp``, closed by a manifest of its files' sizes and sha256 digests, and published by renames:
the old one becomes ``NAME.old`` and is deleted only once the new one is in place. :func:`recover_directory`
finishes or undoes whatever a kill left. Every read error names the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"


class DamagedFileError(ValueError):
    """A file that is not what was written (truncated, altered, unreadable); the message names it."""


# --- writing ------------------------------------------------------------------------------------


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def written_aside(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends without an error it is fsynced and
    renamed over ``path`` (else removed)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")  # one per writer
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask's mode, as open() gives
    try:
        yield temporary
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_file(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace ``path`` by ``data`` (text is written as UTF-8) crash-safely."""
    with written_aside(path) as temporary:
        temporary.write_bytes(data.encode() if isinstance(data, str) else data)


def save_pretrained_aside(obj, directory: str | os.PathLike, **kwargs) -> None:
    """``obj.save_pretrained(directory, **kwargs)`` with every file written aside and renamed into place."""
    directory = Path(directory)
    staging = directory / ".save_pretrained.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # left by a save a kill interrupted
    staging.mkdir(parents=True)
    try:
        obj.save_pretrained(staging, **kwargs)
        for file in sorted(staging.iterdir()):
            fsync_path(file)
            os.replace(file, directory / file.name)
        fsync_path(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def torch_bytes(obj) -> bytes:
    """``torch.save`` of ``obj``, as bytes."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --- reading ------------------------------------------------------------------------------------


def parse_json(data: bytes, path: str | os.PathLike):
    """The JSON value ``data`` read from ``path`` (named in errors)."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedFileError(f"{path}: not valid JSON ({error})") from None


def read_json(path: str | os.PathLike):
    """The JSON value in ``path``."""
    return parse_json(Path(path).read_bytes(), path)


def load_safetensors(data: bytes, path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a safetensors file read as ``data`` from ``path`` (named in errors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        (length,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8:8 + length]).get("__metadata__") or {}
        return load(data), metadata
    except (struct.error, ValueError, AttributeError, SafetensorError) as error:
        raise DamagedFileError(f"{path}: not a complete safetensors file ({error})") from None


def load_torch(data: bytes, path: str | os.PathLike):
    """The tensors-only object (``weights_only=True``) that :func:`torch_bytes` wrote, read from ``path``."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # torch raises several kinds (RuntimeError, UnpicklingError, EOFError, ...)
        raise DamagedFileError(f"{path}: not a complete torch file ({type(error).__name__}: {error})") from None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- directories --------------------------------------------------------------------------------


def staging_path(final: str | os.PathLike) -> Path:
    """Where the next version of directory ``final`` is written before it is published."""
    return Path(final).with_name(Path(final).name + ".tmp")


def _siblings(final: Path) -> tuple[Path, Path]:
    """Where a new version of ``final`` is staged, and where the old one waits for its deletion."""
    return staging_path(final), final.with_name(final.name + ".old")


def _complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def staged_directory(final: str | os.PathLike) -> Path:
    """An empty directory to write the next version of ``final`` in (after :func:`recover_directory`)."""
    final = Path(final)
    recover_directory(final)
    staged, _ = _siblings(final)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def publish_directory(final: str | os.PathLike) -> None:
    """Close the staged version of ``final`` with its manifest and put it in place of the old one."""
    final = Path(final)
    staged, _ = _siblings(final)
    files = sorted(path for path in staged.rglob("*") if path.is_file())
    manifest = {path.relative_to(staged).as_posix(): {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
                for path in files}
    for directory in {path.parent for path in files} - {staged}:
        fsync_path(directory)
    write_file(staged / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    _publish(final)


def _publish(final: Path) -> None:
    staged, old = _siblings(final)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # left by an interrupted publish: ``final`` is complete
        os.rename(final, old)
        fsync_path(final.parent)
    os.rename(staged, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_directory(final: str | os.PathLike) -> None:
    """Bring ``final`` back to one complete version after a kill during a publish: a complete staged version is
    published, a partial one deleted, and the old version put back if nothing newer is in place."""
    final = Path(final)
    staged, old = _siblings(final)
    if _complete(staged):
        _publish(final)
    else:
        shutil.rmtree(staged, ignore_errors=True)
    if not final.exists() and _complete(old):
        os.rename(old, final)
        fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recoverable(final: str | os.PathLike) -> list[Path]:
    """The complete versions of ``final`` on disk (what :func:`recover_directory` would keep one of)."""
    final = Path(final)
    return ([final] if final.exists() else []) + [path for path in _siblings(final) if _complete(path)]


def read_manifest(directory: str | os.PathLike) -> dict | None:
    """The manifest of a published directory (None for a directory written before manifests existed)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path)
    if not (isinstance(manifest, dict) and all(
            isinstance(entry, dict) and entry.keys() == {"bytes", "sha256"} for entry in manifest.values())):
        raise DamagedFileError(f"{path}: not a manifest ({{file: {{'bytes', 'sha256'}}}})")
    return manifest


def read_checked(directory: str | os.PathLike, name: str, manifest: dict | None) -> bytes:
    """The bytes of ``directory/name`` (one read), checked against the directory's manifest when it has one."""
    path = Path(directory) / name
    if not path.is_file():
        raise DamagedFileError(f"{path}: missing")
    data = path.read_bytes()
    if manifest is None:
        return data
    expected = manifest.get(name)
    if expected is None:
        raise DamagedFileError(f"{path}: not listed in {Path(directory) / MANIFEST}")
    if len(data) != expected["bytes"]:
        raise DamagedFileError(f"{path}: {len(data):,} bytes, {expected['bytes']:,} written (truncated or altered)")
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise DamagedFileError(f"{path}: its sha256 differs from the one written (the file was altered)")
    return data


def verify_directory(directory: str | os.PathLike) -> None:
    """Check every file the manifest of ``directory`` lists (for files another library reads itself)."""
    for name, expected in (read_manifest(directory) or {}).items():
        path = Path(directory) / name
        if not path.is_file() or path.stat().st_size != expected["bytes"] or sha256_of(path) != expected["sha256"]:
            raise DamagedFileError(f"{path}: missing, truncated or altered (it differs from {MANIFEST})")
