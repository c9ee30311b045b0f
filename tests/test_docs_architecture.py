"""docs/architecture.md stays a complete map of the package, and the layering it states holds.

* Every module under ``hybridlm/`` (``__init__.py`` aside) is named in the section of the doc headed by its
  package (``### `hybridlm/cache/kv/` ...`` for ``hybridlm/cache/kv/paged.py``), so a new module fails until it
  is mapped.
* Tiers (every ``hybridlm`` import counted, lazy and ``TYPE_CHECKING`` ones included): each package (and each
  small top-level module) imports only the tiers listed for it in :data:`ALLOWED`.
* No import cycles in ``hybridlm/`` or ``benchmarks/``, counting lazy imports and the package ``__init__`` that
  importing ``a.b.c`` runs first (``a/b/__init__.py``), as Python does.
* ``tests/`` mirrors the package: each folder of tests is named for a package of ``hybridlm``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridlm"
DOC = ROOT / "docs" / "architecture.md"

#: The tier of each top-level module (the packages are their own tier).
TOP_LEVEL_TIERS = {"options": "base", "paths": "base", "files": "base", "remote_code": "base",
                   "config": "config", "config_rules": "config", "presets": "config", "bundled": "model"}
_BELOW_CONFIG = {"base", "ops", "layers", "cache", "mixers"}
#: What each tier may import, bottom up: ops < layers, cache (side by side) < mixers < config < formats < model
#: < decoding < training < cli. The root ``hybridlm/__init__.py`` (tier "api") may import anything.
ALLOWED = {
    "base": {"base"},
    "ops": {"base", "ops"},
    "layers": {"base", "ops", "layers"},
    "cache": {"base", "ops", "cache"},
    "mixers": {"base", "ops", "layers", "cache", "mixers"},
    "config": _BELOW_CONFIG | {"config"},
    "formats": _BELOW_CONFIG | {"config", "formats"},
    "model": _BELOW_CONFIG | {"config", "formats", "model"},
    "decoding": _BELOW_CONFIG | {"config", "formats", "model", "decoding"},
    "training": _BELOW_CONFIG | {"config", "formats", "model", "decoding", "training"},
    "cli": _BELOW_CONFIG | {"config", "formats", "model", "decoding", "training", "cli"},
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(folder: Path) -> dict[str, Path]:
    """Every importable module under ``folder``: files in folders that are packages (not data, such as the
    bundled models' remote-code shims)."""
    def importable(path: Path) -> bool:
        return all((parent / "__init__.py").is_file() for parent in path.parents if parent.is_relative_to(folder))

    return {module_name(path): path for path in sorted(folder.rglob("*.py")) if importable(path)}


def package_modules() -> dict[str, Path]:
    return modules_under(PACKAGE)


def tier(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "api"
    return TOP_LEVEL_TIERS.get(parts[1], parts[1])


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports, anywhere in it; ``from X import y``
    counts ``X.y`` when that is a module, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    roots = {module.split(".")[0] for module in known}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] in roots)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] in roots:
                source = node.module
            else:
                continue
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return found & known


