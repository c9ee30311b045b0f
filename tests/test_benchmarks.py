"""The benchmark scripts against the library as it is now: each imports (so every name it takes from hybridlm
still exists) and builds its command line (``--help`` exits 0 with its usage). They measure nothing here; a
rename in the library that a script missed fails here instead of in the next session's benchmark run."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: scripts whose command line is positional, for a parent process (not a user) to call
WORKERS = {"vllm_worker.py"}


def load(path: Path):
    """``path`` imported as a module of its own, as ``python path`` would run it but for ``__main__``."""
    name = f"benchmark_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_a_benchmark_script_imports_and_parses_its_command_line(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their sibling modules
    module = load(BENCHMARKS / script)
    main = getattr(module, "main", None)
    if script in WORKERS:
        assert callable(main)
        return  # its arguments come from a parent process
    if main is None:
        return  # a helper module of the scripts: importing it is the check
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out
