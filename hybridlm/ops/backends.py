"""Which implementation runs each op: the torch reference, our Triton or CUDA kernels, or an installed library.

Backends: ``torch`` (the reference: every op, every device), ``triton`` (:mod:`hybridlm.ops.triton`), ``cuda``
(our CUDA selective scan, :mod:`hybridlm.ops.cuda`), ``cpu`` (our C++ CPU kernels, :mod:`hybridlm.ops.cpu_kernels`),
and ``mamba_ssm``, ``causal_conv1d``, ``flash_attn``, ``fla`` (flash-linear-attention) when installed (adapters
in :mod:`hybridlm.ops.external`).

The choice is made per call from the device of the op's first tensor. By default CPU tensors run our C++ CPU kernel
where one exists and can be built (:data:`CPU_BACKENDS`), else the reference, and CUDA tensors the first available
backend in :data:`PREFERENCE` that accepts the call (an adapter declines calls its
library cannot serve exactly, e.g. mamba-ssm's selective scan with an initial state). Choices can be forced:

* ``HYBRIDLM_BACKEND=triton``: every op that has a Triton kernel uses it (the others keep their default);
* ``HYBRIDLM_BACKEND="ssd_chunk_scan=torch,selective_scan=cuda"``: per op (``auto`` restores the default);
* ``with hybridlm.ops.use_backend("triton"):`` or ``use_backend(selective_scan="cuda")``: the same, for a block
  (nested blocks refine the outer ones; the setting is per thread and per asyncio task).

A forced backend that cannot run raises :class:`BackendUnavailable` saying why: nothing falls back silently. The
environment variable is read at first use (:func:`reload_environment` reads it again). Plans are cached per
selection and device type, so a call costs a context-variable read and two dictionary lookups.
:mod:`.backend_report` prints what each op can use and will use (``hybridlm info --backends``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable

import torch

from hybridlm.ops.attention import attention_ref
from hybridlm.ops.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from hybridlm.ops.compressed_attention import causal_compressed_attention_ref
from hybridlm.ops.declined import Declined
from hybridlm.ops.delta_rule import gated_delta_rule_ref, gated_delta_rule_step_ref
from hybridlm.ops.linear_attention import causal_linear_attention_ref
from hybridlm.ops.mamba3 import mamba3_scan_ref, mamba3_step_ref
from hybridlm.ops.packing import PACKING_ARGUMENTS, takes_packing
from hybridlm.ops.paged_attention import paged_attention_ref
from hybridlm.ops.selective_scan import selective_scan_ref, selective_state_update_ref
from hybridlm.ops.ssd import ssd_chunk_scan_ref

ENV_VAR = "HYBRIDLM_BACKEND"
AUTO = "auto"
BACKENDS = ("torch", "triton", "cuda", "cpu", "mamba_ssm", "causal_conv1d", "flash_attn", "fla")
#: backends the default tries on CPU tensors (Triton runs there only in its interpreter, when forced)
CPU_BACKENDS = ("cpu",)
LIBRARIES = ("mamba_ssm", "causal_conv1d", "flash_attn", "fla")  # third-party backends: one importable package each

# The backends of each op, in the order the default tries them on CUDA tensors (expected fastest first, to be
# confirmed by benchmarks/gpu_check.sh; on CPU tensors it tries those of CPU_BACKENDS); the reference comes last.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "attention": ("flash_attn", "torch"),
    "selective_scan": ("cuda", "triton", "mamba_ssm", "cpu", "torch"),
    "selective_state_update": ("triton", "mamba_ssm", "torch"),
    "ssd_chunk_scan": ("triton", "mamba_ssm", "cpu", "torch"),
    "causal_conv1d": ("causal_conv1d", "triton", "cpu", "torch"),
    "causal_conv1d_update": ("causal_conv1d", "triton", "torch"),
    "causal_linear_attention": ("triton", "torch"),
    "causal_compressed_attention": ("torch",),
    "gated_delta_rule": ("fla", "triton", "cpu", "torch"),
    "gated_delta_rule_step": ("torch",),
    "paged_attention": ("triton", "torch"),
    "mamba3_scan": ("triton", "mamba_ssm", "torch"),
    "mamba3_step": ("triton", "mamba_ssm", "torch"),
}

REFERENCES: dict[str, Callable] = {
    "attention": attention_ref,
    "selective_scan": selective_scan_ref,
    "selective_state_update": selective_state_update_ref,
    "ssd_chunk_scan": ssd_chunk_scan_ref,
    "causal_conv1d": causal_conv1d_ref,
    "causal_conv1d_update": causal_conv1d_update_ref,
    "causal_linear_attention": causal_linear_attention_ref,
    "causal_compressed_attention": causal_compressed_attention_ref,
    "gated_delta_rule": gated_delta_rule_ref,
    "gated_delta_rule_step": gated_delta_rule_step_ref,
    "paged_attention": paged_attention_ref,
    "mamba3_scan": mamba3_scan_ref,
    "mamba3_step": mamba3_step_ref,
}


class BackendUnavailable(RuntimeError):
    """A forced backend cannot run an op here: not installed, no CUDA, no kernel for the op, a declined call..."""


# ---- availability ---------------------------------------------------------------------------------------------

@functools.cache
def _import(module: str):
    """``(module, None)``, or ``(None, why it cannot be imported)``."""
    try:
        return importlib.import_module(module), None
    except ImportError as error:
        return None, f"cannot import {module}: {error}"
    except Exception as error:  # a broken install fails in other ways too (e.g. undefined CUDA symbols)
        return None, f"importing {module} failed: {type(error).__name__}: {error}"


def _triton_interpreted() -> bool:
    """Whether our Triton kernels run in Triton's CPU interpreter. That is fixed when hybridlm.ops.triton is
    imported, so this only asks Triton's setting until then rather than importing (and so fixing) it."""
    common = sys.modules.get("hybridlm.ops.triton._common")
    return common.INTERPRETED if common is not None else _import("triton")[0].knobs.runtime.interpret


