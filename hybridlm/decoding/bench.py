"""Side-by-side measurements for ``hybridlm bench`` and ``hybridlm demo``: cache bytes and decode speed by
stack, and the chunked scans against a loop over time. Every timing runs warm-up calls first, then repeats and
reports the fastest and the median run (:class:`Timing`): on a busy machine the two drift apart, which shows as
spread instead of a wrong conclusion. Compare the ratios printed in one run, not absolute numbers across
machines."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from hybridlm import ops
from hybridlm.cache import HybridCache, KVLayout, StateGroup
from hybridlm.mixers import mixer_parts
from hybridlm.model import HybridForCausalLM


@dataclass(frozen=True)
class Timing:
    """Milliseconds of repeated runs: the fastest and the median. Formats as ``"min / median"``."""

    min_ms: float
    median_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        if not seconds:
            raise ValueError("Timing needs at least one timed run")
        return cls(1000 * min(seconds), 1000 * statistics.median(seconds))

    def __format__(self, spec: str) -> str:
        return f"{self.min_ms:{spec}} / {self.median_ms:{spec}}"

    @property
    def spread(self) -> float:
        """Median over minimum: 1.0 on a quiet machine, larger as other work interrupts the runs."""
        return self.median_ms / self.min_ms if self.min_ms > 0 else float("inf")


def time_calls(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> Timing:
    """``fn()`` run ``warmup`` times untimed, then ``repeats`` times timed."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return Timing.of(seconds)


def interleaved_timings(calls: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1
                        ) -> dict[str, Timing]:
    """Each call run ``warmup`` times untimed, then all of them timed in turn, ``repeats`` rounds: a change in
    the machine's load then falls on every call alike, and the ratios stay comparable."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    return {name: Timing.of(runs) for name, runs in seconds.items()}


#: A spread (median / min) above this, or ratios of minima and of medians further apart than this, reads as a
#: busy machine: the numbers are printed, no conclusion is drawn from them.
NOISY_SPREAD = 1.25


def speedup_verdict(baseline: dict[int, Timing], candidate: dict[int, Timing]) -> str:
    """One sentence on ``baseline``'s time over ``candidate``'s at each context, worded from the numbers: the
    ratios of medians (and of minima), and a conclusion only when the runs are steady."""
    ratios = {c: baseline[c].median_ms / candidate[c].median_ms for c in baseline}
    minima = {c: baseline[c].min_ms / candidate[c].min_ms for c in baseline}
    stated = ", ".join(f"{ratios[c]:.2f}x at {c // 1024}K (minima {minima[c]:.2f}x)" for c in sorted(ratios))
    spreads = [t.spread for t in (*baseline.values(), *candidate.values())]
    disagree = any(max(ratios[c], minima[c]) / min(ratios[c], minima[c]) > NOISY_SPREAD for c in ratios)
    if max(spreads) > NOISY_SPREAD or disagree:
        return (f"Decode speed-up: {stated}. The machine is busy (median/min spread up to {max(spreads):.2f}x), so "
                "these runs support no conclusion; rerun on an idle machine.")
    ordered = [ratios[c] for c in sorted(ratios)]
    if len(ordered) > 1 and all(b > a for a, b in zip(ordered, ordered[1:])):
        trend = "it grows with the context"
    elif len(ordered) > 1:
        trend = "it does not grow with the context in these runs"
    else:
        trend = "one context measured"
    return f"Decode speed-up: {stated}; {trend}."


def fill_cache(cache: HybridCache, context: int, generator: torch.Generator | None = None) -> None:
    """Make ``cache`` look as if ``context`` tokens had been seen: random keys/values and states. Decode cost
    depends on the sizes only, so this times decoding at long contexts without paying for the prefill."""
    for state in cache.states:
        _fill_state(state, context, generator)
    cache.seen = context
    cache.positions.fill_(context)


def _fill_state(state, context: int, generator) -> None:
    if isinstance(state, StateGroup):
        for part in state.parts.values():
            _fill_state(part, context, generator)
    elif isinstance(state, KVLayout):
        _fill_kv(state, context, generator)
    else:
        for tensor in state._tensors().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.1)


def _fill_kv(state: KVLayout, context: int, generator, chunk: int = 4096) -> None:
    """Random keys and values through the layout's own ``update`` (so a quantized or bounded layout holds what
    it would after ``context`` tokens), ``chunk`` tokens at a time; uniform attention for H2O's mass."""
    batch = state.padding.shape[0]
    for first in range(0, context, chunk):
        time = min(chunk, context - first)
        keys, values = (torch.randn(batch, state.kv_heads, time, state.head_dim, generator=generator,
                                    dtype=state.dtype) * 0.1 for _ in range(2))
        view = state.update(keys, values if state.takes_values else None,
                            torch.arange(first, first + time).expand(batch, time), None, None)
        if state.needs_attention_probs:
            n = view.keys.shape[2]
            state.observe(torch.full((batch, state.kv_heads, 1, n), 1.0 / n))


