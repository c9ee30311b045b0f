"""Test-wide settings: hypothesis runs derandomised (reproducible in CI) with no per-example deadline."""

import os

from hypothesis import settings

settings.register_profile("hybridlm", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "hybridlm"))
