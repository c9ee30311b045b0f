"""Kernel benchmarks: every backend of each op against the torch reference, and against mamba-ssm and
flash-linear-attention (``chunk_simple_gla`` computes the same scalar-decay scan as SSD) where installed.

    python benchmarks/gpu_kernels.py [--out DIR] [--quick] [--device cuda] [--only NAME]

Writes ``DIR/benchmarks.md`` (median times, speed-up over the reference, error against it, then the targets of
issue 4) and ``DIR/benchmarks.json``. A backend that cannot run is listed with the reason. ``--quick`` shrinks every
size (a smoke test of the script; ``--device cpu`` runs that on the CPU, Triton only in its interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridlm import ops
from hybridlm.ops import backends


@dataclass
class Case:
    """One benchmark: an op at one shape, timed through several implementations on the same inputs."""

    name: str
    shape: str
    make: Callable[[], dict]  # the inputs
    runners: dict[str, Callable[[dict], object] | str]  # label -> run(inputs), or why it cannot run
    backward: bool = False  # time forward + backward of the first output (gradients of the float inputs)
    repeats: dict[str, int] = field(default_factory=lambda: {"torch": 5})  # fewer repeats for slow labels


def backend(op: str, name: str, device: str):
    """``call(function, inputs)`` bound to the backend's function, or the reason it cannot run."""
    try:
        function = backends.load(name, op, device)
    except backends.BackendUnavailable as error:
        return str(error).split(": ", 1)[1]
    return function


def fla_simple_gla():
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as error:
        return f"flash-linear-attention unavailable: {type(error).__name__}: {error}"
    return chunk_simple_gla


def runners(op: str, device: str, call: Callable, names: tuple[str, ...]) -> dict:
    """Runners of ``op``'s backends ``names``: ``call(function, inputs)`` runs one function on the inputs."""
    found = {}
    for name in names:
        function = backend(op, name, device)
        found[name] = function if isinstance(function, str) else (lambda x, f=function: call(f, x))
    return found


# ---- inputs ---------------------------------------------------------------------------------------------------

def randn(device, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def ssd_inputs(device, batch, length, heads, head_dim, dstate, dtype):
    x = randn(device, dtype, batch, length, heads, head_dim)
    dt = torch.nn.functional.softplus(randn(device, torch.float32, batch, length, heads) - 2)
    A = -torch.rand(heads, device=device) - 0.5
    B, C = (randn(device, dtype, batch, length, 1, dstate, scale=dstate**-0.5) for _ in range(2))
    # fla takes keys and queries per head: copied to every head here, before any timing (hybridlm reads the one
    # group through strides, so neither side's timed call copies B or C)
    B_heads, C_heads = (t.expand(-1, -1, heads, -1).contiguous() for t in (B, C))
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=torch.randn(heads, device=device), B_heads=B_heads, C_heads=C_heads)


def fla_ssd(chunk_simple_gla):
    """SSD through chunk_simple_gla: q = C, k = B (per head, formed before timing), v = dt x, log decay = dt A;
    plus D x. Both sides form dt x, dt A and D x inside their timed calls."""
    def run(x, dt, A, D, B_heads, C_heads, **_):
        y, _ = chunk_simple_gla(C_heads, B_heads, (x * dt.unsqueeze(-1)).to(x.dtype), dt * A, scale=1.0)
        return y + x * D[:, None].to(x.dtype)
    return run


