"""One decode step that reads nothing back to the host, run eagerly or compiled.

:func:`decode_logits` is what ``forward`` does for one token, minus everything that needs a tensor value in
Python: the ids are the model's own choices (checked at prefill: the prompt; the vocabulary bounds the rest), so
they are not range-checked; there is no padding mask (padding only precedes a row's first token, all seen at
prefill); positions come from the cache as a tensor; the position limit was checked for the whole generation
before prefill. The cache's Python counters advance outside the step (:meth:`DecodeStep.__call__`), so the step
itself is a pure tensor program: with a static cache (:mod:`hybridlm.cache.kv.static`) its shapes never change and
``torch.compile(fullgraph=True)`` captures it whole (on CUDA as a CUDA graph with ``mode="reduce-overhead"``).
One exception, for float16 models only: :meth:`DecodeStep.__call__` reads back whether the logits are finite
(an overflow past 65504 raises instead of decoding NaN), outside the step itself.
"""

from __future__ import annotations

import operator
import types
import weakref
from collections.abc import Callable

import torch
import torch.nn.modules.module as module_hooks
from torch._dynamo.utils import counters

from hybridlm.cache import HybridCache
from hybridlm.cache.states import layout_of
from hybridlm.model.modeling import check_float16_range
from hybridlm.ops.attention import CPU_HAS_AMX_BF16
from hybridlm.ops.backends import in_use_backend_block
from hybridlm.ops.cpu_features import dtypes_without_cpu_products

_VERSION = operator.attrgetter("_version")

#: bf16 / fp16, where this CPU has no products of its own in them
DTYPES_WITHOUT_CPU_PRODUCTS = dtypes_without_cpu_products()

#: inductor settings of a CPU step compiled in the default mode: every matrix product through inductor's C++ GEMM
#: template (specialised to the frozen weight's shape), none through MKL, and nothing timed at compile time
CPU_GEMM_TEMPLATES = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}


