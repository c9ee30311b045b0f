"""The Triton kernels on packed sequences (``cu_seqlens`` / ``seq_idx``) against the references on the same packed
input and against each sequence run alone: outputs, per-sequence final states and gradients. Lengths include an
empty sequence, a sequence of one token, a boundary inside a chunk and one exactly on a chunk edge."""

import functools
import importlib
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import ops
from hybridlm.ops import backends
from hybridlm.ops.causal_conv1d import causal_conv1d_ref
from hybridlm.ops.linear_attention import causal_linear_attention_ref
from hybridlm.ops.selective_scan import selective_scan_ref

from .test_packed_ops import run_both
from .triton_support import DEVICE, check_against_reference, kernels, randn, uniform

CHUNK = 4
LENGTHS = [4, 1, 6, 0, 3]  # boundaries 0, 4 (a chunk edge), 5, 11 (inside a chunk), 11, 14


def packing(kind: str, lengths: list[int]) -> dict:
    """The keyword argument describing ``lengths`` packed in one row (``seq_idx`` cannot hold empty sequences)."""
    lengths = torch.tensor(lengths, device=DEVICE)
    if kind == "cu_seqlens":
        return {"cu_seqlens": torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])}
    kept = lengths[lengths > 0]
    return {"seq_idx": torch.repeat_interleave(torch.arange(len(kept), device=DEVICE), kept)[None]}


def n_seqs(kind: str) -> int:
    return len(LENGTHS) if kind == "cu_seqlens" else sum(n > 0 for n in LENGTHS)


def same_error(kernel, reference, **inputs) -> None:
    """The kernel refuses bad packed input with the reference's error."""
    with pytest.raises(ValueError) as expected:
        reference(**inputs)
    with pytest.raises(ValueError) as got:
        kernel(**inputs)
    assert str(got.value) == str(expected.value)


# ---- linear attention ------------------------------------------------------------------------------------------

def linear_attention_inputs(time: int, states: int | None, heads=2, features=3, dim=4) -> dict:
    return dict(q=uniform(1, heads, time, features, low=0.0, high=1.0),
                k=uniform(1, heads, time, features, low=0.0, high=1.0), v=randn(1, heads, time, dim),
                log_decay=-uniform(1, heads, time, low=0.0, high=0.5),
                initial_state=None if states is None else randn(states, heads, dim, features))