def _triton_reason(device_type: str) -> str | None:
    """Checked without importing hybridlm.ops.triton (see :func:`_triton_interpreted`); import errors of that
    package show when it is loaded."""
    triton, reason = _import("triton")
    if triton is None:
        return reason
    if device_type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device"
    if device_type == "cpu":
        if _triton_interpreted():
            return None
        return ("Triton kernels run on CUDA tensors (on CPU tensors only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 before hybridlm.ops.triton is imported)")
    return f"no Triton kernels for {device_type} tensors"


@functools.cache
def _probe(backend: str, op: str, device_type: str) -> str | None:
    if backend not in PREFERENCE[op]:
        return f"no {backend} kernel for {op}"
    if backend == "torch":
        return None
    if backend == "triton":
        return _triton_reason(device_type)
    if backend == "cpu":
        from hybridlm.ops import cpu_kernels

        return cpu_kernels.unavailable_reason() if device_type == "cpu" else f"runs on CPU tensors, not {device_type}"
    if device_type != "cuda":
        return f"{backend} runs on CUDA tensors only, not {device_type}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if backend == "cuda":
        from hybridlm.ops import cuda

        return cuda.unavailable_reason()
    if importlib.util.find_spec(backend) is None:
        return f"{backend} is not installed"
    return None


_loaded: dict[tuple[str, str, str], Callable | str] = {}  # (backend, op, device type) -> function, or why not


