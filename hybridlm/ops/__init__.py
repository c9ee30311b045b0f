"""Functional tensor ops. Each has a pure-PyTorch reference (``*_ref``): the CPU path and the test oracle.

The names exported here are what the mixers call.
"""

from .attention import attention_ref as attention
from .causal_conv1d import causal_conv1d_ref as causal_conv1d
from .causal_conv1d import causal_conv1d_update_ref as causal_conv1d_update
from .compressed_attention import causal_compressed_attention_ref as causal_compressed_attention
from .linear_attention import causal_linear_attention_ref as causal_linear_attention
from .selective_scan import selective_scan_ref as selective_scan
from .selective_scan import selective_state_update_ref as selective_state_update
from .ssd import ssd_chunk_scan_ref as ssd_chunk_scan

__all__ = [
    "attention",
    "causal_compressed_attention",
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_linear_attention",
    "selective_scan",
    "selective_state_update",
    "ssd_chunk_scan",
]