@torch.no_grad()
def decode_timing(model: HybridForCausalLM, context: int, steps: int = 8, batch: int = 1, warmup: int = 2,
                  policy=None) -> Timing:
    """Time of one decode step with about ``context`` tokens already in the cache (each step adds one), under
    a :class:`~hybridlm.CachePolicy` if given."""
    cache = model.new_cache(batch, max_length=context + warmup + steps + 1, policy=policy)
    fill_cache(cache, context, torch.Generator().manual_seed(0))
    token = torch.zeros(batch, 1, dtype=torch.long)
    return time_calls(lambda: model(token, cache=cache), repeats=steps, warmup=warmup)


def context_rows(models: dict[str, HybridForCausalLM], policies: dict, contexts: list[int], steps: int = 4,
                 warmup: int = 1) -> list[dict]:
    """For each stack and cache policy (``{label: CachePolicy or None}``), at each context: the cache bytes
    held (``nbytes()``), the decode :class:`Timing` and the process's peak RSS while measuring that row (see
    :func:`peak_rss_mib`). The cache is filled through each layout's own update in chunks (:func:`fill_cache`),
    so peak memory stays bounded by the cache."""
    rows = []
    for stack, model in models.items():
        for label, policy in policies.items():
            for context in contexts:
                peak_rss_mib(reset=True)
                cache = model.new_cache(1, policy=policy)
                fill_cache(cache, context)
                held = cache.nbytes()
                del cache  # one cache at a time: the timed one is filled afresh
                rows.append(dict(stack=stack, policy=label, context=context, cache_bytes=held,
                                 decode=decode_timing(model, context, steps, warmup=warmup, policy=policy),
                                 peak_rss_mib=peak_rss_mib()))
    return rows


def peak_rss_mib(reset: bool = False) -> float:
    """The process's peak resident memory in MiB since the last ``reset=True`` (Linux resets it through
    ``/proc/self/clear_refs``); where that is impossible, the peak since the process started (``ru_maxrss``)."""
    try:
        if reset:
            _release_free_heap()
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _release_free_heap() -> None:
    """Hand memory freed by earlier measurements back to the system (glibc's ``malloc_trim``), so that it does
    not count as resident in the next; nothing where that is unavailable."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def plot_context_rows(rows: list[dict], path: str) -> str:
    """Decode ms/token and cache bytes against context, one line per stack and policy (needs matplotlib: the
    ``plot`` extra). Returns what was done, for the caller to print."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'hybridlm[plot]')"
    figure, (speed, size) = plt.subplots(1, 2, figsize=(11, 4))
    for key in dict.fromkeys((r["stack"], r["policy"]) for r in rows):
        mine = [r for r in rows if (r["stack"], r["policy"]) == key]
        label = f"{key[0]}, {key[1]}"
        speed.plot([r["context"] for r in mine], [r["decode"].median_ms for r in mine], marker="o", label=label)
        size.plot([r["context"] for r in mine], [r["cache_bytes"] for r in mine], marker="o", label=label)
    for axis, name in [(speed, "decode ms/token (median)"), (size, "cache bytes")]:
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("context (tokens)")
        axis.set_ylabel(name)
    size.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"wrote {path}"


def cache_bytes(model: HybridForCausalLM, context: int) -> tuple[int, float]:
    """``(fixed bytes, bytes per token of context)`` of one sequence's cache, read off ``cache.nbytes()``."""
    empty = model.new_cache(1)
    filled = model.new_cache(1)
    fill_cache(filled, context)
    return empty.nbytes(), (filled.nbytes() - empty.nbytes()) / context


def compare_stacks(models: dict[str, HybridForCausalLM], contexts: list[int], steps: int = 8,
                   warmup: int = 2, threads: int | None = None) -> list[dict]:
    """One row per stack: cache bytes per token and the :class:`Timing` of a decode step at each context, the
    stacks' steps interleaved (:func:`interleaved_timings`) on ``threads`` threads (None: torch's setting)."""
    rows = [{"stack": name, **dict(zip(("fixed_bytes", "bytes_per_token"), cache_bytes(model, max(contexts))))}
            for name, model in models.items()]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        for context in tqdm(contexts, desc="contexts", leave=False):
            steppers = {name: _decode_step(model, context, warmup + steps) for name, model in models.items()}
            for row, timing in zip(rows, interleaved_timings(steppers, steps, warmup).values()):
                row[context] = timing
            del steppers
    finally:
        torch.set_num_threads(previous)
    return rows


