"""reserved_nbytes of the quantized layouts is what their buffers really occupy (the room they grew into, the
full-precision tail's room, kept copies), counted once per storage; nbytes stays the bytes of the tokens held."""

import torch

from hybridlm.cache.kv import QuantizedKV, QuantizedSinkWindowKV


def storage_bytes(state) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state._tensors().values()}
    return sum(storages.values())


def decode(state, steps: int) -> None:
    for step in range(steps):
        keys, values = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
        state.update(keys, values, torch.tensor([[step]] * 2), None, None)


def test_reserved_bytes_are_the_storage_the_buffers_occupy():
    kivi = QuantizedKV.empty(2, 1, 8, bits=4, group=8, residual=8)
    window = QuantizedSinkWindowKV.empty(2, 1, 8, sinks=4, window=64, bits=4, group=8, residual=8)
    for state, steps in [(kivi, 1000), (window, 3000)]:
        decode(state, steps)
        assert state.reserved_nbytes() == storage_bytes(state) > state.nbytes() > 0, type(state).__name__
    kivi.keep_checkpoints(20)  # kept full-precision copies count too
    decode(kivi, 30)
    assert kivi.spilled_keys.shape[2] > 0 and kivi.reserved_nbytes() == storage_bytes(kivi)