@pytest.mark.parametrize("kind", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("with_state", [False, True])
def test_linear_attention_packed_matches_reference(kind, with_state):
    torch.manual_seed(0)
    inputs = linear_attention_inputs(sum(LENGTHS), n_seqs(kind) if with_state else None)
    check_against_reference(kernels.causal_linear_attention, causal_linear_attention_ref,
                            {**inputs, **packing(kind, LENGTHS)}, chunk_size=CHUNK)


def test_linear_attention_packed_equals_each_sequence_alone():
    torch.manual_seed(1)
    inputs = linear_attention_inputs(sum(LENGTHS), len(LENGTHS))
    state = inputs.pop("initial_state")
    run_both(kernels.causal_linear_attention, LENGTHS, inputs, dict(q=2, k=2, v=2, log_decay=2, out=2), state, 1,
             chunk_size=CHUNK)


def test_packed_linear_attention_while_capturing_reads_cu_seqlens_on_the_device_only(monkeypatch):
    """As the SSD (same chunk table): under CUDA-graph capture (simulated) ``cu_seqlens`` never goes to the host."""
    chunks = importlib.import_module("hybridlm.ops.triton.chunks")
    monkeypatch.setattr(chunks, "_capturing", lambda device: True)
    monkeypatch.setattr(chunks, "packed_sequences", lambda *a, **k: pytest.fail("cu_seqlens read on the host"))
    torch.manual_seed(7)
    inputs = {**linear_attention_inputs(sum(LENGTHS), len(LENGTHS)), **packing("cu_seqlens", LENGTHS)}
    check_against_reference(kernels.causal_linear_attention, causal_linear_attention_ref, inputs, chunk_size=CHUNK)


def test_linear_attention_bad_packing_is_the_references_error():
    inputs = linear_attention_inputs(sum(LENGTHS), 2)
    for bad in (packing("cu_seqlens", LENGTHS), {"cu_seqlens": torch.tensor([0, 3, 2, 14], device=DEVICE)}):
        same_error(kernels.causal_linear_attention, causal_linear_attention_ref, **inputs, **bad)
    two_rows = {k: torch.cat([v, v]) for k, v in linear_attention_inputs(5, None).items() if v is not None}
    same_error(kernels.causal_linear_attention, causal_linear_attention_ref, **two_rows,
               cu_seqlens=torch.tensor([0, 5], device=DEVICE))


# ---- causal conv1d ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("width, with_state, activation", [(4, True, "silu"), (3, False, None), (1, True, None)])
def test_conv_packed_matches_reference(kind, width, with_state, activation):
    torch.manual_seed(2)
    channels = 5
    inputs = dict(x=randn(1, channels, sum(LENGTHS)), weight=randn(channels, width), bias=randn(channels),
                  initial_state=randn(n_seqs(kind), channels, width - 1) if with_state else None)
    check_against_reference(kernels.causal_conv1d, causal_conv1d_ref, {**inputs, **packing(kind, LENGTHS)},
                            activation=activation)


def test_conv_packed_across_time_tiles_equals_each_sequence_alone():
    """Boundaries on both sides of the kernels' 64-token time tiles, one sequence spanning two tiles."""
    torch.manual_seed(3)
    lengths, channels, width = [1, 63, 70, 2, 0, 3], 3, 4
    tensors = dict(x=randn(1, channels, sum(lengths)), weight=randn(channels, width), bias=randn(channels))
    run_both(kernels.causal_conv1d, lengths, tensors, dict(x=2, out=2), randn(len(lengths), channels, width - 1), 3,
             activation="silu")


def test_conv_bad_packing_is_the_references_error():
    x, weight = randn(1, 3, sum(LENGTHS)), randn(3, 4)
    for bad in (dict(initial_state=randn(2, 3, 3), **packing("cu_seqlens", LENGTHS)),
                dict(seq_idx=torch.tensor([[0, 0, 2]], device=DEVICE)[:, :1].expand(1, sum(LENGTHS)) + 1)):
        same_error(kernels.causal_conv1d, causal_conv1d_ref, x=x, weight=weight, **bad)
    same_error(kernels.causal_conv1d, causal_conv1d_ref, x=torch.cat([x, x]), weight=weight,
               cu_seqlens=torch.tensor([0, sum(LENGTHS)], device=DEVICE))


# ---- selective scan --------------------------------------------------------------------------------------------

def scan_inputs(time: int, states: int | None, dim=4, dstate=3, groups=None) -> dict:
    bc = (1, dstate, time) if groups is None else (1, groups, dstate, time)
    return dict(u=randn(1, dim, time), delta=randn(1, dim, time, scale=0.5), A=-uniform(dim, dstate, low=0.2, high=1.2),
                B=randn(*bc), C=randn(*bc), D=randn(dim), z=randn(1, dim, time), delta_bias=randn(dim, scale=0.1),
                initial_state=None if states is None else randn(states, dim, dstate))


@pytest.mark.parametrize("kind", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("with_state", [False, True])
def test_selective_scan_packed_matches_reference(kind, with_state):
    torch.manual_seed(4)
    inputs = scan_inputs(sum(LENGTHS), n_seqs(kind) if with_state else None, groups=2)
    check_against_reference(kernels.selective_scan, selective_scan_ref, {**inputs, **packing(kind, LENGTHS)},
                            delta_softplus=True, chunk_size=CHUNK)


def test_selective_scan_packed_across_chunks_equals_each_sequence_alone():
    """Default chunks of 16: a sequence spanning three chunks, boundaries inside and on chunk edges."""
    torch.manual_seed(5)
    lengths = [1, 15, 0, 35, 2, 11]  # boundaries 0, 1, 16 (an edge), 16, 51, 53, 64 (an edge)
    inputs = scan_inputs(sum(lengths), len(lengths))
    state = inputs.pop("initial_state")
    run_both(kernels.selective_scan, lengths, inputs, dict(u=2, delta=2, B=2, C=2, z=2, out=2), state, 5,
             delta_softplus=True)


def test_selective_scan_bad_packing_is_the_references_error():
    inputs = scan_inputs(sum(LENGTHS), 3)
    same_error(kernels.selective_scan, selective_scan_ref, **inputs, **packing("cu_seqlens", LENGTHS))
    same_error(kernels.selective_scan, selective_scan_ref, **{**inputs, "initial_state": None},
               cu_seqlens=torch.tensor([0, 2, 20], device=DEVICE))


# ---- any lengths -----------------------------------------------------------------------------------------------

lengths_lists = st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda n: sum(n) > 0)


@settings(max_examples=4, deadline=None)
@given(lengths=lengths_lists, chunk=st.sampled_from([2, 4]), with_state=st.booleans(), seed=st.integers(0, 99))
def test_any_packing_matches_the_references(lengths, chunk, with_state, seed):
    torch.manual_seed(seed)
    time, n = sum(lengths), len(lengths) if with_state else None
    cu = packing("cu_seqlens", lengths)
    conv = dict(x=randn(1, 3, time), weight=randn(3, 3), bias=randn(3), initial_state=randn(n, 3, 2) if n else None)
    check_against_reference(kernels.causal_conv1d, causal_conv1d_ref, {**conv, **cu}, activation="silu")
    check_against_reference(kernels.causal_linear_attention, causal_linear_attention_ref,
                            {**linear_attention_inputs(time, n), **cu}, chunk_size=chunk)
    check_against_reference(kernels.selective_scan, selective_scan_ref, {**scan_inputs(time, n), **cu},
                            delta_softplus=True, chunk_size=chunk)


# ---- the backend choice ----------------------------------------------------------------------------------------

TRITON_OPS = [op for op, names in backends.PREFERENCE.items() if "triton" in names]
PACKED_CALLS = {  # op -> (inputs, options) of one packed call
    "causal_conv1d": lambda: (dict(x=randn(1, 3, sum(LENGTHS)), weight=randn(3, 4), initial_state=randn(5, 3, 3)),
                              {}),
    "causal_linear_attention": lambda: (linear_attention_inputs(sum(LENGTHS), len(LENGTHS)), dict(chunk_size=CHUNK)),
    "selective_scan": lambda: (scan_inputs(sum(LENGTHS), len(LENGTHS)), dict(delta_softplus=True)),
}


def packing_parameters(function) -> set[str]:
    return set(inspect.signature(function).parameters) & set(backends.PACKING_ARGUMENTS)


@pytest.mark.parametrize("op", TRITON_OPS)
def test_every_triton_kernel_takes_the_packing_its_reference_takes(op):
    assert packing_parameters(getattr(kernels, op)) == packing_parameters(backends.REFERENCES[op])


@pytest.mark.parametrize("op", sorted(PACKED_CALLS))
def test_a_forced_triton_backend_runs_packed_input(op):
    torch.manual_seed(6)
    inputs, options = PACKED_CALLS[op]()
    cu = packing("cu_seqlens", LENGTHS)
    with ops.use_backend(**{op: "triton"}):
        got = getattr(ops, op)(**inputs, **options, **cu)
    expected = backends.REFERENCES[op](**inputs, **options, **cu)
    for g, e in zip(got, expected):
        assert e.abs().max() > 0
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", sorted(PACKED_CALLS))
def test_the_default_choice_gives_packed_input_to_triton(op):
    """A faster backend that takes no packing (the CUDA scan, mamba-ssm, causal-conv1d) is passed over for packed
    input, and the Triton kernel runs it rather than the reference; unpacked input still reaches the first."""
    calls = []

    def spy(name, function):
        @functools.wraps(function)  # (the signature: whether it takes packing)
        def recorded(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)
        return recorded

    def unpacked_only(*args, initial_state=None, **kwargs):
        calls.append("no packing")
        return backends.REFERENCES[op](*args, initial_state=initial_state, **kwargs)

    plan = backends.Plan((unpacked_only, spy("triton", backends.load("triton", op, DEVICE))),
                         spy("torch", backends.REFERENCES[op]), ("other", "triton", "torch"))
    inputs, options = PACKED_CALLS[op]()
    plan(**inputs, **options, **packing("cu_seqlens", LENGTHS))
    assert calls == ["triton"]
    plan(**{**inputs, "initial_state": None}, **options)
    assert calls == ["triton", "no packing"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the default choice on CUDA tensors needs a GPU")
@pytest.mark.parametrize("op", sorted(PACKED_CALLS))
def test_on_the_gpu_packed_input_runs_on_triton_by_default(op):
    plan = backends.Selection({}).plan(op, "cuda")
    takers = [name for name, packs in zip(plan.names, plan.packing) if packs]
    assert takers[0] == "triton", (plan.names, plan.packing)


def test_a_packed_model_on_the_triton_kernels_equals_each_document_alone():
    """Mamba (conv + selective scan) and Performer (linear attention) layers on a packed row, every op on its
    Triton kernel: logits and parameter gradients equal each document run alone on the references."""
    from tests.helpers import assert_close_rel, tiny_model

    model = tiny_model(3, layer_types=["mamba", "performer"], hidden_size=16).to(DEVICE)
    lengths = [5, 1, 6]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), device=DEVICE)
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    probe = randn(1, sum(lengths), model.config.vocab_size)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    alone = torch.cat([model(ids[:, a:a + n]).logits for a, n in zip(starts, lengths)], dim=1)
    (alone * probe).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with ops.use_backend("triton"):
        packed = model(ids, position_ids=positions).logits
        (packed * probe).sum().backward()
    assert_close_rel(packed, alone)
    for name, p in model.named_parameters():
        assert_close_rel(p.grad, expected[name], 1e-5, allow_zero_reference=True)
