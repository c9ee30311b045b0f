"""Backend selection: defaults, forcing by environment variable and context manager, errors, the report, and the
adapters' translation of third-party signatures (against stand-ins that enforce those libraries' documented
argument rules)."""

from __future__ import annotations

import inspect
import re
import sys
import threading
import types

import pytest
import torch
import torch.nn.functional as F

from hybridlm import ops
from hybridlm.ops import backends, external
from hybridlm.ops.backends import BACKENDS, CPU_BACKENDS, ENV_VAR, PREFERENCE, REFERENCES, BackendUnavailable, Declined
from tests.helpers import assert_close_rel

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    """Every test starts from an unset HYBRIDLM_BACKEND and forgets what earlier tests probed."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    backends.reload_environment()
    yield
    monkeypatch.delenv(ENV_VAR, raising=False)
    backends.reload_environment()


def sample_call(op: str, device: str) -> tuple[tuple, dict]:
    """Small fp32 arguments for ``op``."""
    generator = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    calls = {
        "attention": ((r(1, 4, 5, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)), {"causal": True}),
        "selective_scan": ((r(2, 4, 7), r(2, 4, 7).sigmoid(), -r(4, 3).exp(), r(2, 3, 7), r(2, 3, 7)),
                           {"D": r(4), "z": r(2, 4, 7)}),
        "selective_state_update": ((r(2, 4, 3), r(2, 4), r(2, 4).sigmoid(), -r(4, 3).exp(), r(2, 3), r(2, 3)), {}),
        "ssd_chunk_scan": ((r(1, 9, 2, 4), r(1, 9, 2).sigmoid(), -r(2).exp(), r(1, 9, 1, 3), r(1, 9, 1, 3), 4), {}),
        "causal_conv1d": ((r(2, 8, 7), r(8, 4)), {"activation": "silu", "initial_state": r(2, 8, 3)}),
        "causal_conv1d_update": ((r(2, 8), r(2, 8, 3), r(8, 4)), {"activation": "silu"}),
        "causal_linear_attention": ((r(1, 2, 6, 4), r(1, 2, 6, 4).exp(), r(1, 2, 6, 3), -r(1, 2, 6).abs()), {}),
        "causal_compressed_attention": ((r(1, 2, 6, 4), r(1, 2, 6, 4), r(1, 2, 6, 4), r(1, 6, 3), r(1, 6, 3)),
                                        {"scale": 0.5}),
        "gated_delta_rule": ((r(1, 9, 1, 4), r(1, 9, 1, 4), r(1, 9, 2, 3), -r(1, 9, 2).exp(), r(1, 9, 2).sigmoid()),
                             {"chunk_size": 4}),
        "gated_delta_rule_step": ((r(2, 2, 4, 3), r(2, 1, 4), r(2, 1, 4), r(2, 2, 3), -r(2, 2).exp(),
                                   r(2, 2).sigmoid()), {}),
        "paged_attention": ((r(2, 4, 1, 8), r(5, 2, 3, 8), r(5, 2, 3, 8), torch.tensor([[4, 0], [1, 3]]).to(device),
                             torch.tensor([5, 2]).to(device)), {"scale": 0.3}),
        "mamba3_scan": ((r(2, 9, 1, 1, 8), r(2, 9, 1, 1, 8), r(2, 9, 2, 4), -r(2, 9, 2).exp(), r(2, 9, 2).sigmoid(),
                         r(2, 9, 2), r(2, 9, 2, 2), r(2, 1, 8), r(2, 1, 8)), {"D": r(2), "z": r(2, 9, 2, 4),
                                                                             "chunk_size": 4}),
        "mamba3_step": ((r(2, 1, 1, 8), r(2, 1, 1, 8), r(2, 2, 4), -r(2, 2).exp(), r(2, 2).sigmoid(), r(2, 2),
                         r(2, 2, 2), r(2, 1, 8), r(2, 1, 8), r(2, 2, 2), r(2, 2, 4, 8), r(2, 1, 2, 8), r(2, 2, 4)),
                        {"D": r(2)}),
    }
    return calls[op]


def run(function, args, kwargs) -> list[torch.Tensor]:
    """The outputs of ``function`` on copies of the arguments, followed by those arguments (for in-place updates)."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = function(*args, **kwargs)
    flat = list(out) if isinstance(out, tuple) else [out]
    flat = [t for item in flat for t in (item if isinstance(item, tuple) else (item,))]
    return flat + [a for a in args if isinstance(a, torch.Tensor)]


