"""Several mixers on the same input, outputs summed (Falcon-H1 runs attention and Mamba-2 in every layer), and
the resolution of a ``layer_types`` entry to the mixer class that runs it.

A ``layer_types`` entry such as ``"attention+mamba2"`` is run by a :class:`ParallelMixer` subclass made for
those parts; its properties combine theirs (causal if all are, the smallest position limit, a growing state if
any grows), and its state is a :class:`~hybridlm.cache.StateGroup` with one part per branch, so every branch
keeps its own state in the cache.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from hybridlm.cache import StateGroup
from hybridlm.mixers.base import MIXERS, Mixer
from hybridlm.mixers.segments import mix


def mixer_parts(entry: str) -> list[str]:
    """The mixers of a ``layer_types`` entry: ``"none"`` (an MLP-only layer) has none; ``"attention+mamba2"``
    runs both on the same input and sums their outputs (Falcon-H1)."""
    return [] if entry == "none" else entry.split("+")


def mixer_class(entry: str) -> type[Mixer] | None:
    """The class that runs a ``layer_types`` entry: None for ``"none"``, the registered class for one kind, a
    :class:`ParallelMixer` subclass for several. ValueError for an unknown or repeated kind."""
    parts = mixer_parts(entry)
    unknown = [part for part in parts if part not in MIXERS]
    if unknown or len(set(parts)) != len(parts):
        problem = f"unknown mixer kind(s) {unknown}" if unknown else "a kind appears twice"
        raise ValueError(f"{problem}; an entry is a registered mixer kind {tuple(MIXERS)}, distinct kinds joined "
                         "by '+' (run in parallel), or 'none' (an MLP-only layer)")
    if not parts:
        return None
    return MIXERS[parts[0]] if len(parts) == 1 else _parallel_class(tuple(parts))


class ParallelMixer(Mixer):
    """``sum(branch(x))`` over one mixer per kind in :attr:`kinds`; each branch is a submodule named by its kind
    (``mixer.attention.q_proj``, ``mixer.mamba2.in_proj``). Built through :func:`mixer_class`."""

    kinds: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        if not self.kinds:
            raise TypeError("ParallelMixer is built through mixer_class('kind_a+kind_b')")
        for kind in self.kinds:
            self.add_module(kind, MIXERS[kind](config, layer_idx))

    @classmethod
    def parts(cls) -> list[type[Mixer]]:
        return [MIXERS[kind] for kind in cls.kinds]

    @classmethod
    def is_causal(cls, config) -> bool:
        return all(part.is_causal(config) for part in cls.parts())

    @classmethod
    def max_positions(cls, config) -> int | None:
        limits = [limit for part in cls.parts() if (limit := part.max_positions(config)) is not None]
        return min(limits) if limits else None

    @classmethod
    def check_config(cls, config) -> None:
        for part in cls.parts():
            part.check_config(config)

    @classmethod
    def state_settings(cls, config) -> tuple:
        return tuple((part.kind, part.state_settings(config)) for part in cls.parts())

    def branches(self) -> list[tuple[str, Mixer]]:
        return [(kind, getattr(self, kind)) for kind in self.kinds]

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> StateGroup:
        return StateGroup({kind: branch.init_state(batch_size, max_length, device, dtype)
                           for kind, branch in self.branches()})

    def forward(self, x, state: StateGroup | None = None, *, mask=None, positions=None, segments=None):
        outputs = [mix(branch, x, state.parts[kind] if state is not None else None, mask=mask, positions=positions,
                       segments=segments) for kind, branch in self.branches()]
        return sum(outputs[1:], outputs[0])


@functools.cache
def _parallel_class(kinds: tuple[str, ...]) -> type[ParallelMixer]:
    parts = [MIXERS[kind] for kind in kinds]
    fields = tuple(dict.fromkeys(field for part in parts for field in part.config_fields))
    return type("ParallelMixer", (ParallelMixer,), {
        "kinds": kinds,
        "kind": "+".join(kinds),
        "config_fields": fields,
        "state_fields": tuple(dict.fromkeys(field for part in parts for field in part.state_fields)),
        "grows_with_context": any(part.grows_with_context for part in parts),
        "__doc__": f"{' + '.join(kinds)}: outputs summed.",
        "__module__": __name__,
    })


def build_mixer(entry: str, config, layer_idx: int) -> Mixer | None:
    """The mixer of a layer whose ``layer_types`` entry is ``entry`` (None for an MLP-only layer)."""
    cls = mixer_class(entry)
    return cls(config, layer_idx) if cls is not None else None
