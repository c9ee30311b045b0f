"""What the CPU interpreter can pin of the kernels' GPU safety: reversed scans as forward scans of a flipped tile,
64-bit offsets (a batch stride whose 32-bit product wraps to another row), failed compiles that decline, launches
on the tensors' device, and the CUDA scan declining what it cannot take."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from hybridlm import ops
from hybridlm.ops import backends, cuda
from hybridlm.ops.backends import BackendUnavailable, Declined
from hybridlm.ops.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from hybridlm.ops.selective_scan import selective_scan_ref, selective_state_update_ref
from hybridlm.ops.ssd import chunked_decay_scan as chunked_decay_scan_ref

from .triton_support import DEVICE, _common, assert_close, kernels

TRITON_DIR = Path(_common.__file__).parent
KERNEL_SOURCES = {path.name: path.read_text() for path in sorted(TRITON_DIR.glob("*.py"))}  # every module


# ---- reversed scans ---------------------------------------------------------------------------------------------

@triton.jit
def _compose(a1, b1, a2, b2):
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _reversed_recurrence_kernel(A, B, OUT, ROWS: tl.constexpr, LOG2: tl.constexpr, COLS: tl.constexpr,
                                DEPTH: tl.constexpr):
    """OUT[t] = B[t] + A[t] OUT[t + 1] (OUT[ROWS] = 0), the selective-scan adjoint's recurrence, as it does it."""
    offs = (tl.arange(0, ROWS)[:, None, None] * COLS + tl.arange(0, COLS)[None, :, None]) * DEPTH \
        + tl.arange(0, DEPTH)[None, None, :]
    a = _common.flip_rows(tl.load(A + offs), ROWS, LOG2, COLS, DEPTH)
    b = _common.flip_rows(tl.load(B + offs), ROWS, LOG2, COLS, DEPTH)
    _, local = tl.associative_scan((a, b), 0, _compose)
    tl.store(OUT + offs, _common.flip_rows(local, ROWS, LOG2, COLS, DEPTH))


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_reversed_scan_is_a_forward_scan_between_flips(rows):
    """Order-dependent combine, reversed in time: equals the float64 loop (a wrong order fails: A varies)."""
    torch.manual_seed(0)
    a, b = torch.rand(rows, 2, 4, device=DEVICE) + 0.5, torch.randn(rows, 2, 4, device=DEVICE)
    out = torch.full_like(a, float("nan"))
    _reversed_recurrence_kernel[(1,)](a, b, out, rows, rows.bit_length() - 1, 2, 4)
    expected, carry = torch.zeros(rows, 2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)
    for t in reversed(range(rows)):
        carry = b[t].double().cpu() + a[t].double().cpu() * carry
        expected[t] = carry
    assert expected.abs().max() > 0.1
    assert_close(out.double().cpu(), expected, "reversed recurrence", rel=1e-6)


def test_no_reversed_associative_scan_with_an_order_dependent_combine():
    """Only the additive running total (any order is right) scans with reverse=True."""
    for name, source in KERNEL_SOURCES.items():
        for call in re.findall(r"associative_scan\([^)]*reverse=[^)]*\)", source):
            assert "_add" in call, f"{name}: {call}"


# ---- 64-bit offsets ---------------------------------------------------------------------------------------------
# A [5, ...] fp16 tensor whose batch stride is 2**30 elements: row 4 starts 2**32 elements in, which a 32-bit
# offset wraps to row 0. Only the rows' pages are touched: 8 GiB of address space, a few kB of memory.

def strided_rows(*shape: int) -> torch.Tensor:
    rest = torch.empty(shape[1:]).stride()
    x = torch.empty_strided(shape, (2**30, *rest), dtype=torch.float16, device=DEVICE)
    x.copy_(torch.randn(shape))
    return x


def assert_row_4_right(got: torch.Tensor, expected: torch.Tensor, name: str, batch_dim: int = 0):
    got, expected = got.float().movedim(batch_dim, 0), expected.float().movedim(batch_dim, 0)
    assert expected[4].abs().max() > 0.1 and not torch.allclose(expected[4], expected[0])
    assert_close(got[4], expected[4], f"{name}, row 4", rel=1e-3)


def test_selective_scan_offsets_do_not_wrap():
    torch.manual_seed(0)
    u = strided_rows(5, 3, 6)
    args = (torch.rand(5, 3, 6, device=DEVICE), -torch.rand(3, 4, device=DEVICE) - 0.5,
            torch.randn(5, 4, 6, device=DEVICE), torch.randn(5, 4, 6, device=DEVICE))
    got, _ = kernels.selective_scan(u, *args, chunk_size=4)
    expected, _ = selective_scan_ref(u.contiguous().float(), *args)
    assert_row_4_right(got, expected, "selective_scan")


