"""Block sizes autotuned on the GPU (``tuned(..., blocks=...)``): the choices are GPU-legal, and a GPU-style launch
(an autotuned kernel) never passes a tuned meta-parameter itself and computes the same results with every choice.

The kernels are Autotuners only on the GPU; here the tuned kernels are wrapped in one in the interpreter,
with a stand-in for the benchmark that runs each configuration once (every choice executes and is checked)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridlm.ops.selective_scan import selective_scan_ref, selective_state_update_ref
from hybridlm.ops.ssd import chunked_decay_scan as chunked_decay_scan_ref

from .triton_support import DEVICE, _common, assert_close

chunked_scan = pytest.importorskip("hybridlm.ops.triton.chunked_scan")
selective_scan = pytest.importorskip("hybridlm.ops.triton.selective_scan")
state_update = pytest.importorskip("hybridlm.ops.triton.state_update")
# kernel -> (its module, the blocks it tunes, whether they feed tl.dot)
TUNED_BLOCKS = {"_chunk_state_kernel": (chunked_scan, {"BLOCK_V", "BLOCK_K"}, True),
                "_chunk_scan_kernel": (chunked_scan, {"BLOCK_V", "BLOCK_K"}, True),
                "_scan_fwd_kernel": (selective_scan, {"BLOCK_D"}, False),
                "_scan_bwd_kernel": (selective_scan, {"BLOCK_D"}, False),
                "_state_update_kernel": (state_update, {"BLOCK_P"}, False)}


def test_tuning_table_lists_block_choices_that_tl_dot_accepts():
    for name, (module, blocks, dot) in TUNED_BLOCKS.items():
        sizes = _common.tuned_block_sizes(getattr(module, name))
        assert set(sizes) == blocks, name
        for block, choices in sizes.items():
            assert len(choices) > 1, f"{name}: {block} has nothing to choose from"
            for size in choices:  # a power of two; at least 16 where it feeds tl.dot
                assert size >= (16 if dot else 1) and size & (size - 1) == 0, f"{name}: {block}={size}"
            assert max(choices) <= (chunked_scan._MAX_BLOCK_K if dot else 32)  # within the launchers' maxima
    # a per-entry override: the 32-wide value block of the state kernel only with 8 warps (4 spill in fp32)
    choices = _common.block_choices(*_common.TUNING["_chunk_state_kernel"][::3])
    assert {w for w, _, b in choices if b["BLOCK_V"] == 32} == {8}


def _autotune(monkeypatch, names, order: str):
    """Each kernel as the GPU sees it: an Autotuner over its configurations, whose stand-in benchmark runs each
    once and makes the first (``order="first"``) or last configuration the fastest."""
    times = itertools.count(0.0, 1.0 if order == "first" else -1.0)

    def bench(kernel_call, quantiles):
        kernel_call()
        t = next(times)
        return [t, t, t]

    for name in names:
        module = TUNED_BLOCKS[name][0]
        configs, key, options, blocks = _common.TUNING[name]
        tuner = _common.autotuned(getattr(module, name), configs, key, blocks, do_bench=bench, **options)
        monkeypatch.setattr(module, name, tuner)


def launched(tuner):
    """The one bounded tuner a test's launches went through (the launches' blocks bound the choices)."""
    (bounded,) = tuner.by_bounds.values()
    return bounded


def test_gpu_style_launch_leaves_tuned_blocks_to_the_autotuner():
    """The launch's block sizes become bounds, never arguments (Triton: "Conflicting meta-parameters")."""
    configs, key, options, blocks = _common.TUNING["_chunk_scan_kernel"]
    kernel = _common.autotuned(chunked_scan._chunk_scan_kernel, configs, key, blocks, **options)
    launcher_blocks = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, BLOCK_V=64, REVERSE=True)
    passed, bounds = _common.launch_arguments(kernel, launcher_blocks)
    assert bounds == {"BLOCK_K": 32, "BLOCK_V": 64}
    assert passed == {"BLOCK_M": 64, "BLOCK_N": 32, "REVERSE": True}
    assert not passed.keys() & set().union(*(c.kwargs for c in kernel.configs))
    pruned = kernel.bounded(bounds).configs  # choices clamped to the bounds, duplicates dropped
    assert {c.kwargs["BLOCK_K"] for c in pruned} == {32} and {c.kwargs["BLOCK_V"] for c in pruned} == {32, 64}
    assert len(pruned) == len({tuple(sorted(c.all_kwargs().items())) for c in pruned}) == 4
    # one tuner per bounds: a choice made under looser bounds is never reused under tighter ones
    assert kernel.bounded(dict(bounds)) is kernel.bounded(bounds)
    assert {c.kwargs["BLOCK_V"] for c in kernel.bounded(dict(BLOCK_K=32, BLOCK_V=32)).configs} == {32}
    # in the interpreter's own kernels (not autotuned) every argument is passed, as before
    if _common.INTERPRETED:
        assert _common.launch_arguments(chunked_scan._chunk_scan_kernel, dict(BLOCK_V=64)) == ({"BLOCK_V": 64}, {})


