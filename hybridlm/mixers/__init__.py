"""Sequence mixers behind one contract (see :mod:`hybridlm.mixers.base`), registered by name, and Zamba2's shared
blocks built from them. May import the ops, the layers and the cache's state types; nothing else of hybridlm."""

from hybridlm.mixers import (  # noqa: F401  (each registers itself)
    attention,
    gated_deltanet,
    kda,
    linformer,
    mamba,
    mamba2,
    mamba3,
    mla,
    performer,
    short_conv,
)
from hybridlm.mixers.base import MIXERS, Mixer, invalid_config, pattern_letters, register
from hybridlm.mixers.parallel import ParallelMixer, build_mixer, mixer_class, mixer_parts

__all__ = ["MIXERS", "Mixer", "ParallelMixer", "build_mixer", "invalid_config", "mixer_class", "mixer_parts",
           "pattern_letters", "register"]
