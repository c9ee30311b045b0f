"""Test-wide settings.

Hypothesis runs derandomised (reproducible in CI) with no per-example deadline. Under pytest-xdist every
worker uses one intra-op thread: with several workers on few cores, OpenMP threads waiting for each other
at barriers make small ops thousands of times slower.
"""

import os
import signal

import torch
from hypothesis import settings

settings.register_profile("hybridlm", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "hybridlm"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_sessionfinish(session):
    """An xdist worker that has reported its results exits at once when interrupted.

    When a worker is still shutting down 5 s after the controller asked it to stop (a loaded machine), execnet
    sends it SIGINT; the KeyboardInterrupt lands in whatever runs, often Hypothesis's garbage-collection
    callback, and a passing run ends with its traceback. Nothing is left to report at that point."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        signal.signal(signal.SIGINT, lambda *_: os._exit(0))
