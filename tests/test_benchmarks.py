"""The benchmark scripts against the library as it is now: each imports (so every name it takes from hybridlm
still exists) and builds its command line (``--help`` exits 0 with its usage). They measure nothing here; a
rename in the library that a script missed fails here instead of in the next session's benchmark run."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: scripts whose command line is positional, for a parent process (not a user) to call
WORKERS = {"engine_worker.py", "vllm_worker.py"}


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


def test_an_engine_in_its_own_process_measures_what_it_does_in_this_one(tmp_path, monkeypatch):
    """``cpu_peers.py --turns whole`` times each engine in ``engine_worker.py``: the worker's engine must be the
    one the spec names, so its greedy tokens, log-probabilities and decode steps are this process's own."""
    from tests.helpers import random_ids, tiny_model

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))  # the workers' logs
    peers = load(BENCHMARKS / "peer_engines.py")
    tiny_model(seed=3).save_pretrained(tmp_path / "model")
    spec = {"kind": "hybridlm", "directory": str(tmp_path / "model"), "dtype": "f32", "headroom": 16,
            "compiled": False}
    local = peers.build(spec)
    prompt = random_ids(1, 12, seed=4)[0].tolist()
    remote = peers.RemoteEngine(spec, threads=1, label="test")
    try:
        expected = local.greedy(prompt, 8)
        assert remote.greedy(prompt, 8) == expected
        assert len(set(expected)) > 1  # a model stuck on one token would make the comparison weak
        log_probs = local.log_probs(prompt)
        assert torch.equal(remote.log_probs(prompt), log_probs)
        assert log_probs.std() > 0
        remote.begin([prompt])
        times = remote.decode_ms(2, 3)
        assert len(times) == 3 and all(t > 0 for t in times)
        with pytest.raises(RuntimeError, match="unknown op 'step'.*worker-test.log"):
            remote._call("step", [1])  # only the measurements cross the pipe; the worker's log is named
        assert remote.greedy(prompt, 8) == expected  # and the worker goes on after a failure
    finally:
        remote.close()
    with pytest.raises(ValueError, match="unknown engine kind 'onnx'"):
        peers.build({"kind": "onnx"})
