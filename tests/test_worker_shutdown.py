"""A passing run under pytest-xdist prints no KeyboardInterrupt traceback, even when a worker is slow to exit
(execnet interrupts it after 5 s; see ``pytest_sessionfinish`` in conftest.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_slow_worker_shutdown_prints_no_keyboard_interrupt(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import gc, time
        from tests.conftest import pytest_sessionfinish  # the hook under test

        def pytest_unconfigure(config):  # a worker still collecting garbage when execnet interrupts it
            if hasattr(config, "workerinput"):
                end = time.monotonic() + 8
                while time.monotonic() < end:
                    gc.collect()
        """))
    (tmp_path / "test_example.py").write_text(textwrap.dedent("""
        from hypothesis import given, strategies as st

        @given(st.integers())  # installs Hypothesis's gc callback, where the interrupt used to land
        def test_int(x):
            assert x == x
        """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "1 passed" in output
    assert "KeyboardInterrupt" not in output, output
