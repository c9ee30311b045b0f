"""Several mixers on the same input, outputs summed (Falcon-H1 runs attention and Mamba-2 in every layer).

A ``layer_types`` entry such as ``"attention+mamba2"`` builds a :class:`ParallelMixer`; its state is a
:class:`~hybridlm.cache.StateGroup` with one part per branch, so every branch keeps its own state in the cache.
"""

from __future__ import annotations

from ..cache import StateGroup
from .base import MIXERS, Mixer
from .segments import mix


class ParallelMixer(Mixer):
    """``sum(branch(x))`` over one mixer per kind; each branch is a submodule named by its kind
    (``mixer.attention.q_proj``, ``mixer.mamba2.in_proj``)."""

    def __init__(self, config, layer_idx: int, kinds: list[str]):
        super().__init__()
        self.kind = "+".join(kinds)
        self.kinds = list(kinds)
        for kind in kinds:
            self.add_module(kind, MIXERS[kind](config, layer_idx))

    def branches(self) -> list[tuple[str, Mixer]]:
        return [(kind, getattr(self, kind)) for kind in self.kinds]

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> StateGroup:
        return StateGroup({kind: branch.init_state(batch_size, max_length, device, dtype)
                           for kind, branch in self.branches()})

    def forward(self, x, state: StateGroup | None = None, *, mask=None, positions=None, segments=None):
        outputs = [mix(branch, x, state.parts[kind] if state is not None else None, mask=mask, positions=positions,
                       segments=segments) for kind, branch in self.branches()]
        return sum(outputs[1:], outputs[0])


def build_mixer(parts: list[str], config, layer_idx: int) -> Mixer | None:
    """The mixer of a layer whose ``layer_types`` entry has mixers ``parts`` (``hybridlm.config.mixer_parts``):
    None for none (an MLP-only layer), the registered kind for one, a :class:`ParallelMixer` for several."""
    if not parts:
        return None
    if len(parts) == 1:
        return MIXERS[parts[0]](config, layer_idx)
    return ParallelMixer(config, layer_idx, parts)
