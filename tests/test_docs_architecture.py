"""docs/architecture.md stays a complete map of the package, and the tier rules it states hold.

* Every module under ``hybridlm/`` (``__init__.py`` aside) is named in the section of the doc headed by its
  package (``### `hybridlm/kv/` ...`` for ``hybridlm/kv/paged.py``), so a new module fails until it is mapped.
* Tiers (every ``hybridlm`` import counted, lazy and ``TYPE_CHECKING`` ones included): ``ops`` imports only
  ``ops``; ``layers`` only ``ops`` and ``layers``; the state modules only ``ops`` and themselves; ``mixers`` only
  ``ops``, ``layers``, the state modules and ``mixers``. Everything else is the model tier.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridlm"
DOC = ROOT / "docs" / "architecture.md"

#: The modules of the state tier besides ``hybridlm.kv.*``; two modules in ``kv/`` are model-tier tools.
STATE_MODULES = {"hybridlm.states", "hybridlm.cache", "hybridlm.rollback"}
MODEL_TIER_IN_KV = {"hybridlm.kv.memory", "hybridlm.kv.quality"}
ALLOWED = {
    "ops": {"ops"},
    "layers": {"ops", "layers"},
    "states": {"ops", "states"},
    "mixers": {"ops", "layers", "states", "mixers"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every importable module: files in folders that are packages (not data, such as the bundled models'
    remote-code shims)."""
    def importable(path: Path) -> bool:
        return all((folder / "__init__.py").is_file() for folder in path.parents if folder.is_relative_to(PACKAGE))

    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if importable(path)}


def tier(name: str) -> str:
    for package in ("ops", "layers", "mixers"):
        if name == f"hybridlm.{package}" or name.startswith(f"hybridlm.{package}."):
            return package
    if name in STATE_MODULES or (name.startswith("hybridlm.kv") and name not in MODEL_TIER_IN_KV):
        return "states"
    return "model"


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The hybridlm modules ``path`` (module ``name``) imports; ``from X import y`` counts ``X.y`` when that is a
    module, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "hybridlm")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "hybridlm":
                source = node.module
            else:
                continue
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


def tier_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for name, imported in sorted(graph.items()):
        allowed = ALLOWED.get(tier(name))
        if allowed is None:
            continue
        problems += [f"{name} ({tier(name)}) imports {other} ({tier(other)})" for other in sorted(imported)
                     if tier(other) not in allowed]
    return problems


def doc_sections(text: str) -> dict[str, str]:
    """``{"hybridlm/kv/": section text}`` for every ``### `hybridlm/...` `` heading."""
    sections, current = {}, None
    for line in text.splitlines():
        heading = re.match(r"###\s+`(hybridlm/[\w/]*)`", line)
        if heading:
            current = heading.group(1).rstrip("/") + "/"
            sections[current] = ""
        elif line.startswith(("## ", "### ")):
            current = None
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def missing_from_doc(text: str, paths: list[Path]) -> list[str]:
    """The modules (paths relative to the repository) not named in their package's section of the doc."""
    sections = doc_sections(text)
    missing = []
    for path in paths:
        relative = path.relative_to(ROOT)
        section = sections.get(relative.parent.as_posix() + "/", "")
        if not re.search(rf"(?<!\w){re.escape(path.name)}(?!\w)", section):
            missing.append(relative.as_posix())
    return missing


def test_every_module_is_in_the_architecture_map():
    paths = [path for path in package_modules().values() if path.name != "__init__.py"]
    assert len(paths) > 100, f"found only {len(paths)} modules under {PACKAGE}"
    missing = missing_from_doc(DOC.read_text(encoding="utf-8"), paths)
    assert not missing, (f"docs/architecture.md does not name these modules in the section of their package "
                         f"(### `hybridlm/<package>/`): {', '.join(missing)}")


def test_the_doc_check_catches_a_missing_module():
    text = "### `hybridlm/kv/`\n\n| `paged.py` | pages |\n\n### `hybridlm/`\n\n| `cache.py` | the cache |\n"
    paths = [PACKAGE / "kv" / "paged.py", PACKAGE / "kv" / "base.py", PACKAGE / "cache.py", PACKAGE / "paged.py"]
    # base.py is in no section; a top-level paged.py is not mapped by kv/'s paged.py
    assert missing_from_doc(text, paths) == ["hybridlm/kv/base.py", "hybridlm/paged.py"]


def test_no_lower_tier_imports_a_higher_one():
    graph = import_graph()
    # the graph is read, not empty: edges the doc describes are found
    assert "hybridlm.ops.attention" in graph["hybridlm.mixers.attention"]
    assert "hybridlm.cache" in graph["hybridlm.mixers.mamba"]
    assert "hybridlm.ops" in graph["hybridlm.layers.conv"]
    assert "hybridlm.model" in graph["hybridlm.kv.memory"]  # a model-tier tool that lives in kv/
    assert {tier(name) for name in graph} == {"ops", "layers", "states", "mixers", "model"}
    violations = tier_violations(graph)
    assert not violations, "tier rule of docs/architecture.md broken:\n" + "\n".join(violations)


def test_the_tier_check_catches_an_upward_import():
    graph = {
        "hybridlm.ops.ssd": {"hybridlm.ops.packing", "hybridlm.mixers.base"},
        "hybridlm.layers.mlp": {"hybridlm.cache"},
        "hybridlm.kv.paged": {"hybridlm.ops", "hybridlm.model"},
        "hybridlm.mixers.mamba": {"hybridlm.cache", "hybridlm.config"},
        "hybridlm.model": {"hybridlm.mixers"},
    }
    assert tier_violations(graph) == [
        "hybridlm.kv.paged (states) imports hybridlm.model (model)",
        "hybridlm.layers.mlp (layers) imports hybridlm.cache (states)",
        "hybridlm.mixers.mamba (mixers) imports hybridlm.config (model)",
        "hybridlm.ops.ssd (ops) imports hybridlm.mixers.base (mixers)",
    ]
