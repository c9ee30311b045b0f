"""Probes of the GPU check (``benchmarks/gpu_check.py``): each Triton op at model shapes against the reference,
the kernels compiled for sm_90 without a GPU, and tensors past 2**31 elements."""

from __future__ import annotations

import contextlib
import importlib
import json

import torch

from hybridlm.ops import backends
from hybridlm.ops.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from hybridlm.ops.mamba3 import mamba3_scan_ref, mamba3_step_ref
from hybridlm.ops.selective_scan import selective_scan_ref, selective_state_update_ref
from hybridlm.ops.ssd import ssd_chunk_scan_ref

#: max |error| / max |reference| allowed against the fp32 reference on the same (rounded) inputs. fp32 products
#: run in tf32x3 on the GPU; bf16 inputs are multiplied in bf16 with fp32 accumulation (docs/kernels-and-backends.md).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def op_calls(device: str, dtype: torch.dtype, small: bool) -> dict:
    """op -> (positional tensors, keyword options, indices of the tensors to differentiate) at model shapes."""
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    def f(*shape, scale=1.0):  # fp32 parameters, as the models keep them
        return torch.randn(*shape, device=device) * scale

    batch, length, heads, head_dim, dstate, dim, chunk = (1, 24, 2, 8, 8, 8, 8) if small else \
        (1, 1024, 8, 64, 128, 1024, 256)
    dt = torch.nn.functional.softplus(f(batch, length, heads) - 2)
    return {
        "ssd_chunk_scan": ((r(batch, length, heads, head_dim), dt, -torch.rand(heads, device=device) - 0.5,
                            r(batch, length, 1, dstate, scale=dstate**-0.5), r(batch, length, 1, dstate,
                                                                                  scale=dstate**-0.5), chunk),
                           {"D": f(heads)}, (0, 1, 3, 4)),
        "selective_scan": ((r(batch, dim, length), r(batch, dim, length, scale=0.5) - 1,
                            -torch.rand(dim, 16, device=device) - 0.5, r(batch, 16, length), r(batch, 16, length)),
                           {"D": f(dim), "z": r(batch, dim, length), "delta_bias": f(dim, scale=0.1),
                            "delta_softplus": True}, (0, 1, 3, 4)),
        "causal_conv1d": ((r(batch, dim, length), f(dim, 4).to(dtype)), {"bias": f(dim).to(dtype),
                                                                       "activation": "silu"}, (0, 1)),
        "selective_state_update": ((f(8, heads, head_dim, dstate), r(8, heads, head_dim),
                                    torch.nn.functional.softplus(r(8, heads, head_dim) - 2),
                                    -torch.rand(heads, head_dim, dstate, device=device), r(8, 1, dstate),
                                    r(8, 1, dstate)), {"D": f(heads, head_dim)}, ()),
        "causal_conv1d_update": ((r(64, dim), r(64, dim, 3), f(dim, 4).to(dtype)), {"activation": "silu"}, ()),
        # Mamba-3 SISO at mamba3-small-like shapes: d_state 128 with 32 angles (rope fraction 0.5), chunk 64
        "mamba3_scan": ((r(batch, length, 1, 1, dstate), r(batch, length, 1, 1, dstate), r(batch, length, heads,
                                                                                          head_dim),
                         -dt * torch.rand(batch, length, heads, device=device), dt, r(batch, length, heads),
                         r(batch, length, heads, dstate // 4), f(heads, 1, dstate, scale=0.1),
                         f(heads, 1, dstate, scale=0.1)),
                        {"D": f(heads), "z": r(batch, length, heads, head_dim), "chunk_size": min(chunk, 64)},
                        (0, 1, 2, 4, 5, 6)),
        "mamba3_step": ((r(8, 1, 1, dstate), r(8, 1, 1, dstate), r(8, heads, head_dim),
                         -torch.rand(8, heads, device=device) * 0.1, torch.rand(8, heads, device=device) * 0.1,
                         r(8, heads), r(8, heads, dstate // 4), f(heads, 1, dstate, scale=0.1),
                         f(heads, 1, dstate, scale=0.1), torch.rand(8, heads, dstate // 4, device=device),
                         f(8, heads, head_dim, dstate), r(8, 1, heads, dstate), r(8, heads, head_dim)),
                        {"D": f(heads), "z": r(8, heads, head_dim)}, ()),
    }


#: ops whose Triton kernels take packed sequences, and the time axis of their first argument
PACKED_TIME_AXIS = {"ssd_chunk_scan": 1, "selective_scan": -1, "causal_conv1d": -1, "mamba3_scan": 1}


def calls(device: str, dtype: torch.dtype, small: bool):
    """``(label, op, args, kwargs, wrt)`` for each of :func:`op_calls`, and again packed (``cu_seqlens``: a
    one-token sequence, an empty one and two longer ones) for the ops that take packed sequences."""
    for op, (args, kwargs, wrt) in op_calls(device, dtype, small).items():
        yield op, op, args, kwargs, wrt
        if op in PACKED_TIME_AXIS:
            length = args[0].shape[PACKED_TIME_AXIS[op]]
            cu_seqlens = torch.tensor([0, 1, length // 3, length // 3, length], device=device)
            yield f"{op} packed", op, args, {**kwargs, "cu_seqlens": cu_seqlens}, wrt


REFERENCES = {"ssd_chunk_scan": ssd_chunk_scan_ref, "selective_scan": selective_scan_ref,
              "causal_conv1d": causal_conv1d_ref, "selective_state_update": selective_state_update_ref,
              "causal_conv1d_update": causal_conv1d_update_ref, "mamba3_scan": mamba3_scan_ref,
              "mamba3_step": mamba3_step_ref}


def _outputs(function, args, kwargs, wrt):
    """The first output and the gradients of ``args[i]`` for ``i in wrt`` under a fixed cotangent (fp32)."""
    args = [a.detach().clone().requires_grad_(i in wrt) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)]
    out = function(*args, **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    grads = []
    if wrt:
        cotangent = torch.randn(first.shape, generator=torch.Generator().manual_seed(1)).to(first.device)
        grads = torch.autograd.grad(first.float(), [args[i] for i in wrt], cotangent)
    return [first.detach().float(), *(g.float() for g in grads)]


def kernel_errors(device: str, small: bool) -> tuple[list[dict], dict]:
    """Rows of (op, dtype, output, relative error, ok) and the compiled kernels' resources (on a GPU)."""
    from hybridlm.ops.triton import _common

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # the reference in full fp32
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        for label, op, args, kwargs, wrt in calls(device, dtype, small):
            kernel = backends.load("triton", op, device)
            upcast = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            got = _outputs(kernel, args, kwargs, wrt)
            expected = _outputs(REFERENCES[op], upcast, {k: v.float() if torch.is_tensor(v) and v.is_floating_point()
                                                         else v for k, v in kwargs.items()}, wrt)
            for name, g, e in zip(["output", *(f"grad {i}" for i in wrt)], got, expected):
                error = float((g - e).abs().max() / e.abs().max().clamp_min(1e-30))
                row = dict(op=label, dtype=str(dtype)[6:], what=name, rel_error=error, ok=error <= TOLERANCE[dtype])
                rows.append(row)
                print(f"{label:24s} {row['dtype']:9s} {name:8s} rel. error {error:.2e} {'' if row['ok'] else 'FAIL'}",
                      flush=True)
    for name, resources in _common.compiled.items():
        print(f"{name:28s} {resources}")
    return rows, dict(_common.compiled)


class _CompileOnlyDriver:
    """Triton's view of a GPU that is not there: kernels compile for ``target`` and are never launched."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def _compile_only(record: dict, path=None, arch: int = 90):
    """Kernel launches compile (``warmup``) for sm_``arch`` and record their resources (cuobjdump); nothing runs."""
    import triton
    from triton.backends.compiler import GPUTarget

    from benchmarks.gpu_check_tools import cubin_resources
    from hybridlm.ops.triton import _common

    def launch(kernel, grid, *args, **kwargs):
        if not all(grid(kwargs) if callable(grid) else grid):
            return
        passed, bounds = _common.launch_arguments(kernel, kwargs)  # as the GPU launch: tuned blocks left out
        kernel = kernel.bounded(bounds) if bounds else kernel  # its choices clamped to the launch's blocks
        compiled = kernel.warmup(*args, grid=grid, **passed)  # an autotuned kernel: one per configuration
        tuner = isinstance(kernel, triton.runtime.Autotuner)  # its configurations, in warmup's order
        configs = kernel.configs if tuner else [triton.Config({})]
        dtypes = ",".join(sorted({str(a.dtype)[6:] for a in args if isinstance(a, torch.Tensor)}))
        for one, config in zip(compiled if isinstance(compiled, list) else [compiled], configs, strict=True):
            meta = one.metadata
            options = sorted({**passed, **config.kwargs}.items())
            blocks = " ".join(f"{k}={v}" for k, v in options if k.startswith("BLOCK"))
            blocks += "".join(f" {k}" for k, v in options if v is True)  # the variant (REVERSE, HAS_...)
            key = f"{_common._name(kernel)} {blocks} {dtypes} warps={meta.num_warps} stages={meta.num_stages}"
            record[key] = dict(shared_bytes=meta.shared, **cubin_resources(one.asm["cubin"]))
            print(f"{key}: {record[key]}", flush=True)
            if path is not None:  # after every kernel: a step cut short keeps what it compiled
                path.write_text(json.dumps(record, indent=1))

    modules = [importlib.import_module(f"hybridlm.ops.triton.{name}")
               for name in ("causal_conv1d", "chunked_scan", "mamba3", "selective_scan", "state_update")]
    saved = [(m, m.launch, m.check_device) for m in modules]
    triton.runtime.driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    for module in modules:
        module.launch, module.check_device = launch, lambda *a, **k: None
    try:
        yield
    finally:
        for module, original_launch, original_check in saved:
            module.launch, module.check_device = original_launch, original_check
        with contextlib.suppress(RuntimeError):  # no default driver on a machine without a GPU
            triton.runtime.driver.reset_active()


def compile_for_sm90(path=None, small: bool = False) -> dict:
    """Compile every Triton kernel the ops launch at model shapes (forward and backward, fp32 and bf16) for
    sm_90 on CPU tensors: compile errors, shared memory, registers and spills, before any GPU time."""
    from hybridlm.ops import triton as kernels

    record: dict = {}
    with _compile_only(record, path):
        for dtype in (torch.float32, torch.bfloat16):
            for _, op, args, kwargs, wrt in calls("cpu", dtype, small):
                _outputs(getattr(kernels, op), args, kwargs, wrt)
    return record


def large_tensor_probe() -> None:
    """Triton kernels on tensors of more than 2**31 elements: the last rows equal the reference's."""
    from hybridlm.ops import triton as kernels

    torch.backends.cudnn.allow_tf32 = False  # the reference in full fp32
    channels, length = 4160, 2**19  # 2.18e9 bf16 elements
    x = torch.randn(1, channels, length, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(channels, 4, device="cuda", dtype=torch.bfloat16)
    y, _ = kernels.causal_conv1d(x, weight, activation="silu")
    expected, _ = causal_conv1d_ref(x[:, -8:].float(), weight[-8:].float(), activation="silu")
    error = float((y[:, -8:].float() - expected).abs().max() / expected.abs().max())
    print(f"causal_conv1d on {x.numel() / 2**31:.2f} x 2**31 elements: last channels' rel. error {error:.2e}")
    assert error < 2e-2, error
    del x, y
    torch.cuda.empty_cache()
    batch = 16448  # state [batch, 16, 64, 128] fp32: 2.16e9 elements
    state = torch.randn(batch, 16, 64, 128, device="cuda")
    x, dt = torch.randn(batch, 16, 64, device="cuda"), torch.rand(batch, 16, 64, device="cuda")
    A, B, C = -torch.rand(16, 64, 128, device="cuda"), torch.randn(batch, 1, 128, device="cuda"), \
        torch.randn(batch, 1, 128, device="cuda")
    tail = state[-4:].clone()
    y = kernels.selective_state_update(state, x, dt, A, B, C)
    expected = selective_state_update_ref(tail, x[-4:], dt[-4:], A, B[-4:], C[-4:])
    error = float((y[-4:] - expected).abs().max() / expected.abs().max())
    print(f"selective_state_update on {state.numel() / 2**31:.2f} x 2**31 elements: last rows' rel. error {error:.2e}")
    assert error < 1e-4 and torch.allclose(state[-4:], tail), error