def test_chunked_scan_offsets_do_not_wrap():
    torch.manual_seed(0)
    q = strided_rows(5, 6, 1, 4)
    k, v = torch.randn(5, 6, 1, 4, device=DEVICE), torch.randn(5, 6, 2, 3, device=DEVICE)
    log_decay = -torch.rand(5, 6, 2, device=DEVICE)
    got, _ = kernels.chunked_scan.chunked_decay_scan(q, k, v, log_decay, 4)
    expected, _ = chunked_decay_scan_ref(q.contiguous().float(), k, v, log_decay, 4)
    assert_row_4_right(got, expected, "chunked scan")


def test_causal_conv1d_offsets_do_not_wrap():
    torch.manual_seed(0)
    x, weight = strided_rows(5, 3, 7), torch.randn(3, 4, device=DEVICE)
    got, _ = kernels.causal_conv1d(x, weight.half(), activation="silu")
    expected, _ = causal_conv1d_ref(x.contiguous().float(), weight.half().float(), activation="silu")
    assert_row_4_right(got, expected, "causal_conv1d")
    step, window = strided_rows(5, 3), torch.randn(5, 3, 3, device=DEVICE)
    got = kernels.causal_conv1d_update(step, window.half(), weight.half())
    expected = causal_conv1d_update_ref(step.contiguous().float(), window.clone(), weight.half().float())
    assert_row_4_right(got, expected, "causal_conv1d_update")


def test_state_update_offsets_do_not_wrap():
    torch.manual_seed(0)
    x, state = strided_rows(5, 2, 3), torch.randn(5, 2, 3, 4, device=DEVICE)
    args = (torch.rand(5, 2, 3, device=DEVICE), -torch.rand(2, 3, 4, device=DEVICE), torch.randn(5, 1, 4),
            torch.randn(5, 1, 4))
    got = kernels.selective_state_update(state.clone(), x, *args)
    expected = selective_state_update_ref(state.clone(), x.contiguous().float(), *args)
    assert_row_4_right(got, expected, "selective_state_update")


# ---- launches: failures decline, the tensors' device -----------------------------------------------------------

class FailingKernel:
    """Stands in for a JIT kernel whose compile runs out of shared memory (as Triton reports it)."""

    __name__ = "_too_big_kernel"
    launches = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            FailingKernel.launches += 1
            raise OutOfResources(300_000, 232_448, "shared memory")
        return run


def launch_failing(x: torch.Tensor, stages: int = 3) -> torch.Tensor:
    _common.launch(FailingKernel(), (1,), x, BLOCK_K=256, num_stages=stages)
    return x


def test_a_kernel_that_does_not_fit_declines_naming_kernel_and_configuration():
    FailingKernel.launches = 0
    with pytest.raises(Declined, match=r"_too_big_kernel \(BLOCK_K=256, num_stages=3, dtypes=float32\) failed "
                                       r"on cpu: OutOfResources: out of resource: shared memory") as error:
        launch_failing(torch.zeros(2))
    assert isinstance(error.value, _common.KernelFailed)
    with pytest.raises(Declined):  # remembered: not compiled again
        launch_failing(torch.zeros(2))
    assert FailingKernel.launches == 1
    with pytest.raises(Declined):  # another configuration is tried
        launch_failing(torch.zeros(2), stages=2)
    assert FailingKernel.launches == 2
    # the default choice runs the next backend
    assert torch.equal(backends.Plan((launch_failing,), lambda x: x + 1, ("triton", "torch"))(torch.zeros(2)),
                       torch.ones(2))


def test_a_forced_triton_kernel_that_fails_raises_backend_unavailable(monkeypatch):
    monkeypatch.setattr(backends, "load", lambda backend, op, device_type: lambda *a, **k: launch_failing(a[0]))
    backends.reload_environment()
    with ops.use_backend(selective_scan="triton"), pytest.raises(
        BackendUnavailable, match=r"forced backend 'triton' cannot serve this call: Triton kernel _too_big_kernel"
    ):
        ops.selective_scan(*(torch.zeros(1, 2, 3),) * 2, torch.zeros(2, 1), *(torch.zeros(1, 1, 3),) * 2)
    backends.reload_environment()