def test_public_ops_keep_the_reference_signatures():
    for op, reference in REFERENCES.items():
        public = getattr(ops, op)
        assert inspect.signature(public) == inspect.signature(reference), op
        assert public.__doc__ == reference.__doc__


@pytest.mark.parametrize("op", list(PREFERENCE))
def test_cpu_default_is_our_cpu_kernel_where_it_runs_else_the_reference(op):
    ours = [b for b in PREFERENCE[op] if b in CPU_BACKENDS and backends.unavailable_reason(b, op, "cpu") is None]
    assert backends.chosen(op, "cpu") == (*ours, "torch")
    args, kwargs = sample_call(op, "cpu")
    for got, expected in zip(run(getattr(ops, op), args, kwargs), run(REFERENCES[op], args, kwargs), strict=True):
        if ours:  # the same values, rounded differently (tests/ops/test_cpu_kernels.py bounds it)
            assert_close_rel(got, expected, rel=1e-5)
        else:
            assert torch.equal(got, expected)


@pytest.fixture
def interpreted_triton():
    """Our Triton kernels, in Triton's interpreter on a machine without GPU (set up as the Triton tests do)."""
    pytest.importorskip("triton")
    from . import triton_support

    backends.reload_environment()
    return triton_support.kernels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,backend", [(op, backend) for op, names in PREFERENCE.items() for backend in names])
def test_forcing_a_backend_picks_it_or_raises(op, backend, device, request):
    if backend == "triton":
        request.getfixturevalue("interpreted_triton")
    args, kwargs = sample_call(op, device)
    reason = backends.unavailable_reason(backend, op, device)
    if backend == "triton":  # interpreted on a CPU-only machine; where CUDA exists it declines CPU tensors
        assert (reason is None) == (device == "cuda" or not torch.cuda.is_available()), reason
    with ops.use_backend(**{op: backend}):
        if reason is None:
            assert backends.chosen(op, device) == (backend,)
            try:
                got = run(getattr(ops, op), args, kwargs)
            except BackendUnavailable as error:  # an adapter may refuse this call (e.g. flash-attn and fp32)
                assert backend in backends.LIBRARIES and "cannot serve this call" in str(error), error
                return
            for g, e in zip(got, run(REFERENCES[op], args, kwargs), strict=True):
                assert_close_rel(g, e, rel=1e-5)
        else:
            with pytest.raises(BackendUnavailable, match=f"{op}: backend '{backend}'.*{re.escape(reason)}"):
                getattr(ops, op)(*args, **kwargs)


def test_a_backend_without_a_kernel_for_the_op_is_refused():
    with pytest.raises(ValueError, match="no triton kernel for attention; it has flash_attn, torch"):
        with ops.use_backend(attention="triton"):
            pass
    assert backends.unavailable_reason("cuda", "ssd_chunk_scan", "cuda") == "no cuda kernel for ssd_chunk_scan"


def test_forcing_cuda_on_cpu_tensors_says_why():
    args, kwargs = sample_call("selective_scan", "cpu")
    with ops.use_backend("cuda"), pytest.raises(BackendUnavailable, match="runs on CUDA tensors only, not cpu"):
        ops.selective_scan(*args, **kwargs)
    assert backends.current().forced == {}  # the block is over


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, " ssd_chunk_scan=torch , selective_scan=cuda ")
    backends.reload_environment()
    assert backends.current().forced == {"ssd_chunk_scan": "torch", "selective_scan": "cuda"}

    monkeypatch.setenv(ENV_VAR, "triton,selective_scan=auto")
    backends.reload_environment()
    with_triton = {op for op, names in PREFERENCE.items() if "triton" in names} - {"selective_scan"}
    assert backends.current().forced == dict.fromkeys(with_triton, "triton")
    assert "attention" not in backends.current().forced  # no Triton attention: it keeps its default

    for bad, message in [("tritonn", "unknown backend 'tritonn'"), ("attn=torch", "unknown op 'attn'"),
                         ("causal_conv1d=cuda", "no cuda kernel for causal_conv1d")]:
        monkeypatch.setenv(ENV_VAR, bad)
        backends.reload_environment()
        with pytest.raises(ValueError, match=f"{ENV_VAR}: .*{message}"):
            ops.causal_conv1d(*sample_call("causal_conv1d", "cpu")[0])


