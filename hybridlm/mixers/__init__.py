"""Sequence mixers behind one contract (see :mod:`hybridlm.mixers.base`), registered by name."""

from . import attention, linformer, mamba, mamba2, performer  # noqa: F401  (each registers itself)
from .base import MIXERS, Mixer, register
from .parallel import ParallelMixer, build_mixer

__all__ = ["MIXERS", "Mixer", "ParallelMixer", "build_mixer", "register"]