def test_launches_go_to_the_device_of_the_tensors(monkeypatch):
    guard = _common.device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1  # built without touching CUDA
    seen = []
    monkeypatch.setattr(_common, "device_guard", lambda device: seen.append(device) or _common.contextlib.nullcontext())
    ran = []
    _common.launch(type("K", (), {"__getitem__": lambda self, grid: lambda *a, **k: ran.append(grid)})(), (2, 1),
                   3, torch.zeros(1, device=DEVICE))
    assert seen == [torch.zeros(1, device=DEVICE).device] and ran == [(2, 1)]


def test_every_kernel_launch_goes_through_launch():
    """``launch`` holds the device guard and the failure handling: no kernel is indexed by a grid, and every
    kernel of the package is launched by it."""
    every_source = "\n".join(KERNEL_SOURCES.values())
    kernels_defined = re.findall(r"^def (_\w+_kernel)\(", every_source, flags=re.M)
    assert len(kernels_defined) >= 12
    for name, source in KERNEL_SOURCES.items():
        assert not re.findall(r"_kernel\[", source), f"{name} launches a kernel directly"
    for kernel in kernels_defined:
        assert re.search(rf"launch\(\s*{kernel}\b", every_source), f"{kernel} is not launched through launch()"


# ---- the CUDA scan declines what it cannot take -----------------------------------------------------------------

def cuda_scan_inputs(dtype=torch.float32, dstate=3):
    generator = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype)  # noqa: E731
    return (r(1, 4, 5), r(1, 4, 5).sigmoid(), -r(4, dstate).exp(), r(1, dstate, 5), r(1, dstate, 5))


@pytest.mark.parametrize("dtype,dstate,why", [(torch.float64, 3, "float64"), (torch.float32, 300, "dstate <= 256")])
def test_the_cuda_scan_declines_float64_and_large_states(dtype, dstate, why):
    inputs = cuda_scan_inputs(dtype, dstate)
    with pytest.raises(Declined, match=why):
        cuda.selective_scan(*inputs)
    # first in the default order for the selective scan: the next backend runs instead of the model crashing
    y, state = backends.Plan((cuda.selective_scan,), selective_scan_ref, ("cuda", "torch"))(*inputs)
    expected_y, expected_state = selective_scan_ref(*inputs)
    assert expected_y.abs().max() > 0 and torch.equal(y, expected_y) and torch.equal(state, expected_state)


def test_the_first_cuda_build_says_so_once(monkeypatch, caplog):
    builds = []
    monkeypatch.setattr(cuda, "_library", None)
    monkeypatch.setattr(cuda, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: builds.append(kwargs["name"]))
    with caplog.at_level(logging.WARNING, logger="hybridlm.ops.cuda"):
        cuda.load_library()
        cuda.load_library()
    assert builds == [cuda.LIBRARY]
    messages = [record.getMessage() for record in caplog.records]
    assert sum("building the CUDA selective scan" in m for m in messages) == 1, messages
    assert "hybridlm build-kernels" in messages[0]


def test_build_kernels_command(monkeypatch, capsys):
    from hybridlm.cli import main

    monkeypatch.setattr(cuda, "unavailable_reason", lambda device=None: "no CUDA device")
    with pytest.raises(SystemExit):
        main(["build-kernels"])
    assert "cannot build the CUDA selective scan here: no CUDA device" in capsys.readouterr().err
    built = []
    monkeypatch.setattr(cuda, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(cuda, "load_library", lambda: built.append(True))
    main(["build-kernels"])
    assert built == [True] and "is built" in capsys.readouterr().out


def test_autotuned_kernels_have_a_few_configurations_over_real_arguments():
    """On the GPU the heavy kernels are autotuned over a few (warps, stages); Triton checks there that the key and
    the buffers reset or restored between trials are arguments of the kernel: checked here for every one."""
    modules = {name: importlib.import_module(f"hybridlm.ops.triton.{name}")
               for name in ("chunked_scan", "selective_scan", "state_update")}
    assert {"_chunk_state_kernel", "_chunk_scan_kernel", "_scan_fwd_kernel", "_scan_bwd_kernel",
            "_state_update_kernel"} <= set(_common.TUNING)
    assert "reset_to_zero" in _common.TUNING["_scan_bwd_kernel"][2]  # atomically accumulated dB, dC
    assert "restore_value" in _common.TUNING["_state_update_kernel"][2]  # the state, updated in place
    for name, (configs, key, options, blocks) in _common.TUNING.items():
        kernel = next(getattr(m, name) for m in modules.values() if hasattr(m, name))
        assert 1 < len(configs) <= 4
        tuner = _common.autotuned(kernel, configs, key, blocks, **options)
        assert len(tuner.configs) == len(_common.block_choices(configs, blocks)) <= 12 and tuner.keys == key