def test_use_backend_nests_restores_and_is_per_thread():
    seen_in_thread = []
    with ops.use_backend("torch"):
        assert set(backends.current().forced) == set(PREFERENCE)
        with ops.use_backend("selective_scan=auto", ssd_chunk_scan="triton"):
            forced = backends.current().forced
            assert "selective_scan" not in forced and forced["ssd_chunk_scan"] == "triton"
            assert forced["attention"] == "torch"
            thread = threading.Thread(target=lambda: seen_in_thread.append(dict(backends.current().forced)))
            thread.start()
            thread.join()
        assert backends.current().forced["ssd_chunk_scan"] == "torch"
        with pytest.raises(KeyError), ops.use_backend(selective_scan="cuda"):
            raise KeyError
        assert backends.current().forced["selective_scan"] == "torch"
    assert backends.current().forced == {} and seen_in_thread == [{}]


def test_plans_are_built_once_per_selection_and_device():
    args, kwargs = sample_call("causal_conv1d_update", "cpu")
    ops.causal_conv1d_update(*args, **kwargs)
    plan = backends.current().plans[("causal_conv1d_update", "cpu")]
    ops.causal_conv1d_update(*args, **kwargs)
    assert backends.current().plans[("causal_conv1d_update", "cpu")] is plan
    with ops.use_backend("torch"):
        first = backends.current()
    with ops.use_backend("torch"):
        assert backends.current() is first  # the same settings reuse their plans


def test_declining_candidates_fall_through_in_order():
    calls = []

    def declines(x):
        calls.append("declines")
        raise Declined("not this one")

    def accepts(x):
        calls.append("accepts")
        return x + 1

    assert backends.Plan((declines, accepts), lambda x: x - 1, ("a", "b", "torch"))(1) == 2
    assert backends.Plan((declines,), lambda x: x - 1, ("a", "torch"))(1) == 0
    assert calls == ["declines", "accepts", "declines"]


def test_a_forced_adapter_that_declines_raises(monkeypatch):
    def load(backend, op, device_type):
        def declines(*args, **kwargs):
            raise Declined("no initial state")
        return declines

    monkeypatch.setattr(backends, "load", load)
    with ops.use_backend(selective_scan="mamba_ssm"), pytest.raises(
        BackendUnavailable, match="forced backend 'mamba_ssm' cannot serve this call: no initial state"
    ):
        ops.selective_scan(*sample_call("selective_scan", "cpu")[0])


def test_report_lists_every_op_and_backend_with_reasons(monkeypatch):
    text = ops.report("cpu")
    assert f"({ENV_VAR}: unset)" in text
    rows = {cells[0]: cells for cells in map(str.split, text.splitlines()) if cells and cells[0] in PREFERENCE}
    assert set(rows) == set(PREFERENCE)
    header = next(line.split() for line in text.splitlines() if line.startswith("op "))
    assert header == ["op", "uses", *BACKENDS]
    for op, row in rows.items():  # CPU default: our CPU kernel where it runs, else the reference
        ours = [b for b in PREFERENCE[op] if b in CPU_BACKENDS and backends.unavailable_reason(b, op, "cpu") is None]
        uses = " > ".join([*ours, "torch"]).split()
        assert row[1:1 + len(uses)] == uses, row
    assert "runs on CUDA tensors only, not cpu" in text
    monkeypatch.setenv(ENV_VAR, "selective_scan=cuda")
    backends.reload_environment()
    forced_row = next(line for line in ops.report("cpu").splitlines() if line.startswith("selective_scan "))
    assert "cuda (forced) UNAVAILABLE [" in forced_row


# ---- adapters, against stand-ins for the libraries --------------------------------------------------------------

@pytest.fixture
def stand_in(monkeypatch):
    """Installs a fake module under a dotted name (and its parents)."""

    def install(name: str, **functions):
        parts = name.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**functions))

    return install


