"""Functional tensor ops. Each has a pure-PyTorch reference (``*_ref``): the CPU path and the test oracle.

The names exported here are what the mixers call. Each runs the backend chosen for the device of its first tensor
(see :mod:`.backends`): the reference on CPU tensors, the fastest available kernel on CUDA tensors, or what
``HYBRIDLM_BACKEND`` / :func:`use_backend` force.

The bottom tier: imports nothing of hybridlm outside ``ops``.
"""

from hybridlm.ops.backend_report import report
from hybridlm.ops.backends import BackendUnavailable, Dispatcher, runs_reference, use_backend

attention = Dispatcher("attention")
causal_compressed_attention = Dispatcher("causal_compressed_attention")
causal_conv1d = Dispatcher("causal_conv1d")
causal_conv1d_update = Dispatcher("causal_conv1d_update")
causal_linear_attention = Dispatcher("causal_linear_attention")
gated_delta_rule = Dispatcher("gated_delta_rule")
gated_delta_rule_step = Dispatcher("gated_delta_rule_step")
mamba3_scan = Dispatcher("mamba3_scan")
mamba3_step = Dispatcher("mamba3_step")
paged_attention = Dispatcher("paged_attention")
selective_scan = Dispatcher("selective_scan")
selective_state_update = Dispatcher("selective_state_update")
ssd_chunk_scan = Dispatcher("ssd_chunk_scan")

__all__ = [
    "BackendUnavailable",
    "attention",
    "causal_compressed_attention",
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_linear_attention",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "mamba3_scan",
    "mamba3_step",
    "paged_attention",
    "report",
    "runs_reference",
    "selective_scan",
    "selective_state_update",
    "ssd_chunk_scan",
    "use_backend",
]
