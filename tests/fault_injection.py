"""Faults for the tests of the files hybridlm writes: a kill at a chosen file-system step of a write, a file
truncated or with a byte flipped, and a file replaced by another the moment it is opened.

A write is killed in a forked copy of the test process: the child counts its calls of :data:`STEPS` (the
``os`` functions every write goes through: creating, syncing, renaming and deleting files and directories)
and ends with ``os._exit`` just before the ``kill_at``-th, so the disk holds what a kill at that point leaves.
"""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

STEPS = ("open", "fsync", "replace", "rename", "unlink", "rmdir", "mkdir")
KILLED = 77


def run_killed(action: Callable[..., object], *args, kill_at: int | None = None) -> int:
    """Run ``action(*args)`` in a forked child killed just before its ``kill_at``-th file-system step (0-based;
    never when None). Returns the steps the child took: ``kill_at`` when killed, all of them when it finished."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(read_end)
        taken = [0]

        def counted(function):
            def step(*args, **kwargs):
                if taken[0] == kill_at:
                    os.write(write_end, str(taken[0]).encode())
                    os._exit(KILLED)
                taken[0] += 1
                return function(*args, **kwargs)
            return step

        for name in STEPS:
            setattr(os, name, counted(getattr(os, name)))
        try:
            action(*args)
            os.write(write_end, str(taken[0]).encode())
            os._exit(0)
        except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails the test
            os.write(write_end, f"error {error!r}".encode())
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) in (0, KILLED), f"the child failed: {report}"
    return int(report)


def kill_points(action: Callable[..., object], *args) -> range:
    """Every step at which ``action(*args)`` can be killed: ``range(steps + 1)``, the last being 'not killed'."""
    return range(run_killed(action, *args) + 1)


def truncated(path: Path, length: int) -> None:
    path.write_bytes(path.read_bytes()[:length])


def flipped(path: Path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


@contextmanager
def replaced_when_opened(path: Path, other: Path):
    """While active, each time anything opens ``path`` for reading, ``other``'s bytes are renamed over
    ``path`` right after (as a concurrent writer would); the opener keeps what it opened."""
    import safetensors
    import safetensors.torch

    target = os.fspath(path)

    def swap():
        staging = path.with_name(path.name + ".swap")
        staging.write_bytes(other.read_bytes())
        os.replace(staging, path)

    def swapping(opener):
        def opened(file, *args, **kwargs):
            handle = opener(file, *args, **kwargs)
            if os.fspath(file) == target:
                swap()
            return handle
        return opened

    originals = [(builtins, "open"), (io, "open"), (safetensors, "safe_open"), (safetensors.torch, "load_file"),
                 (safetensors.torch, "safe_open")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in originals]
    try:
        for owner, name, function in saved:
            setattr(owner, name, swapping(function))
        yield
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)
