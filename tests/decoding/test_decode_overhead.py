"""The decode step without host synchronisation (hybridlm.decoding.decode_step), the static KV layout
(hybridlm.cache.kv.static)
and the compiled decoder: each checked against one full forward or the eager decoder."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm import CachePolicy
from hybridlm.cache.kv.static import StaticKV
from hybridlm.decoding.decode_step import DecodeStep, decode_logits
from hybridlm.decoding.incremental import IncrementalDecoder
from tests.helpers import assert_close_rel, random_ids, tiny_model

# kinds whose one-token update has fixed shapes (a sliding window's ring and the Linformer keep Python counters)
STATIC_KINDS = "AMSPCD"


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Every Python-level way of reading a tensor's value back (``item``, ``bool``, ``int``, ``float``, ``tolist``,
    use as an index, ``nonzero``, ``torch.equal``) raises :class:`HostRead`."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    saved_equal = torch.equal

    def refuse(name):
        def read(*args, **kwargs):
            raise HostRead(f"the decode step called Tensor.{name}")
        return read

    try:
        for name in names:
            setattr(torch.Tensor, name, refuse(name))
        torch.equal = refuse("equal")
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        torch.equal = saved_equal


def teacher_forced(model, ids, prompt: int, static: bool, mask=None) -> torch.Tensor:
    """Logits ``[batch, time - prompt, vocab]`` of decode steps over ``ids[:, prompt:]`` after a prefill, every
    step run with host reads forbidden."""
    cache = model.new_cache(ids.shape[0], max_length=ids.shape[1] + 3, static=static)
    model(ids[:, :prompt], attention_mask=None if mask is None else mask[:, :prompt], cache=cache)
    step, out = DecodeStep(model), []
    for t in range(prompt, ids.shape[1]):
        with no_host_reads():
            out.append(step(ids[:, t], cache))
    assert cache.seen == ids.shape[1]
    return torch.stack(out, dim=1)


def test_the_guard_catches_a_read():
    with no_host_reads(), pytest.raises(HostRead):
        bool(torch.ones(1).sum() > 0)


@settings(max_examples=6, deadline=None)
@given(pattern=st.text(STATIC_KINDS, min_size=1, max_size=3), moe=st.booleans(), static=st.booleans())
@torch.no_grad()
def test_decode_step_reads_nothing_back_and_equals_the_full_forward(pattern, moe, static):
    model = tiny_model(layer_pattern=pattern, mlp_types=["moe" if moe else "dense"] * len(pattern))
    ids = random_ids(2, 9)
    full = model(ids).logits
    assert_close_rel(teacher_forced(model, ids, 5, static), full[:, 5:], rel=1e-4)


@torch.no_grad()
def test_static_decode_with_left_padding_equals_each_row_alone():
    model = tiny_model(layer_pattern="AS")
    ids = random_ids(2, 8)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False
    batched = teacher_forced(model, ids, 5, True, mask)
    for row, start in ((0, 0), (1, 3)):
        alone = model(ids[row:row + 1, start:]).logits[0, 5 - start:]
        assert_close_rel(batched[row], alone, rel=1e-4)


@torch.no_grad()
def test_static_cache_keeps_its_shapes_and_says_when_full():
    model = tiny_model(layer_pattern="AS")
    cache = model.new_cache(1, max_length=6, static=True)
    kv = cache.states[0]
    assert isinstance(kv, StaticKV) and kv.keys.shape[2] == 6
    model(random_ids(1, 5), cache=cache)
    step = DecodeStep(model)
    step(torch.tensor([3]), cache)
    assert (cache.seen, kv.length, int(kv.filled[0]), kv.keys.shape[2]) == (6, 6, 6, 6)
    assert kv.nbytes() == kv.predicted_nbytes(6)
    with pytest.raises(ValueError, match="max_length=6"):
        step(torch.tensor([3]), cache)
    with pytest.raises(ValueError, match="max_length=6"):
        model(random_ids(1, 1), cache=cache)


@torch.no_grad()
def test_static_cache_rolls_back_and_selects_rows():
    model = tiny_model(layer_pattern="AA")
    ids = random_ids(2, 8)
    cache = model.new_cache(2, max_length=8, static=True)
    model(ids[:, :5], cache=cache)
    step = DecodeStep(model)
    first = [step(ids[:, t], cache) for t in range(5, 8)]
    cache.crop(6)
    again = [step(ids[:, t], cache) for t in range(6, 8)]
    assert_close_rel(torch.stack(again), torch.stack(first[1:]), rel=1e-6)
    row = cache.select(torch.tensor([1]))
    assert row.states[0].filled.tolist() == [8] and row.capacity == 8


def test_static_refuses_what_it_cannot_hold():
    model = tiny_model(layer_pattern="AL")
    with pytest.raises(ValueError, match="linformer"):
        model.new_cache(1, max_length=8, static=True)
    with pytest.raises(ValueError, match="max_length"):
        tiny_model(layer_pattern="A").new_cache(1, static=True)
    with pytest.raises(ValueError, match="SinkWindowKV"):
        tiny_model(layer_pattern="A").new_cache(1, max_length=8, static=True, policy=CachePolicy(window=4))
    with pytest.raises(ValueError, match="static cache"):
        DecodeStep(model, compile=True)(torch.tensor([1]), model.new_cache(1))


def test_stop_check_interval_trades_syncs_for_trailing_padding():
    model = tiny_model(layer_pattern="AS")
    prompts = [[5, 6, 7], [3, 4, 2]]
    free = IncrementalDecoder(model).generate(prompts, max_new_tokens=8)[:, 3:]
    stop = int(free[0, 1])  # row 0 stops at its second token at the latest
    every = IncrementalDecoder(model).generate(prompts, max_new_tokens=8, stop_tokens=[stop], pad_token_id=60)
    fourth = IncrementalDecoder(model, stop_check_interval=4).generate(prompts, max_new_tokens=8,
                                                                       stop_tokens=[stop], pad_token_id=60)
    assert torch.equal(fourth[:, :every.shape[1]], every)  # the same tokens ...
    assert bool((fourth[:, every.shape[1]:] == 60).all())  # ... then only padding up to the next check
    assert fourth.shape[1] - every.shape[1] < 4
    with pytest.raises(ValueError, match="stop_check_interval"):
        IncrementalDecoder(model, stop_check_interval=0)


@torch.no_grad()
def test_the_step_traces_whole():
    """``fullgraph=True``: dynamo finds no data-dependent branch or host read in the step (aot_eager: no
    inductor code generation, so this stays fast)."""
    model = tiny_model(layer_pattern="AMS", mlp_types=["moe", "dense", "none"])
    ids = random_ids(2, 8)
    cache = model.new_cache(2, max_length=8, static=True)
    model(ids[:, :6], cache=cache)
    eager = decode_logits(model, ids[:, 6:7], cache.snapshot())
    traced = torch.compile(decode_logits, fullgraph=True, dynamic=False, backend="aot_eager")
    assert_close_rel(traced(model, ids[:, 6:7], cache), eager, rel=1e-6)


@pytest.mark.slow  # one inductor compile of a two-layer model: about 20 s idle, minutes on a loaded machine
@torch.no_grad()
def test_compiled_decoder_equals_eager():
    model = tiny_model(layer_pattern="AS", mlp_types=["none", "none"])
    prompts = [[5, 6, 7, 8], [3, 4]]
    eager = IncrementalDecoder(model).generate(prompts, max_new_tokens=5)
    compiled = IncrementalDecoder(model, compile=True)
    assert torch.equal(compiled.generate(prompts, max_new_tokens=5), eager)
    ids = random_ids(2, 8)
    cache = model.new_cache(2, max_length=256, static=True)
    model(ids[:, :6], cache=cache)
    expected = decode_logits(model, ids[:, 6:7], cache.snapshot())
    assert_close_rel(compiled.decode_step(ids[:, 6], cache), expected, rel=1e-5)  # strided ids: a new layout

    # the weights are constants of the compiled code: changing them in place, or assigning a new parameter,
    # recompiles
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    assert torch.equal(compiled.generate(prompts, max_new_tokens=5),
                       IncrementalDecoder(model).generate(prompts, max_new_tokens=5))
    model.model.norm.weight = torch.nn.Parameter(torch.rand_like(model.model.norm.weight) + 0.5)
    assert torch.equal(compiled.generate(prompts, max_new_tokens=5),
                       IncrementalDecoder(model).generate(prompts, max_new_tokens=5))


@torch.no_grad()
def test_a_cpu_step_multiplies_through_gemm_templates_or_falls_back_without_them():
    """The default CPU compile runs the products through inductor's C++ GEMM templates and decodes what eager
    decoding does; weights that are inference tensors (graph inputs, not frozen constants: no template takes
    them) fail that compile, and the step compiles again without templates, decoding the same tokens."""
    prompts = [[5, 6, 7, 8], [3, 4]]
    model = tiny_model(layer_pattern="AS", mlp_types=["dense", "none"])
    eager = IncrementalDecoder(model).generate(prompts, max_new_tokens=4)
    compiled = IncrementalDecoder(model, compile=True)
    assert torch.equal(compiled.generate(prompts, max_new_tokens=4), eager)
    assert compiled.decode_step.gemm_templates
    with torch.inference_mode():
        frozen_out = tiny_model(layer_pattern="AS", mlp_types=["dense", "none"])
        decoder = IncrementalDecoder(frozen_out, compile=True)
        assert torch.equal(decoder.generate(prompts, max_new_tokens=4),
                           IncrementalDecoder(frozen_out).generate(prompts, max_new_tokens=4))
    assert not decoder.decode_step.gemm_templates
    assert not IncrementalDecoder(model, compile="default").decode_step.gemm_templates


def test_bf16_steps_of_several_rows_compile_without_gemm_templates_on_a_cpu_with_bf16_products_but_no_amx(
        monkeypatch):
    """inductor's C++ GEMM templates multiply bf16 slower than oneDNN from two rows on where the CPU has bf16 dot
    products but no AMX-BF16 (5x at 16 rows on a Zen 4): such a step compiles without them; one row, an AMX CPU,
    a CPU without bf16 products (where oneDNN's bf16 is the slower: 2x at 16 rows on an AVX2 EPYC), or fp32 keep
    them."""
    import hybridlm.decoding.decode_step as decode_step_module

    for dtype, amx, bf16_products, batch, templates in (
            (torch.bfloat16, False, True, 2, False), (torch.bfloat16, False, True, 1, True),
            (torch.bfloat16, True, True, 2, True), (torch.bfloat16, False, False, 2, True),
            (torch.float32, False, True, 2, True)):
        monkeypatch.setattr(decode_step_module, "CPU_HAS_AMX_BF16", amx)
        monkeypatch.setattr(decode_step_module, "DTYPES_WITHOUT_CPU_PRODUCTS",
                            frozenset() if bf16_products else frozenset({torch.bfloat16}))
        step = DecodeStep(tiny_model(layer_pattern="A").to(dtype), compile=True, backend="eager")
        assert step.gemm_templates
        settings = step._settings_for(torch.zeros(batch, dtype=torch.long))
        assert ("max_autotune" in settings) == templates, (dtype, amx, bf16_products, batch)
        assert settings["freezing"] and settings["cpp_wrapper"]


def test_a_compile_mode_needs_compile_and_a_known_name():
    model = tiny_model(layer_pattern="AS")
    with pytest.raises(ValueError, match="needs compile=True"):
        DecodeStep(model, mode="max-autotune-no-cudagraphs")
    with pytest.raises(ValueError, match="'fastest' is not a torch.compile mode"):
        DecodeStep(model, compile=True, mode="fastest")
    with pytest.raises(ValueError, match="'fastest' is not a torch.compile mode"):
        IncrementalDecoder(model, compile="fastest")


@pytest.mark.slow  # inductor times its C++ matmul templates for each weight shape: about half a minute
@torch.no_grad()
def test_a_max_autotune_step_equals_eager():
    """One layer and one compile (autotuning times every product's shape); the generated tokens of compiled
    steps are compared with eager ones in the tests above."""
    model = tiny_model(layer_pattern="A", mlp_types=["none"])
    compiled = IncrementalDecoder(model, compile="max-autotune-no-cudagraphs")
    assert compiled.decode_step._mode == "max-autotune-no-cudagraphs"
    ids = random_ids(2, 8)
    cache = model.new_cache(2, max_length=256, static=True)
    model(ids[:, :6], cache=cache)
    expected = decode_logits(model, ids[:, 6:7], cache.snapshot())
    assert_close_rel(compiled.decode_step(ids[:, 6].contiguous(), cache), expected, rel=1e-5)


def test_the_structure_watch_counts_assignments_to_the_models_own_modules_only():
    import gc

    from hybridlm.decoding.decode_step import StructureWatch

    model, other = tiny_model(layer_pattern="A"), torch.nn.Linear(2, 2)
    watch = StructureWatch(model)
    other.weight = torch.nn.Parameter(torch.zeros(2, 2))
    model.model.norm.register_buffer("extra", torch.zeros(1))
    assert watch.changes == 1
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())
    assert watch.changes == 3
    hooks = len(torch.nn.modules.module._global_module_registration_hooks)
    del watch
    gc.collect()
    assert len(torch.nn.modules.module._global_module_registration_hooks) == hooks - 1


def test_a_compiled_step_skips_dynamo_for_a_layout_only_after_a_guarded_step_compiled_nothing():
    """Dynamo and its guards are skipped only for layouts (tokens, cache tensors' shapes and strides, plain state
    fields, grad mode) whose guards held on a step that compiled no new graph; anything else runs guarded (and
    compiles if it must). The eager backend keeps this fast: what is tested is the bookkeeping, not inductor."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    model = tiny_model(layer_pattern="SA", mlp_types=["none", "none"])
    step = DecodeStep(model, compile=True, backend="eager")
    ids = random_ids(2, 12)
    cache = model.new_cache(2, max_length=12, static=True)
    history = []  # per step: (trusted before it ran, graphs it compiled)
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        reference = cache.snapshot()
        for t in range(4, 9):
            trusted, graphs = step._layout(ids[:, t], cache) in step._direct, counters["stats"]["unique_graphs"]
            logits = step(ids[:, t], cache)
            history.append((trusted, counters["stats"]["unique_graphs"] - graphs))
            assert_close_rel(logits, decode_logits(model, ids[:, t:t + 1], reference), rel=1e-6)
            reference.advance(None, 1)
        assert history[0] == (False, 1) and history[-1] == (True, 0)
        assert all(not trusted for (trusted, _), (_, compiled) in zip(history[1:], history) if compiled)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert step._layout(ids[:, 9], cache) not in step._direct
        assert step._layout(ids[:, 9], cache) in step._direct
        # a trusted layout runs the code dynamo made for it, without dynamo (this torch keeps its cache entries)
        entries = _debug_get_cache_entry_list(step._private.__code__)
        assert step._direct[step._layout(ids[:, 9], cache)].__code__ in [entry.code for entry in entries]
        one_row, rows = cache.select(torch.tensor([1])), reference.select(torch.tensor([1]))
        assert step._layout(ids[1:, 9], one_row) not in step._direct
        assert_close_rel(step(ids[1:, 9], one_row), decode_logits(model, ids[1:, 9:10], rows), rel=1e-6)


def test_alternating_layouts_each_run_their_own_trusted_code():
    """The step keeps the last layout it ran and compares the next with it before looking it up: a layout that
    repeats right after it became trusted, or that takes turns with another (a batch and one of its rows), runs
    its own trusted code, without dynamo, and decodes what the step's function does."""
    model = tiny_model(layer_pattern="SA", mlp_types=["none", "none"])
    step = DecodeStep(model, compile=True, backend="eager")
    ids = random_ids(2, 12)
    batch = model.new_cache(2, max_length=12, static=True)
    with torch.no_grad():
        model(ids[:, :4], cache=batch)
        row = batch.select(torch.tensor([1]))
        for t in (4, 5):
            step(ids[:, t], batch)
            step(ids[1:, t], row)  # trusted at t = 5: it ran guarded without compiling
        step(ids[:, 6], batch)  # trusted now (dynamo compiled the batch's layout twice)
        guarded = []
        compile_and_run = step._compile_and_run
        step._compile_and_run = lambda *args: guarded.append(args) or compile_and_run(*args)
        for t, rows, cache in ((7, slice(0, 2), batch), (8, slice(0, 2), batch), (6, slice(1, 2), row),
                               (7, slice(1, 2), row), (9, slice(0, 2), batch)):
            expected = decode_logits(model, ids[rows, t:t + 1], cache.snapshot())
            assert_close_rel(step(ids[rows, t], cache), expected, rel=1e-6)
    assert not guarded


def test_a_model_made_under_inference_mode_compiles_without_freezing():
    """Its weights are inference tensors, which keep no version counter: they stay graph inputs."""
    with torch.inference_mode():
        model = tiny_model(layer_pattern="SA", mlp_types=["none", "none"])
        ids = random_ids(1, 6)
        cache = model.new_cache(1, max_length=8, static=True)
        model(ids[:, :5], cache=cache)
        expected = decode_logits(model, ids[:, 5:], cache.snapshot())
        step = DecodeStep(model, compile=True, backend="eager")
        assert_close_rel(step(ids[:, 5], cache), expected, rel=1e-6)
    assert step._inductor_settings["freezing"] is False


def test_compile_layouts_tell_apart_what_the_step_reads():
    """Tensor strides and plain fields are part of a state's layout; the static KV's Python length (advanced
    outside the step) is not."""
    model = tiny_model(layer_pattern="SA", mlp_types=["none", "none"])
    cache = model.new_cache(2, max_length=12, static=True)
    ssm, kv = cache.states
    before = [state.compile_layout() for state in cache.states]
    kv.advance(1)
    assert kv.compile_layout() == before[1]
    ssm.checkpoint_limit = 4
    assert ssm.compile_layout() != before[0]
    ssm.checkpoint_limit, ssm.conv = 0, ssm.conv.transpose(1, 2).contiguous().transpose(1, 2)
    assert ssm.compile_layout() != before[0]


def test_a_state_group_layout_follows_its_parts_changed_in_place():
    """A state's layout is kept until a field is assigned; a group's parts live in a dict, which changes without
    an assignment to the group, so a group's layout is never kept."""
    from hybridlm.cache.states import SSMState, StateGroup

    part = SSMState(torch.zeros(2, 4, 3), torch.zeros(2, 4, 8))
    group = StateGroup({"mamba": part})
    before = group.compile_layout()
    group.parts["second"] = SSMState(torch.zeros(2, 4, 3), torch.zeros(2, 4, 8))
    assert group.compile_layout() != before
    del group.parts["second"]
    assert group.compile_layout() == before
    part.ssm = torch.zeros(2, 4, 16)
    assert group.compile_layout() != before


def test_a_compiled_step_refuses_a_use_backend_block():
    from hybridlm.ops import use_backend

    model = tiny_model(layer_pattern="A")
    with use_backend("torch"), pytest.raises(ValueError, match="use_backend"):
        DecodeStep(model, compile=True)(torch.tensor([1]), model.new_cache(1, max_length=8, static=True))



def test_moe_routes_densely_only_where_it_costs_little():
    """Eager, a batch-1 step of an 8-expert top-2 MoE stays sparse (reading every expert's weights would cost 4x);
    a batch whose choices reach every expert runs them all (compiled steps always do: test_the_step_traces_whole);
    a long forward never does."""
    from hybridlm.layers.mlp import DENSE_ROUTING_TOKENS, MoE

    model = tiny_model(layer_pattern="A", mlp_types=["moe"], num_experts=8)
    moe = next(module for module in model.modules() if isinstance(module, MoE))
    assert [moe.routes_densely(tokens) for tokens in (1, 3, 4, DENSE_ROUTING_TOKENS + 1)] == [False, False, True,
                                                                                                False]


@torch.no_grad()
def test_a_compiled_batch_one_moe_step_branches_per_expert():
    """Compiled on CPU, a step whose choices cannot reach every expert keeps fixed shapes yet runs only the
    chosen experts: one ``torch.cond`` per expert in the traced graph, and the same logits as the sparse eager
    step. With a batch whose choices reach every expert, no branch (all experts run)."""
    from hybridlm.layers.mlp import MoE

    def traced_conds(ids: torch.Tensor, cache) -> tuple[torch.Tensor, int]:
        conds = []

        def backend(graph, inputs):
            conds.extend(node for node in graph.graph.nodes if node.target is torch.ops.higher_order.cond)
            return graph.forward

        traced = torch.compile(decode_logits, fullgraph=True, dynamic=False, backend=backend)
        return traced(model, ids, cache), len(conds)

    model = tiny_model(layer_pattern="A", mlp_types=["moe"], num_experts=8)
    moe = next(module for module in model.modules() if isinstance(module, MoE))
    for batch, branches in ((1, len(moe.experts)), (4, 0)):
        torch._dynamo.reset()
        ids = random_ids(batch, 7)
        cache = model.new_cache(batch, max_length=8, static=True)
        model(ids[:, :6], cache=cache)
        eager = decode_logits(model, ids[:, 6:7], cache.snapshot())
        logits, conds = traced_conds(ids[:, 6:7], cache)
        assert_close_rel(logits, eager, rel=1e-6)
        assert conds == branches