def decode_logits(model, ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
    """``logits [batch, vocab]`` of token ids ``[batch, 1]`` continuing ``cache`` (a HybridForCausalLM's);
    updates the states in place but not the cache's counters (``cache.advance(None, 1)`` does)."""
    inner = model.model
    hidden, _ = inner.run_blocks(inner.embed_ids(ids), cache, None, cache.positions[:, None], None)
    return model.logits_of(inner.norm(hidden[:, -1]))  # [batch, vocab]


class DecodeStep:
    """``step(tokens [batch], cache) -> logits [batch, vocab]``, advancing the cache by one slot.

    ``compile=True`` runs :func:`decode_logits` through ``torch.compile`` (``fullgraph=True``: a graph break is
    an error, not a silent slowdown) with ``mode`` and ``backend`` (``torch.compile``'s). The default mode is
    ``"reduce-overhead"`` (CUDA graphs) on CUDA. On a CPU it is inductor's default with its C++ matmul templates
    in place of the BLAS calls (:data:`CPU_GEMM_TEMPLATES`): a decode step multiplies a few rows by each frozen
    weight, where the templates are 1.7-1.8x faster than MKL on a small model or SmolLM2-135M at batch 1 and
    even at batch 16, for a compile about 1.5x as long (docs/performance.md); not for a bf16 step of several
    rows on a CPU without AMX-BF16, where they are slower than oneDNN (:meth:`_settings_for`). Where a template
    cannot take a product (weights that are graph inputs, e.g. inference tensors) the compile fails at that
    product; the step then compiles once more without templates (``gemm_templates`` turns False). ``mode="default"``
    never uses them; ``"max-autotune-no-cudagraphs"`` times templates against MKL for each shape and keeps the
    faster, for a compile about twice as long again. On a CPU without bf16 products (AVX2), bf16 weights and int8
    weight-only codes go to our kernel instead, over weights the freezing packs once (:mod:`hybridlm.ops.cpu_linear`).
    A compiled step needs a static cache: with a growing one every step would have new shapes and recompile. It
    runs ``HYBRIDLM_BACKEND``'s kernels (compiled code cannot read a ``use_backend`` block, so it refuses to run
    inside one).

    The compiled step is specialised to the model's weights and to each cache layout it meets, which is what
    makes a small model's step cheap (about 15% of a batch-1 step on CPU, ``benchmarks/decode_speed.py``):

    * the weights are constants of the compiled code (inductor's ``freezing``: folded, prepacked for the CPU's
      matmuls; on CPU the graph's wrapper is C++, ``cpp_wrapper``). Before each step it reads every weight's
      version counter and storage (about 25 us for Mamba-2's peer model's 75, the weights having just left the
      caches) and recompiles when one changed (an in-place update, a reload, ``model.to(dtype)``) or when a
      submodule, parameter or buffer was assigned anew (:class:`StructureWatch`);
    * once a step of a layout (token batch, cache signature, capacity and policy, state kinds, grad mode) has run
      through dynamo's guards without compiling, the layout's later steps skip dynamo altogether: they call the
      code dynamo made for the cache entry whose guards held (:func:`guarded_code`), which reads the cache's
      tensors and runs the compiled graph, as a guard hit would. The guards held for a step like them, and what
      they check is what the layout names. Skipping dynamo's entry and exit (eval frame, stance, dispatch keys)
      made the bundled hybrid's CPU step 1.22x faster (0.53 -> 0.43 ms, ``benchmarks/step_overhead.py``).
      The last step's layout is kept and compared first (cheaper than hashing it). Together with reading the
      weights as two maps, that made the step 1.03x faster for the Mamba-2 peer model and 1.05x for a
      hybrid-tiny-shaped one (old and new steps taking turns, 1 thread, Zen 4). Not noticed: a change to a plain
      attribute the model's forward reads (``module.some_flag = ...``): build a new step.
    """

    def __init__(self, model, compile: bool = False, mode: str | None = None, backend: str = "inductor"):
        if mode is not None and not compile:
            raise ValueError(f"mode={mode!r} is a torch.compile mode: it needs compile=True")
        if mode is not None and mode not in torch._inductor.list_mode_options():
            raise ValueError(f"mode={mode!r} is not a torch.compile mode; known: "
                             f"{', '.join(torch._inductor.list_mode_options())}")
        self.model, self.compiled = model, compile
        self._logits = decode_logits
        if compile:
            device = model.lm_head.weight.device
            self._backend = backend
            self._mode = mode or ("reduce-overhead" if device.type == "cuda" else "default")
            self._cpp_wrapper = device.type == "cpu"
            self.gemm_templates = device.type == "cpu" and mode is None
            self._recompile()

    def _recompile(self) -> None:
        """A fresh compiled step: its own copy of :func:`decode_logits`' code object, so dynamo's cache (kept per
        code object) holds only this step's graphs, never another model's or older weights'."""
        weights = [*self.model.parameters(), *self.model.buffers()]
        # inference tensors (a model made under torch.inference_mode) keep no version counter, so changes to them
        # could not be seen: they stay inputs of the graph, read at every step, and nothing is watched
        freeze = not any(weight.is_inference() for weight in weights)
        self._weights = weights if freeze else []
        self._inductor_settings = {"freezing": freeze, "cpp_wrapper": self._cpp_wrapper,
                                   **(CPU_GEMM_TEMPLATES if self.gemm_templates else {})}
        private = types.FunctionType(decode_logits.__code__.replace(), decode_logits.__globals__, "decode_logits")
        self._logits = torch.compile(private, fullgraph=True, dynamic=False, backend=self._backend,
                                     mode=self._mode if self._backend == "inductor" else None)
        self._compiled_weights = self._weights_state()
        self._structure = StructureWatch(self.model)
        self._private = private
        # layouts whose guards held on a step that compiled nothing: the code that step ran
        self._direct: dict[tuple, Callable] = {}
        self._last: tuple[tuple | None, Callable | None] = (None, None)  # the last step's layout and its code

    def _compile_and_run(self, tokens: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        # inductor reads these where torch.compile's ``options`` do not reach (its freezing pass); the patch does
        with torch._inductor.config.patch(self._settings_for(tokens)):
            return self._logits(self.model, tokens[:, None], cache)

    def _settings_for(self, tokens: torch.Tensor) -> dict:
        """The inductor settings of a step of ``tokens``: without the C++ GEMM templates where they would be
        slower than oneDNN, i.e. plain bf16 weights, several rows, a CPU with bf16 dot products (AVX-512 BF16) but
        without AMX-BF16 (the template has no bf16 dot product; oneDNN uses the CPU's). On a Zen 4 (AVX-512 BF16),
        SmolLM2's 576 x 1,536 product took 68 us against oneDNN's 77 for one row, but 107 against 79 for two and
        954 against 179 for 16; SmolLM2's bf16 step at batch 16 went from 198 ms to 61 with this (eager: 104).
        A CPU without bf16 products (AVX2 only) keeps the templates: there oneDNN's bf16 products fall back to a
        slow path, and the bundled hybrid's bf16 step at batch 16 took 10.9 ms with templates against 22.5
        without (1 thread, medians). fp16 and fp32 templates stay faster at 16 rows; int8 weights keep theirs
        (unmeasured)."""
        slower = (self.gemm_templates and tokens.shape[0] > 1 and not CPU_HAS_AMX_BF16
                  and torch.bfloat16 not in DTYPES_WITHOUT_CPU_PRODUCTS
                  and self.model.lm_head.weight.dtype == torch.bfloat16
                  and all(type(weight.data) is torch.Tensor for weight in self.model.parameters()))
        if not slower:
            return self._inductor_settings
        return {key: value for key, value in self._inductor_settings.items() if key not in CPU_GEMM_TEMPLATES}

    def _weights_state(self) -> tuple[list[int], list[int]]:
        """Every weight's version (an in-place change) and data pointer (``weight.data = ...``, which keeps the
        version). Two maps, not a tuple per weight: this runs before every step, after the step's weights went
        through the caches, and the tuples cost Mamba-2's peer step about 20 us more (of 0.5 ms)."""
        return list(map(_VERSION, self._weights)), list(map(torch.Tensor.data_ptr, self._weights))

    def _layout(self, tokens: torch.Tensor, cache: HybridCache) -> tuple:
        """What the compiled graph is specialised on, besides the weights and the model's structure."""
        return (layout_of(tokens), layout_of(cache.positions), cache.signature, cache.capacity, repr(cache.policy),
                tuple(state.compile_layout() for state in cache.states), torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(), torch.is_autocast_enabled(tokens.device.type),
                torch.get_autocast_dtype(tokens.device.type), self.model.training)

    def __call__(self, tokens: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        if self.compiled:
            if cache.capacity is None:
                raise ValueError("a compiled decode step needs a static cache: model.new_cache(batch, "
                                 "max_length=..., static=True)")
            if in_use_backend_block():
                raise ValueError("a compiled decode step runs HYBRIDLM_BACKEND's kernels and cannot see a "
                                 "use_backend block: set HYBRIDLM_BACKEND, or decode eagerly")
        cache.check_room(1)
        logits = self._compiled_step(tokens, cache) if self.compiled else self._logits(self.model, tokens[:, None],
                                                                                         cache)
        cache.advance(None, 1)
        if logits.dtype == torch.float16:  # as forward does: an overflow is an error, not NaN tokens
            check_float16_range(logits)
        return logits

    def _compiled_step(self, tokens: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        if self._structure.changes or self._weights_state() != self._compiled_weights:
            self._recompile()
        layout = self._layout(tokens, cache)
        last_layout, direct = self._last
        if layout != last_layout:  # equal to the last step's, mostly: cheaper than hashing the nested tuple
            direct = self._direct.get(layout)
            self._last = (layout, direct)
        if direct is not None:
            return direct(self.model, tokens[:, None], cache)
        graphs = counters["stats"]["unique_graphs"]
        try:
            logits = self._compile_and_run(tokens, cache)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            if not (self.gemm_templates and _no_gemm_choice(error)):
                raise
            self.gemm_templates = False  # a product no template takes: compile without them
            self._recompile()
            logits = self._compile_and_run(tokens, cache)
        if counters["stats"]["unique_graphs"] == graphs:  # guarded, and no new graph: an earlier step's held
            self._direct[layout] = guarded_code(self._private, self._logits, self.model, tokens[:, None], cache)
            self._last = (layout, self._direct[layout])
        return logits


def guarded_code(function: types.FunctionType, compiled: Callable, *args) -> Callable:
    """What dynamo runs for ``compiled(*args)`` (``compiled`` is ``torch.compile(function)``) once its guards
    held: the code of ``function``'s first cache entry whose guards pass on ``args``, as a function (dynamo puts
    the compiled graphs it calls in ``function``'s globals). Where this torch keeps its cache entries otherwise,
    ``compiled`` run without guard checks (``skip_guard_eval_unsafe``), which comes to the same."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        local_names = function.__code__.co_varnames[:function.__code__.co_argcount]
        arguments = dict(zip(local_names, args))
        for entry in _debug_get_cache_entry_list(function.__code__):
            if entry.guard_manager.check(arguments):
                return types.FunctionType(entry.code, function.__globals__, function.__name__)
    except (ImportError, AttributeError):
        pass

    def unguarded(*args):
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(*args)

    return unguarded


def _no_gemm_choice(error: BaseException) -> bool:
    """Whether inductor failed for want of a kernel choice for a product (its ``NoValidChoicesError``), anywhere in
    ``error``'s chain of causes."""
    from torch._inductor.select_algorithm import NoValidChoicesError

    while error is not None:
        if isinstance(error, NoValidChoicesError):
            return True
        error = error.__cause__ or error.__context__
    return False


class StructureWatch:
    """Counts submodules, parameters and buffers assigned to ``model``'s modules after it was made (``model.head =
    ...``, ``layer.weight = nn.Parameter(...)``), through torch's global registration hooks: a step compiled
    before such a change is stale, and neither guards (skipped) nor weight versions (a new tensor) would say so.
    The hooks go when the watch does."""

    def __init__(self, model):
        self.modules = {id(module) for module in model.modules()}
        self.changes = 0
        watch = weakref.ref(self)

        def count(module, name, value):
            alive = watch()
            if alive is not None and id(module) in alive.modules:
                alive.changes += 1

        handles = [register(count) for register in (module_hooks.register_module_module_registration_hook,
                                                    module_hooks.register_module_parameter_registration_hook,
                                                    module_hooks.register_module_buffer_registration_hook)]
        weakref.finalize(self, _remove_all, handles)


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()