def graph_of(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


def import_graph() -> dict[str, set[str]]:
    return graph_of(package_modules())


def with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` plus what Python runs first when ``m`` imports ``a.b.c``: the packages ``a`` and ``a.b``, unless
    ``m`` is inside them already (their ``__init__`` is then running or done)."""
    full = {}
    for name, imported in graph.items():
        own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 2)}
        edges = set(imported)
        for other in imported:
            parts = other.split(".")
            edges.update(parent for parent in (".".join(parts[:k]) for k in range(1, len(parts)))
                         if parent in graph and parent not in own)
        full[name] = edges - {name}
    return full


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for other in edges:
                if other not in graph:
                    continue
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph[other]))))
                    break
                if other in on_stack:
                    low[node] = min(low[node], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


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
    """``{"hybridlm/cache/kv/": section text}`` for every ``### `hybridlm/...` `` heading."""
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
    text = "### `hybridlm/cache/kv/`\n\n| `paged.py` | pages |\n\n### `hybridlm/`\n\n| `config.py` | the config |\n"
    kv = PACKAGE / "cache" / "kv"
    paths = [kv / "paged.py", kv / "base.py", PACKAGE / "config.py", PACKAGE / "paged.py"]
    # base.py is in no section; a top-level paged.py is not mapped by kv/'s paged.py
    assert missing_from_doc(text, paths) == ["hybridlm/cache/kv/base.py", "hybridlm/paged.py"]


def test_no_lower_tier_imports_a_higher_one():
    graph = import_graph()
    # the graph is read, not empty: edges the doc describes are found, lazy ones included
    assert "hybridlm.ops.attention" in graph["hybridlm.mixers.attention"]
    assert "hybridlm.cache" in graph["hybridlm.mixers.mamba"]
    assert "hybridlm.ops" in graph["hybridlm.layers.conv"]
    assert "hybridlm.model" in graph["hybridlm.model.memory"]  # a lazy import
    assert {tier(name) for name in graph} == set(ALLOWED) | {"api"}
    violations = tier_violations(graph)
    assert not violations, "tier rule of docs/architecture.md broken:\n" + "\n".join(violations)


def test_the_tier_check_catches_an_upward_import():
    graph = {
        "hybridlm.ops.ssd": {"hybridlm.ops.packing", "hybridlm.mixers.base"},
        "hybridlm.layers.mlp": {"hybridlm.cache"},
        "hybridlm.cache.kv.paged": {"hybridlm.ops", "hybridlm.model"},
        "hybridlm.mixers.mamba": {"hybridlm.cache", "hybridlm.config"},
        "hybridlm.model.modeling": {"hybridlm.mixers", "hybridlm.decoding.incremental"},
        "hybridlm.training.loop": {"hybridlm.model", "hybridlm.cli.common"},
        "hybridlm.cli.main": {"hybridlm.training", "hybridlm.options"},
    }
    assert tier_violations(graph) == [
        "hybridlm.cache.kv.paged (cache) imports hybridlm.model (model)",
        "hybridlm.layers.mlp (layers) imports hybridlm.cache (cache)",
        "hybridlm.mixers.mamba (mixers) imports hybridlm.config (config)",
        "hybridlm.model.modeling (model) imports hybridlm.decoding.incremental (decoding)",
        "hybridlm.ops.ssd (ops) imports hybridlm.mixers.base (mixers)",
        "hybridlm.training.loop (training) imports hybridlm.cli.common (cli)",
    ]


def test_no_import_cycles_in_the_package_or_the_benchmarks():
    benchmarks = {f"benchmarks.{path.stem}": path for path in sorted((ROOT / "benchmarks").glob("*.py"))}
    for folder, modules in ((PACKAGE, package_modules()), (ROOT / "benchmarks", benchmarks)):
        graph = with_package_inits(graph_of(modules))
        assert sum(map(len, graph.values())) >= 5, f"the import graph of {folder} is empty"
        cycles = import_cycles(graph)
        assert not cycles, f"import cycles in {folder.name}/:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_catches_lazy_imports_and_package_inits(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def later():\n    from pkg.a import x  # lazy: still a cycle\n",
        "c.py": "from pkg.sub.leaf import y\n",  # runs pkg/sub/__init__.py first, which imports c
        "sub/__init__.py": "from pkg import c\n",
        "sub/leaf.py": "y = 1\n",
        "sub/inner.py": "from pkg.sub.leaf import y\n",  # inside pkg.sub: its __init__ adds no edge
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = graph_of({module_name(path, tmp_path): path for path in package.rglob("*.py")})
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert import_cycles(with_package_inits(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub"]]


def test_the_tests_mirror_the_package():
    folders = sorted(path.parent.name for path in (ROOT / "tests").glob("*/__init__.py"))
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders, "no test folders found"
    assert set(folders) <= packages, f"test folders without a package: {sorted(set(folders) - packages)}"
    assert (ROOT / "tests" / "cache" / "kv" / "__init__.py").is_file()  # subpackages too
