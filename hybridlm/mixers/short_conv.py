"""LFM2's gated short convolution: input-dependent gates around a depthwise causal convolution.

in_proj -> (B, C, x); y = C * conv(B * x) (depthwise, causal, no activation); out_proj. The state is the
conv window alone (``short_conv_size - 1`` inputs per channel): no recurrent state, nothing that grows.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridlm.cache import RecurrentState
from hybridlm.cache.states import WINDOW
from hybridlm.layers.conv import ShortConv
from hybridlm.layers.linear import Linear
from hybridlm.mixers.base import Mixer, register, zero_padding
from hybridlm.mixers.gated_deltanet import check_positive
from hybridlm.mixers.segments import check_stateless
from hybridlm.ops.causal_conv1d import causal_conv1d_windows


@dataclasses.dataclass
class ConvState(RecurrentState):
    """The causal-conv window alone, ``conv [batch, channels, width - 1]`` (model dtype): ``channels * (width -
    1) * e`` bytes per row."""

    quantized_fields = {"conv": WINDOW}

    conv: torch.Tensor


@register("short_conv")
class GatedShortConv(Mixer):
    pattern_letter = "C"
    config_fields = ("short_conv_size", "short_conv_bias")
    causal = True
    grows_with_context = False

    @classmethod
    def check_config(cls, config) -> None:
        check_positive(config, ["short_conv_size"])

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        hidden, bias = config.hidden_size, config.short_conv_bias
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.conv = ShortConv(hidden, config.short_conv_size, bias=bias, activation=None)
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def init_state(self, batch_size, max_length=None, device=None, dtype=None) -> ConvState:
        return ConvState(conv=self.conv.init_window(batch_size, device, dtype))

    def forward(self, x, state: ConvState | None = None, *, mask=None, positions=None, segments=None):
        packed = {}
        if segments is not None:  # packed documents: one row, the window restarting at each
            check_stateless(self.kind, state, mask)
            x, packed = segments.one_row(x), segments.scan_kwargs()
        track = state is not None and state.checkpointing(x.shape[1])  # keep the window after each token
        B, C, h = self.in_proj(x).chunk(3, dim=-1)  # [batch, time, hidden] each
        gated = zero_padding(B * h, mask)  # a padded token puts a zero into the window, as an empty window holds
        windows = causal_conv1d_windows(gated.transpose(1, 2), state.conv) if track else None
        y = self.conv(gated.transpose(1, 2), state.conv if state is not None else None, **packed).transpose(1, 2)
        if track:
            state.keep_states(conv=windows)
        out = self.out_proj(C * y)
        return out if segments is None else segments.rows(out)
