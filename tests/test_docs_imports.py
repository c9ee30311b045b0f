"""Every hybridlm name the README and docs/ show resolves: the import lines, and the dotted names in the text
(`hybridlm.decoding.incremental.IncrementalDecoder`, `python -m hybridlm.training.policy_quality`), so that moving
a module changes the docs with it."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORT = re.compile(r"^\s*(?:>>> )?from (hybridlm[\w.]*) import \(?([\w, ]+)", re.M)
DOTTED = re.compile(r"(?<![\w./])hybridlm(?:\.\w+)+")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown_names() -> list[tuple[str, str]]:
    """``(doc, dotted name)`` for every name shown: ``from X import a, b`` as ``X.a`` and ``X.b``."""
    found = set()
    for path in docs():
        text = path.read_text(encoding="utf-8")
        for module, names in IMPORT.findall(text):
            found.update((path.name, f"{module}.{name.strip().split(' as ')[0]}") for name in names.split(",")
                         if name.strip())
        found.update((path.name, name.rstrip(".")) for name in DOTTED.findall(text))
    return sorted(found)


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute chain of the longest module it starts with."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            continue
        value = importlib.import_module(module)
        for attribute in parts[split:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def test_the_docs_show_names_and_the_check_catches_a_stale_one():
    assert len(shown_names()) > 50
    assert resolves("hybridlm.decoding.incremental.IncrementalDecoder")
    assert not resolves("hybridlm.generation.IncrementalDecoder")  # the module before the move
    assert not resolves("hybridlm.cache.HybridCache.no_such_method")


@pytest.mark.parametrize(("doc", "name"), shown_names())
def test_a_name_the_docs_show_resolves(doc, name):
    assert resolves(name), f"{doc} shows {name}, which does not resolve"