def graphed(function: Callable[[dict], object]) -> Callable[[dict], object]:
    """``function(inputs)`` replayed from a CUDA graph captured at its first call on those inputs (after one
    call outside the capture: compiling and autotuning cannot be captured)."""
    graphs = {}

    def run(inputs: dict):
        if id(inputs) not in graphs:
            function(inputs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = function(inputs)
            graphs[id(inputs)] = (graph, out, inputs)  # holding the inputs keeps their id and memory
        graph, out, _ = graphs[id(inputs)]
        graph.replay()
        return out
    return run


def scan_inputs(device, batch, dim, length, dstate, dtype):
    return dict(u=randn(device, dtype, batch, dim, length), delta=randn(device, dtype, batch, dim, length) - 2,
                A=-torch.rand(dim, dstate, device=device) - 0.5, B=randn(device, dtype, batch, dstate, length),
                C=randn(device, dtype, batch, dstate, length), D=torch.randn(dim, device=device),
                z=randn(device, dtype, batch, dim, length), delta_bias=torch.randn(dim, device=device) * 0.1)


def update_inputs(device, batch, heads, head_dim, dstate, dtype):
    shape = (batch, heads, head_dim) if heads else (batch, head_dim)
    a_shape = (heads, head_dim, dstate) if heads else (head_dim, dstate)
    bc_shape = (batch, 1, dstate) if heads else (batch, dstate)
    return dict(state=torch.randn(*shape, dstate, device=device), x=randn(device, dtype, *shape),
                dt=torch.nn.functional.softplus(randn(device, dtype, *shape) - 2),
                A=-torch.rand(a_shape, device=device) - 0.5, B=randn(device, dtype, *bc_shape),
                C=randn(device, dtype, *bc_shape), D=torch.randn(*shape[1:], device=device))


def linear_attention_inputs(device, batch, heads, length, features, dim):
    q, k = (torch.rand(batch, heads, length, features, device=device) for _ in range(2))
    inputs = dict(q=q, k=k, v=torch.randn(batch, heads, length, dim, device=device),
                  log_decay=-torch.rand(batch, heads, length, device=device) * 0.1)
    inputs.update({f"{name}_fla": value.transpose(1, 2).contiguous() for name, value in inputs.items()})
    return inputs


def fla_linear_attention(chunk_simple_gla):
    """causal_linear_attention through chunk_simple_gla on inputs already laid out [batch, time, heads, dim]."""
    def run(x):
        out, _ = chunk_simple_gla(x["q_fla"], x["k_fla"], x["v_fla"], x["log_decay_fla"], scale=1.0)
        return out.transpose(1, 2)
    return run


def cases(device: str, quick: bool) -> list[Case]:
    s = 8 if quick else 1  # size divisor
    half = torch.bfloat16 if device == "cuda" else torch.float32
    fla = fla_simple_gla() if device == "cuda" else "flash-linear-attention runs on CUDA only"
    ssd_names = ("torch", "triton", "mamba_ssm")

    def ssd(f, x):
        return f(x["x"], x["dt"], x["A"], x["B"], x["C"], 256 // s, D=x["D"])

    ssd_shape = dict(batch=2, length=8192 // s, heads=16, head_dim=64, dstate=128 // s)
    ssd_label = ", ".join(f"{k} {v}" for k, v in ssd_shape.items()) + f", {str(half)[6:]}, chunk {256 // s}"
    ssd_runners = runners("ssd_chunk_scan", device, ssd, ssd_names)
    if isinstance(fla, str):
        ssd_runners["fla"] = fla
    else:
        fla_run = fla_ssd(fla)
        ssd_runners["fla"] = lambda x: fla_run(**x)

    def scan(f, x):
        return f(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"], delta_bias=x["delta_bias"],
                 delta_softplus=True)

    scan_shape = dict(batch=2, dim=4096 // s, length=4096 // s, dstate=16)
    scan_names = ("torch", "cuda", "triton", "mamba_ssm")

    def update(f, x):
        return f(x["state"], x["x"], x["dt"], x["A"], x["B"], x["C"], D=x["D"])

    def conv(f, x):
        return f(x["x"], x["weight"], x["bias"], activation="silu")

    def conv_step(f, x):
        return f(x["x"], x["state"], x["weight"], x["bias"], activation="silu")

    def conv_inputs(time_steps):
        channels = 4096 // s
        x = randn(device, half, 2 if time_steps else 64, channels, *((time_steps,) if time_steps else ()))
        return dict(x=x, weight=randn(device, half, channels, 4), bias=randn(device, half, channels),
                    state=randn(device, half, 64, channels, 3))

    def linear_attention(f, x):
        return f(x["q"], x["k"], x["v"], x["log_decay"])

    linear_shape = dict(batch=2, heads=8, length=4096 // s, features=64, dim=64)
    linear_runners = {**runners("causal_linear_attention", device, linear_attention, ("torch", "triton")),
                      "fla": fla if isinstance(fla, str) else fla_linear_attention(fla)}
    update_names = ("torch", "triton", "mamba_ssm")
    conv_names = ("torch", "triton", "causal_conv1d")
    scan_label = ", ".join(f"{k} {v}" for k, v in scan_shape.items())
    dispatch = {"hybridlm.ops (default choice)": lambda x: update(ops.selective_state_update, x)}
    triton_update = backend("selective_state_update", "triton", device)
    if device == "cuda" and not isinstance(triton_update, str):
        dispatch["triton, CUDA graph"] = graphed(lambda x: update(triton_update, x))
    return [
        Case("ssd_chunk_scan forward", ssd_label, lambda: ssd_inputs(device, dtype=half, **ssd_shape), ssd_runners),
        Case("ssd_chunk_scan forward+backward", ssd_label, lambda: ssd_inputs(device, dtype=half, **ssd_shape),
             ssd_runners, backward=True),
        Case("selective_state_update (Mamba-2 decode)", f"batch 64, heads 16, head_dim 64, dstate {128 // s}",
             lambda: update_inputs(device, 64, 16, 64, 128 // s, half),
             {**runners("selective_state_update", device, update, update_names), **dispatch}),
        Case("selective_state_update (Mamba-1 decode)", f"batch 64, dim {4096 // s}, dstate 16",
             lambda: update_inputs(device, 64, 0, 4096 // s, 16, half),
             runners("selective_state_update", device, update, update_names)),
        Case("selective_scan forward", scan_label, lambda: scan_inputs(device, dtype=half, **scan_shape),
             runners("selective_scan", device, scan, scan_names)),
        Case("selective_scan forward+backward", scan_label, lambda: scan_inputs(device, dtype=half, **scan_shape),
             runners("selective_scan", device, scan, scan_names), backward=True),
        Case("causal_conv1d forward", f"batch 2, channels {4096 // s}, length {8192 // s}, width 4",
             lambda: conv_inputs(8192 // s), runners("causal_conv1d", device, conv, conv_names)),
        Case("causal_linear_attention forward", ", ".join(f"{k} {v}" for k, v in linear_shape.items()) + ", fp32",
             lambda: linear_attention_inputs(device, **linear_shape), linear_runners),
        Case("causal_conv1d_update (decode)", f"batch 64, channels {4096 // s}, width 4", lambda: conv_inputs(0),
             runners("causal_conv1d_update", device, conv_step, conv_names)),
    ]


# ---- timing ---------------------------------------------------------------------------------------------------

def first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def timed(run: Callable[[], object], device: str, repeats: int) -> float:
    """Median milliseconds of ``run()`` over ``repeats`` calls after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(case: Case, device: str, repeats: int) -> list[dict]:
    inputs = case.make()
    leaves = {k: v.requires_grad_() for k, v in inputs.items() if v.is_floating_point()} if case.backward else {}
    rows, reference = [], None
    for label, runner in case.runners.items():
        row = {"case": case.name, "shape": case.shape, "backend": label}
        rows.append(row)
        if isinstance(runner, str):
            row["skipped"] = runner
            continue
        try:
            with torch.no_grad():  # on fresh copies: an in-place update must start from the same state everywhere
                output = first_output(runner({k: v.detach().clone() for k, v in inputs.items()}))
            if case.backward:
                grad = torch.ones_like(output)

                def run(runner=runner, grad=grad):
                    torch.autograd.grad(first_output(runner(inputs)), list(leaves.values()), grad, allow_unused=True)
            else:
                def run(runner=runner):
                    runner(inputs)
            with torch.no_grad() if not case.backward else torch.enable_grad():
                row["ms"] = timed(run, device, case.repeats.get(label, repeats))
        except Exception as error:  # a backend that fails here is reported, the others still run
            row["skipped"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        if reference is None:
            reference = output.detach().float()  # the first runner is always the torch reference
        scale = reference.abs().max().clamp_min(1e-30)
        row["rel_error"] = float((output.detach().float() - reference).abs().max() / scale)
    torch_ms = rows[0].get("ms")
    for row in rows:
        if "ms" in row and torch_ms:
            row["speedup_vs_torch"] = torch_ms / row["ms"]
    return rows


def targets(rows: list[dict]) -> list[tuple[str, str]]:
    """The issue's targets: (description, verdict with the measured ratio)."""
    ms = {(row["case"], row["backend"]): row.get("ms") for row in rows}

    def ratio(case, slow, fast, limit, at_least, what):
        a, b = ms.get((case, slow)), ms.get((case, fast))
        if not a or not b:
            missing = [name for name, value in ((slow, a), (fast, b)) if not value]
            return what, f"not measured ({', '.join(missing)} did not run)"
        value = a / b
        ok = value >= limit if at_least else value <= limit
        return what, f"{'PASS' if ok else 'FAIL'}: {value:.2f}"

    ssd, decode = "ssd_chunk_scan forward", "selective_state_update (Mamba-2 decode)"
    return [
        ratio(ssd, "triton", "fla", 1.25, False, "SSD forward: triton time / fla chunk_simple_gla time <= 1.25"),
        ratio(ssd, "torch", "triton", 20, True, "SSD forward: torch time / triton time >= 20"),
        ratio(decode, "torch", "triton", 10, True, "decode state update, batch 64: torch time / triton time >= 10"),
    ]


def markdown(rows: list[dict], goals: list[tuple[str, str]], device_name: str) -> str:
    lines = [f"# Kernel benchmarks on {device_name}", "",
             "Median milliseconds; speed-up over the torch reference; max |error| / max |reference| of the first "
             "output (forward) against the reference. Both SSD sides' times include forming dt x, dt A and D x; "
             "fla's per-head copies of B and C are made before timing.", ""]
    case = None
    for row in rows:
        if row["case"] != case:
            case = row["case"]
            lines += ["", f"## {case} ({row['shape']})", "", "| backend | ms | speed-up vs torch | rel. error |",
                      "|---|---:|---:|---:|"]
        if "ms" in row:
            lines.append(f"| {row['backend']} | {row['ms']:.3f} | {row.get('speedup_vs_torch', 0):.1f}x | "
                         f"{row.get('rel_error', float('nan')):.2e} |")
        else:
            lines.append(f"| {row['backend']} | - | - | {row['skipped']} |")
    lines += ["", "## Targets", ""] + [f"- {what}: **{verdict}**" for what, verdict in goals]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of this script")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: these benchmarks need a GPU (use --device cpu --quick for a smoke test)")
    torch.manual_seed(0)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows, goals, out = [], [], Path(args.out)
    for case in (c for c in cases(args.device, args.quick) if args.only in c.name):
        print(f"{case.name} ({case.shape})", flush=True)
        rows += measure(case, args.device, args.repeats)
        for row in rows:
            if row["case"] == case.name:
                print(f"  {row['backend']:32s} " + (f"{row['ms']:9.3f} ms" if "ms" in row else row["skipped"]))
        if args.device == "cuda":
            torch.cuda.empty_cache()
        goals = targets(rows)  # written after every case: a run cut short keeps what it measured
        out.mkdir(parents=True, exist_ok=True)
        (out / "benchmarks.md").write_text(markdown(rows, goals, device_name))
        (out / "benchmarks.json").write_text(json.dumps({"device": device_name, "rows": rows, "targets": goals},
                                                        indent=1))
    print("\n".join(f"{what}: {verdict}" for what, verdict in goals))
    print(f"wrote {out / 'benchmarks.md'} and {out / 'benchmarks.json'}")


if __name__ == "__main__":
    main()