def test_flash_attention_adapter(stand_in):
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):  # [batch, seq, heads, dim], as flash-attn
        assert q.stride(-1) == 1 and q.dtype in (torch.float16, torch.bfloat16)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2)

    stand_in("flash_attn", flash_attn_func=flash_attn_func)
    attention = external.flash_attention()
    (q, k, v), _ = sample_call("attention", "cpu")
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    assert torch.equal(attention(q, k, v, causal=True, scale=0.3), REFERENCES["attention"](q, k, v, causal=True,
                                                                                           scale=0.3))
    for call, why in [(lambda: attention(q.float(), k.float(), v.float()), "fp16/bf16"),
                      (lambda: attention(q, k, v, mask=torch.ones(5, 5, dtype=torch.bool)), "no explicit mask"),
                      (lambda: attention(q[:, :, :2], k, v, causal=True), "q_len != k_len")]:
        with pytest.raises(Declined, match=why):
            call()


def test_causal_conv1d_adapter_lays_inputs_out_as_the_library_needs(stand_in):
    def causal_conv1d_fn(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
        assert return_final_states and x.stride(1) == 1 and x.stride(2) > 1, "final states need channel-last x"
        assert initial_states is None or (initial_states.dtype == x.dtype and initial_states.stride(1) == 1)
        return REFERENCES["causal_conv1d"](x, weight, bias, initial_state=initial_states, activation=activation)

    stand_in("causal_conv1d", causal_conv1d_fn=causal_conv1d_fn)
    conv = external.causal_conv1d_sequence()
    (x, weight), kwargs = sample_call("causal_conv1d", "cpu")
    for got, expected in zip(run(conv, (x, weight), kwargs), run(REFERENCES["causal_conv1d"], (x, weight), kwargs)):
        assert_close_rel(got, expected, rel=1e-6)
    with pytest.raises(Declined, match="widths 2..4"):
        conv(x, torch.randn(8, 5))
    with pytest.raises(Declined, match="divisible by 8"):
        conv(x[:, :6], weight[:6])


def test_mamba_selective_scan_adapter_refuses_what_mamba_ssm_cannot_do(stand_in):
    def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          return_last_state=False):
        assert delta.dtype == B.dtype == C.dtype == u.dtype and A.dtype == D.dtype == torch.float32
        y, last = REFERENCES["selective_scan"](u, delta, A, B, C, D, z, delta_bias, delta_softplus)
        return y, last.detach().requires_grad_(u.requires_grad)  # mamba-ssm gives the last state no gradient

    stand_in("mamba_ssm.ops.selective_scan_interface", selective_scan_fn=selective_scan_fn)
    scan = external.mamba_selective_scan()
    (u, delta, A, B, C), kwargs = sample_call("selective_scan", "cpu")
    u = u.to(torch.bfloat16).requires_grad_()
    y, last = scan(u, delta, A, B, C, **kwargs)  # fp32 delta, B, C are cast to u's type
    y_ref, last_ref = REFERENCES["selective_scan"](u, delta.bfloat16(), A, B.bfloat16(), C.bfloat16(), D=kwargs["D"],
                                                   z=kwargs["z"].bfloat16())
    assert torch.equal(y, y_ref) and torch.equal(last, last_ref)
    y.float().sum().backward()  # the output's gradient is fine
    with pytest.raises(RuntimeError, match="no gradient for the final state"):
        last.sum().backward()
    with pytest.raises(Declined, match="zero state"):
        scan(u, delta, A, B, C, initial_state=torch.zeros(2, 4, 3))


def test_mamba_ssd_adapter_passes_the_initial_state_and_refuses_packed_sequences(stand_in):
    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, initial_states=None,
                                  return_final_states=False):
        assert return_final_states
        return REFERENCES["ssd_chunk_scan"](x, dt, A, B, C, chunk_size, D, initial_state=initial_states)

    stand_in("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=mamba_chunk_scan_combined)
    ssd = external.mamba_ssd()
    args, _ = sample_call("ssd_chunk_scan", "cpu")
    state = torch.randn(1, 2, 4, 3)
    for got, expected in zip(ssd(*args, initial_state=state), REFERENCES["ssd_chunk_scan"](*args, initial_state=state)):
        assert torch.equal(got, expected)
    with pytest.raises(Declined, match="packed sequences"):
        ssd(*args, cu_seqlens=torch.tensor([0, 4, 9]))