def _decode_step(model: HybridForCausalLM, context: int, calls: int) -> Callable[[], object]:
    """One decode step of ``model`` over a cache filled to ``context`` tokens, with room for ``calls`` steps."""
    cache = model.new_cache(1, max_length=context + calls + 1)
    fill_cache(cache, context, torch.Generator().manual_seed(0))
    token = torch.zeros(1, 1, dtype=torch.long)
    return lambda: model(token, cache=cache)


# --- chunked scans against loops over time -------------------------------------------------------


def selective_scan_loop(u, delta, A, B, C):
    """Mamba-1 scan as one step per token (what transformers runs on CPU)."""
    decay = torch.exp(delta.unsqueeze(-1) * A.unsqueeze(1))  # [b, d, t, n]
    drive = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    outputs = []
    for t in range(u.shape[-1]):
        h = decay[:, :, t] * h + drive[:, :, t]
        outputs.append(torch.matmul(h, C[:, :, t].unsqueeze(-1)))
    return torch.cat(outputs, dim=-1)


def ssd_loop(x, dt, A, B, C):
    """Mamba-2 recurrence as one step per token."""
    decay = torch.exp(dt * A)  # [b, t, h]
    heads_per_group = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(heads_per_group, 2), C.repeat_interleave(heads_per_group, 2)
    state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    outputs = []
    for t in range(x.shape[1]):
        state = decay[:, t, :, None, None] * state + (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * B[:, t, :, None]
        outputs.append(torch.matmul(state, C[:, t, :, :, None]).squeeze(-1))
    return torch.stack(outputs, dim=1)


@torch.no_grad()
def scan_speedups(length: int = 2048, repeats: int = 3, warmup: int = 1) -> list[dict]:
    """Chunked reference scans vs loops over time at ``length`` (Jamba- and Mamba-2-like widths): their
    :class:`Timing` and the ratios of their medians and of their minima."""
    g = torch.Generator().manual_seed(0)
    b, d, n = 1, 512, 16
    u, delta = torch.randn(b, d, length, generator=g), torch.rand(b, d, length, generator=g) * 0.1
    A = -torch.rand(d, n, generator=g)
    B, C = torch.randn(b, n, length, generator=g), torch.randn(b, n, length, generator=g)
    h, p, gs, ns, chunk = 8, 64, 1, 64, 256
    x, dt = torch.randn(b, length, h, p, generator=g), torch.rand(b, length, h, generator=g) * 0.1
    A2, B2, C2 = -torch.rand(h, generator=g), torch.randn(b, length, gs, ns, generator=g), \
        torch.randn(b, length, gs, ns, generator=g)
    rows = []
    for name, chunked, loop in [
        ("selective_scan (Mamba-1)", lambda: ops.selective_scan(u, delta, A, B, C), lambda: selective_scan_loop(
            u, delta, A, B, C)),
        ("ssd_chunk_scan (Mamba-2)", lambda: ops.ssd_chunk_scan(x, dt, A2, B2, C2, chunk), lambda: ssd_loop(
            x, dt, A2, B2, C2)),
    ]:
        fast, slow = time_calls(chunked, repeats, warmup), time_calls(loop, repeats, warmup)
        rows.append({"op": name, "length": length, "chunked": fast, "loop": slow,
                     "speedup": slow.median_ms / fast.median_ms, "speedup_min": slow.min_ms / fast.min_ms})
    return rows


# --- reporting ---------------------------------------------------------------------------------------


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; ``columns`` are ``(key, heading, format)``. Numbers (a format given) are right-aligned,
    text (no format) left-aligned."""
    cells = [[heading for _, heading, _ in columns]]
    cells += [[format(row[key], fmt) if fmt else str(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    left = [not fmt for _, _, fmt in columns]
    lines = ["  ".join(cell.ljust(w) if left[i] else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             .rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def mixers_by_kind(model: HybridForCausalLM) -> tuple[dict[str, int], dict[str, int]]:
    """Per mixer kind: how many layers run one, and their parameters (a parallel layer counts per branch)."""
    layers, params = Counter(), Counter()
    for block in model.model.layers:
        parts = mixer_parts(block.mixer_type)
        for kind in parts:
            mixer = block.mixer if len(parts) == 1 else getattr(block.mixer, kind)
            layers[kind] += 1
            params[kind] += sum(p.numel() for p in mixer.parameters())
    shared = model.model.shared
    if shared is not None:
        layers["shared_attention"] = len(shared.layers)
        params["shared_attention"] = sum(p.numel() for p in shared.parameters())
    return layers, params
