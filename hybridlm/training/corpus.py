"""Text corpora: files, directories or globs, and the default that needs no download — the Python standard
library shipped with the interpreter (its sources, and its documentation in ``pydoc_data/topics.py``).

A corpus is a list of documents (one per file) split into a training and a held-out part.
"""

from __future__ import annotations

import glob
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# The standard-library files held out for evaluation (paths relative to the stdlib directory). Fixed and
# present in every CPython >= 3.10, so held-out numbers are comparable between runs and machines.
HELD_OUT_STDLIB = (
    "argparse.py", "csv.py", "dataclasses.py", "difflib.py", "fractions.py", "heapq.py", "json/decoder.py",
    "json/encoder.py", "pathlib.py", "statistics.py", "textwrap.py", "zipfile.py",
)
_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Corpus:
    """Documents as text, each with the path it came from."""

    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]

    @property
    def train_texts(self) -> list[str]:
        return [text for _, text in self.train]

    @property
    def held_out_texts(self) -> list[str]:
        return [text for _, text in self.held_out]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus() -> Corpus:
    """Every ``.py`` file of the standard library outside test directories and site-packages, in sorted order;
    the files of :data:`HELD_OUT_STDLIB` form the held-out part."""
    root = stdlib_root()
    held_out, train = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _EXCLUDED_DIRS & set(relative.parts[:-1]):
            continue
        document = (relative.as_posix(), _read(path))
        (held_out if relative.as_posix() in HELD_OUT_STDLIB else train).append(document)
    if not train or not held_out:
        raise FileNotFoundError(f"no standard-library sources found under {root}")
    return Corpus(train, held_out)


def expand_paths(specs: list[str], option: str = "--data") -> list[Path]:
    """Files named by ``specs``: files, directories (every file below, recursively) or glob patterns; ``option``
    is the command-line option named in errors."""
    files: list[Path] = []
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            if not found:
                raise FileNotFoundError(f"{option} {spec!r}: the directory holds no files")
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"{option} {spec!r}: no such file, directory or matching files")
        files += found
    return files


def text_corpus(train_specs: list[str], held_out_specs: list[str] | None = None,
                held_out_fraction: float = 0.02) -> Corpus:
    """Documents from files; held out: ``held_out_specs`` if given, else every ``1/held_out_fraction``-th file."""
    files = expand_paths(train_specs)
    documents = [(str(p), _read(p)) for p in files]
    documents = [d for d in documents if d[1].strip()]
    if not documents:
        raise ValueError(f"--data {train_specs}: the files are empty")
    if held_out_specs:
        held_out = [(str(p), _read(p)) for p in expand_paths(held_out_specs, "--eval-data")]
        if not any(text.strip() for _, text in held_out):
            raise ValueError(f"--eval-data {held_out_specs}: the files are empty")
        return Corpus(documents, held_out)
    step = max(2, round(1 / held_out_fraction))
    held_out = documents[::step]
    train = [d for i, d in enumerate(documents) if i % step]
    if not train:
        raise ValueError(f"--data {train_specs}: too few files to hold some out; pass --eval-data")
    return Corpus(train, held_out)