@pytest.mark.skipif(DEVICE != "cpu", reason="wraps the interpreted kernels; on the GPU they are autotuned already")
@pytest.mark.parametrize("order", ["first", "last"])
def test_autotuned_chunked_scan_matches_the_reference_with_every_block_choice(monkeypatch, order):
    """Forward and backward of the chunked scan through autotuned kernels: each configuration runs once while
    tuning (conflicting or illegal choices fail here), then the chosen one; the results equal the reference."""
    _autotune(monkeypatch, ["_chunk_state_kernel", "_chunk_scan_kernel"], order)
    torch.manual_seed(0)
    batch, time, heads, dim_k, dim_v = 1, 12, 2, 64, 64  # 64 wide: choices of 32 and 64 both apply
    q, k = torch.randn(batch, time, 1, dim_k) / 8, torch.randn(batch, time, 1, dim_k) / 8
    v = torch.randn(batch, time, heads, dim_v)
    log_decay, scale = -torch.rand(batch, time, heads), torch.rand(batch, time, heads) + 0.5
    inputs = [t.requires_grad_() for t in (q, k, v, log_decay, scale)]

    def run(function):
        y, final = function(*inputs[:3], inputs[3], chunk_size=8, v_scale=inputs[4])
        cotangent = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        return [y, final, *torch.autograd.grad((y * cotangent).sum() + final.sum(), inputs)]

    def reference(q, k, v, log_decay, chunk_size, v_scale):
        return chunked_decay_scan_ref(q, k, v * v_scale[..., None], log_decay, chunk_size)

    expected = run(reference)
    got = run(chunked_scan.chunked_decay_scan)
    for name, g, e in zip(["y", "final", "dq", "dk", "dv", "dlog_decay", "dscale"], got, expected, strict=True):
        assert e.abs().max() > 0.1, name  # a non-trivial reference
        assert_close(g, e, name, rel=1e-4)
    chosen = launched(chunked_scan._chunk_scan_kernel).best_config.kwargs
    assert chosen["BLOCK_V"] == (32 if order == "first" else 64)  # the dots of two value blocks, or of one


@pytest.mark.skipif(DEVICE != "cpu", reason="wraps the interpreted kernels; on the GPU they are autotuned already")
def test_autotuned_selective_scan_and_decode_step_match_the_reference(monkeypatch):
    """The Mamba-1 scan (forward and backward) and the decode step with their channel blocks autotuned (every
    choice runs while tuning; the narrowest, not the launch's own, is chosen and checked)."""
    _autotune(monkeypatch, ["_scan_fwd_kernel", "_scan_bwd_kernel", "_state_update_kernel"], "first")
    torch.manual_seed(0)
    batch, dim, time, dstate = 1, 16, 8, 4  # 16 channels: choices of 2, 4 and 8 channels per program apply
    u, delta, B, C = (torch.randn(batch, dim, time), torch.rand(batch, dim, time), torch.randn(batch, dstate, time),
                      torch.randn(batch, dstate, time))
    A, D = -torch.rand(dim, dstate) - 0.5, torch.randn(dim)
    inputs = [t.requires_grad_() for t in (u, delta, A, B, C, D)]

    def run(function):
        y, final = function(*inputs, delta_softplus=True)
        return [y, final, *torch.autograd.grad((y * torch.cos(y.detach())).sum() + final.sum(), inputs)]

    for name, g, e in zip(["y", "final", "du", "ddelta", "dA", "dB", "dC", "dD"], run(selective_scan.selective_scan),
                          run(selective_scan_ref), strict=True):
        assert e.abs().max() > 0.1, name
        assert_close(g, e, name, rel=1e-4)
    assert launched(selective_scan._scan_bwd_kernel).best_config.kwargs["BLOCK_D"] == 2

    state = torch.randn(2, 2, 64, 16)  # [batch, heads, head_dim, dstate]: blocks of 8 to 32 of the 64 channels
    x, dt, A2 = torch.randn(2, 2, 64), torch.rand(2, 2, 64), -torch.rand(2, 64, 16)
    B2, C2 = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    expected_state = state.clone()
    expected = selective_state_update_ref(expected_state, x, dt, A2, B2, C2, dt_softplus=True)
    got = state_update.selective_state_update(state, x, dt, A2, B2, C2, dt_softplus=True)  # tuning restores state
    assert_close(got, expected, "y", rel=1e-5)
    assert_close(state, expected_state, "state", rel=1e-5)
    assert launched(state_update._state_update_kernel).best_config.kwargs["BLOCK_P"] == 8


@pytest.mark.skipif(DEVICE != "cpu", reason="wraps the interpreted kernels; on the GPU they are autotuned already")
def test_under_torch_compile_the_launch_passes_its_blocks_to_a_warps_only_tuner(monkeypatch):
    """A torch.compile trace does not see the block bounds: it launches an Autotuner over warps and stages only,
    with every block the launcher computed (no conflict, no unbounded block)."""
    _autotune(monkeypatch, ["_state_update_kernel"], "last")
    tuner = state_update._state_update_kernel
    configs = _common.TUNING["_state_update_kernel"][0]
    assert [(c.num_warps, c.num_stages, c.kwargs) for c in tuner.blocks_as_passed.configs] == \
        [(w, s, {}) for w, s in configs]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    state = torch.randn(2, 2, 64, 16)
    x, dt, A, B, C = (torch.randn(2, 2, 64), torch.rand(2, 2, 64), -torch.rand(2, 64, 16), torch.randn(2, 1, 16),
                      torch.randn(2, 1, 16))
    expected_state = state.clone()
    expected = selective_state_update_ref(expected_state, x, dt, A, B, C)
    assert_close(state_update.selective_state_update(state, x, dt, A, B, C), expected, "y", rel=1e-5)
    assert_close(state, expected_state, "state", rel=1e-5)
    assert tuner.blocks_as_passed.best_config.kwargs == {} and not hasattr(tuner, "best_config")
