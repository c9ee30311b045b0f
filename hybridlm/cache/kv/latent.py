"""The cache of multi-head latent attention (MLA, :mod:`hybridlm.mixers.mla`): per token one compressed vector
instead of per-head keys and values.

Each token slot holds ``[normed KV latent (kv_lora_rank) | decoupled rotary key (rope_dim), rotated]``, shared by
all heads; attention either expands it to keys and values with its own up-projection or attends over it as it
is (the up-projection absorbed into queries and outputs: decode never expands it). Per batch row, ``n`` tokens
seen, ``e`` the element size: ``(kv_lora_rank + rope_dim) * n * e + 8`` bytes (Kimi Linear / DeepSeek-V3: 576
elements per token per layer, against ``2 * heads * head_dim`` for plain attention).
"""

from __future__ import annotations

import dataclasses

import torch

from hybridlm.cache.kv.base import KVLayout, KVView
from hybridlm.cache.states import LayerState, _tensor_nbytes


@dataclasses.dataclass
class LatentKV(KVLayout):
    """``latent [batch, 1, capacity, width]`` of which the first ``length`` slots are filled; ``padding
    [batch]`` leading padding slots per row. Capacity grows by half when full (or is preallocated). It takes no
    cache policy (no ``policy_features``): one reaching it is refused."""

    latent: torch.Tensor
    padding: torch.Tensor
    length: int = 0
    has_padding: bool = False

    @classmethod
    def empty(cls, batch_size, width, *, capacity=0, device=None, dtype=None) -> LatentKV:
        return cls(latent=torch.zeros(batch_size, 1, capacity, width, device=device, dtype=dtype),
                   padding=torch.zeros(batch_size, dtype=torch.long, device=device))

    @property
    def kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.latent.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.latent.dtype

    @property
    def seen(self) -> int:
        return self.length

    def describe(self) -> tuple:
        return (("latent", self.head_dim, self.dtype),)

    def nbytes(self) -> int:
        return _tensor_nbytes(self.latent[:, :, : self.length]) + _tensor_nbytes(self.padding)

    def reserved_nbytes(self) -> int:
        return LayerState.nbytes(self)

    def predicted_nbytes(self, tokens: int) -> int:
        batch, _, _, width = self.latent.shape
        return batch * (tokens * width * self.latent.element_size() + self.padding.element_size())

    def update(self, keys, values, positions, rotate, mask) -> KVView:
        """``keys [batch, 1, time, width]``: the new tokens' latents, their rotary part already rotated (the
        mixer rotates it: only part of the vector turns). ``values`` and ``rotate`` must be None: the latent
        is both."""
        if values is not None or rotate is not None:
            raise ValueError("LatentKV.update takes the latent as keys, with values=None and rotate=None")
        first, time = self.length, keys.shape[2]
        self._count_padding(mask)
        if first + time > self.latent.shape[2]:  # grow by half at least, so that decoding copies rarely
            grown = self.latent.new_zeros(*self.latent.shape[:2], max(first + time, self.latent.shape[2] * 3 // 2),
                                          self.latent.shape[3])
            grown[:, :, :first] = self.latent[:, :, :first]
            self.latent = grown
        self.latent[:, :, first:first + time] = keys
        self.length += time
        slots = torch.arange(self.length, device=keys.device)
        return KVView(self.latent[:, :, : self.length], None, slots, self._validity(slots),
                      query_slots=slots[first:], query_positions=positions, in_order=True)

    croppable = True
    takes_values = False

    def rewind_blocker(self, tokens: int) -> str | None:
        return None if tokens <= self.length else f"it holds only {self.length} slots"

    def rewind(self, tokens: int) -> None:
        """Forget the last ``tokens`` slots; padding beyond what is left is forgotten too."""
        self.length -= tokens
        if self.has_padding:
            self.padding = self.padding.clamp(max=self.length)
