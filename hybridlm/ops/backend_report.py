"""The backend report behind ``hybridlm info --backends``: per op, which backends exist, which can run on a device
type and why not, and what the current selection will use. Reads :mod:`.backends`' tables; builds and loads
nothing."""

from __future__ import annotations

import os

import torch

from hybridlm.ops.backends import (
    BACKENDS,
    ENV_VAR,
    PREFERENCE,
    current,
    default_order,
    in_use_backend_block,
    unavailable_reason,
)


def report(device: str | torch.device | None = None) -> str:
    """A table of the backends each op has, which can run on ``device`` tensors (default: CUDA if present, else
    CPU) and why not, and what each op will use. Builds and loads nothing."""
    device_type = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    selection = current()
    notes: dict[str, int] = {}

    def note(reason: str) -> str:
        return f"[{notes.setdefault(reason, len(notes) + 1)}]"

    rows = [("op", "uses", *BACKENDS)]
    for op, names in PREFERENCE.items():
        reasons = {backend: unavailable_reason(backend, op, device_type) for backend in names}
        cells = ["-" if b not in names else "yes" if reasons[b] is None else f"no {note(reasons[b])}" for b in BACKENDS]
        forced = selection.forced.get(op)
        if forced is not None:
            uses = f"{forced} (forced)" + ("" if reasons[forced] is None else f" UNAVAILABLE {note(reasons[forced])}")
        else:
            uses = " > ".join(b for b in default_order(op, device_type) if reasons[b] is None)
        rows.append((op, uses, *cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    setting = os.environ.get(ENV_VAR) or "unset"
    lines = [
        f"hybridlm ops on {device_type} tensors ({ENV_VAR}: {setting}"
        + ("; a use_backend block is active" if in_use_backend_block() else "") + ")",
        "uses: a > b means a, or b for the calls a declines;  -: no such kernel for the op",
        "",
        *("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows),
    ]
    if notes:
        lines += ["", *(f"[{number}] {reason}" for reason, number in notes.items())]
    return "\n".join(lines)