def unavailable_reason(backend: str, op: str, device_type: str) -> str | None:
    """Why ``backend`` cannot run ``op`` on ``device_type`` tensors, or None if it can. Builds and loads nothing
    (a kernel not built yet counts as available) but remembers a load that failed."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if op not in PREFERENCE:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(PREFERENCE)}")
    found = _loaded.get((backend, op, device_type))
    return found if isinstance(found, str) else _probe(backend, op, device_type)


def _loader(backend: str, op: str) -> Callable[[], Callable]:
    if backend == "torch":
        return lambda: REFERENCES[op]
    if backend == "triton":
        return lambda: getattr(importlib.import_module("hybridlm.ops.triton"), op)
    if backend == "cuda":
        def load_cuda():
            from hybridlm.ops import cuda

            cuda.load_library()  # builds the extension on first use
            return cuda.selective_scan

        return load_cuda
    if backend == "cpu":
        def load_cpu():
            from hybridlm.ops import cpu_kernels

            cpu_kernels.load_library()  # builds the library on first use
            return getattr(cpu_kernels, op)

        return load_cpu
    from hybridlm.ops.external import LOADERS

    return LOADERS[(backend, op)]


def load(backend: str, op: str, device_type: str) -> Callable:
    """The function running ``op`` on ``backend`` (importing or building it once); raises BackendUnavailable."""
    key = (backend, op, device_type)
    if key not in _loaded:
        reason = unavailable_reason(backend, op, device_type)
        if reason is None:
            try:
                _loaded[key] = _loader(backend, op)()
            except Exception as error:
                _loaded[key] = f"loading failed: {type(error).__name__}: {error}"
        else:
            _loaded[key] = reason
    found = _loaded[key]
    if isinstance(found, str):
        raise BackendUnavailable(f"{op}: backend {backend!r} cannot run on {device_type} tensors: {found}")
    return found


# ---- plans and selections -------------------------------------------------------------------------------------

class Plan:
    """How one op runs on a device type: ``candidates`` tried while they decline (or take no packing), then ``last``."""

    __slots__ = ("candidates", "last", "names", "packing")

    def __init__(self, candidates: tuple[Callable, ...], last: Callable, names: tuple[str, ...]):
        self.candidates, self.last, self.names = candidates, last, names
        self.packing = tuple(map(takes_packing, (*candidates, last)))  # which of them take packed sequences

    def __call__(self, *args, **kwargs):
        packed = bool(kwargs) and any(kwargs.get(name) is not None for name in PACKING_ARGUMENTS)
        for candidate, packs in zip(self.candidates, self.packing):
            try:
                if packs or not packed:
                    return candidate(*args, **kwargs)
            except Declined:
                pass
        if packed and not self.packing[-1]:
            raise BackendUnavailable(f"backend {self.names[-1]!r} cannot take packed sequences (seq_idx / cu_seqlens)")
        return self.last(*args, **kwargs)


def _forced_plan(op: str, backend: str, device_type: str) -> Plan:
    try:
        function = load(backend, op, device_type)
    except BackendUnavailable as error:
        message = str(error)
        @functools.wraps(REFERENCES[op])  # the op's signature (packing included): every call gets this message
        def unavailable(*args, **kwargs):
            raise BackendUnavailable(message)

        return Plan((), unavailable, (backend,))

    @functools.wraps(function)  # adapters, the CUDA scan and the Triton kernels decline what they cannot run
    def strict(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Declined as why:
            raise BackendUnavailable(f"{op}: the forced backend {backend!r} cannot serve this call: {why}") from None

    return Plan((), strict, (backend,))


def default_order(op: str, device_type: str) -> tuple[str, ...]:
    """The backends the default choice tries for ``op`` on ``device_type`` tensors, in order, the reference last:
    all of :data:`PREFERENCE` on CUDA, those of :data:`CPU_BACKENDS` on the CPU, the reference alone elsewhere."""
    if device_type == "cuda":
        return PREFERENCE[op]
    return tuple(b for b in PREFERENCE[op] if device_type == "cpu" and b in CPU_BACKENDS) + ("torch",)


def _default_plan(op: str, device_type: str) -> Plan:
    candidates, names = [], []
    for backend in default_order(op, device_type)[:-1]:
        if unavailable_reason(backend, op, device_type) is not None:
            continue
        try:
            candidates.append(load(backend, op, device_type))
            names.append(backend)
        except BackendUnavailable as error:
            warnings.warn(f"hybridlm: {error}; {op} uses the next backend", RuntimeWarning, stacklevel=4)
    return Plan(tuple(candidates), REFERENCES[op], (*names, "torch"))


class Selection:
    """Forced backends by op (ops not named choose by default), and the plans they imply per device type."""

    def __init__(self, forced: dict[str, str]):
        self.forced = forced
        self.plans: dict[tuple[str, str], Plan] = {}

    def plan(self, op: str, device_type: str) -> Plan:
        key = (op, device_type)
        if key not in self.plans:
            backend = self.forced.get(op)
            self.plans[key] = (
                _default_plan(op, device_type) if backend is None else _forced_plan(op, backend, device_type)
            )
        return self.plans[key]


@functools.cache
def _selection(forced: frozenset[tuple[str, str]]) -> Selection:
    return Selection(dict(forced))


def parse(spec: str, base: dict[str, str] | None = None, source: str = ENV_VAR) -> dict[str, str]:
    """``base`` (op -> backend) updated by ``spec``: comma-separated items, ``name`` for every op that has that
    backend or ``op=name`` for one op; ``auto`` restores the default choice. ``source`` names the setting in
    errors."""
    forced = dict(base or {})
    for item in filter(None, (part.strip() for part in spec.split(","))):
        op, _, backend = (part.strip() for part in item.rpartition("="))
        if backend != AUTO and backend not in BACKENDS:
            raise ValueError(f"{source}: unknown backend {backend!r} in {item!r}; known: {', '.join(BACKENDS)}, auto")
        if op and op not in PREFERENCE:
            raise ValueError(f"{source}: unknown op {op!r} in {item!r}; known: {', '.join(PREFERENCE)}")
        if op and backend != AUTO and backend not in PREFERENCE[op]:
            raise ValueError(f"{source}: there is no {backend} kernel for {op}; it has {', '.join(PREFERENCE[op])}")
        for name in [op] if op else [o for o, names in PREFERENCE.items() if backend == AUTO or backend in names]:
            if backend == AUTO:
                forced.pop(name, None)
            else:
                forced[name] = backend
    return forced


_override: contextvars.ContextVar[Selection | None] = contextvars.ContextVar("hybridlm_backend", default=None)
_environment: Selection | None = None


def _from_environment() -> Selection:
    global _environment
    if _environment is None:
        _environment = _selection(frozenset(parse(os.environ.get(ENV_VAR, "")).items()))
    return _environment


def current() -> Selection:
    """The selection in force here: the innermost :func:`use_backend`, else ``HYBRIDLM_BACKEND``."""
    return _override.get() or _from_environment()


def reload_environment() -> None:
    """Read ``HYBRIDLM_BACKEND`` again and forget what was probed and loaded (e.g. after installing a library)."""
    global _environment
    _environment = None
    _selection.cache_clear()
    _probe.cache_clear()
    _import.cache_clear()
    _loaded.clear()


@contextlib.contextmanager
def use_backend(spec: str | None = None, /, **per_op: str):
    """Force backends inside a ``with`` block: ``use_backend("triton")`` (every op that has a Triton kernel),
    ``use_backend(selective_scan="cuda", ssd_chunk_scan="torch")``, or the ``HYBRIDLM_BACKEND`` syntax."""
    forced = parse(spec or "", current().forced, "use_backend")
    forced = parse(",".join(f"{op}={name}" for op, name in per_op.items()), forced, "use_backend")
    token = _override.set(_selection(frozenset(forced.items())))
    try:
        yield
    finally:
        _override.reset(token)


def in_use_backend_block() -> bool:
    """Whether a :func:`use_backend` block is in force here."""
    return _override.get() is not None


def chosen(op: str, device_type: str) -> tuple[str, ...]:
    """The backends ``op`` tries on ``device_type`` tensors under the current selection, in order (loading them)."""
    return current().plan(op, device_type).names


def runs_reference(op: str, device_type: str) -> bool:
    """Whether ``op`` on ``device_type`` tensors runs its reference under the current selection: a mixer whose
    short forwards have a faster form than the reference's (Mamba-2's per-token states on CPU) takes it only then
    (either form is exact: this picks a speed). True inside ``torch.compile``, where the C++ CPU kernels decline."""
    return torch.compiler.is_compiling() or chosen(op, device_type)[0] == "torch"


class Dispatcher:
    """A public op: runs the current selection's plan for the device of its first tensor argument."""

    def __init__(self, op: str):
        reference = REFERENCES[op]
        functools.update_wrapper(self, reference)
        self.op = op
        self._first = next(iter(inspect.signature(reference).parameters))

    def __call__(self, *args, **kwargs):
        first = args[0] if args else kwargs[self._first]
        # torch.compile cannot read a ContextVar: compiled code runs HYBRIDLM_BACKEND's choice (and
        # hybridlm.decoding.decode_step.DecodeStep refuses to run compiled inside a use_backend block)
        selection = (None if torch.compiler.is_compiling() else _override.get()) or _environment or _from_environment()
        key = (self.op, first.device.type)
        plan = selection.plans.get(key) or selection.plan(*key)
        return plan(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<hybridlm op {self.op}>"

