"""Test-wide settings.

Hypothesis runs derandomised (reproducible in CI) with no per-example deadline. Under pytest-xdist every
worker uses one intra-op thread: with several workers on few cores, OpenMP threads waiting for each other
at barriers make small ops thousands of times slower.
"""

import os

import torch
from hypothesis import settings

settings.register_profile("hybridlm", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "hybridlm"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
