"""The serving planner (``hybridlm memory --serve``): how many concurrent requests fit on a device of a given size,
at each context length, counted exactly from the cache a model builds.

Nothing is allocated: the model is built on the meta device, then a one-request cache under the serving policy
(``kv_bits``, ``page_size``); each KV layout states its bytes at a context (``predicted_nbytes``, the formula its
tests check against ``nbytes()``) and every fixed-size state its tensors' bytes, split into the recurrent state
and the conv window. A cache for ``n`` requests holds exactly ``n`` times one request's bytes (every tensor has
the batch on dim 0; a paged pool holds ``ceil(context / page_size)`` pages per row), so the requests that fit are
``(device bytes - weight bytes) // bytes per request``. What is not counted: activations, the engine's
workspace, CUDA graphs and fragmentation (engines reserve these with a utilisation fraction).

The planner knows the layer kinds in :data:`KIND_PARTS`; a config with another kind is refused, naming it,
rather than counted as attention (the simulators' 8-10x error) or as nothing.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hybridlm.cache.kv.base import KVLayout
from hybridlm.cache.kv.paged import PagedKV
from hybridlm.cache.kv.policy import CachePolicy
from hybridlm.cache.states import RecurrentState, StateGroup
from hybridlm.config import HybridConfig
from hybridlm.model.memory import _quantizable

GIB = 2**30
#: per layer kind: ``"KV"`` (a layout that grows with context) or which part each state tensor is
_SSM = {"conv": "conv", "ssm": "state"}
KIND_PARTS: dict[str, str | dict[str, str]] = {
    "attention": "KV", "shared_attention": "KV", "mla": "KV",
    "mamba": _SSM, "mamba2": _SSM, "gated_deltanet": _SSM, "kda": _SSM,
    "mamba3": {"angle": "state", "ssm": "state", "k": "state", "v": "state"},
    "short_conv": {"conv": "conv"},
    "performer": {"kv": "state", "max": "state"},
    "linformer": {"keys": "state", "values": "state", "tokens": "state"},
}
WEIGHT_BITS = (16, 8, 4)


@dataclasses.dataclass
class ServingPlan:
    """``weight_bytes``, ``device_bytes``; per context (``rows``): ``bytes_by_part`` of one request (``"attention
    KV"``, ``"mamba2 state"``, ``"mamba2 conv"``, ..., ``"counters"``), ``bytes_per_request``,
    ``paged_overhead_bytes`` (pages rounded up and block tables; 0 unpaged) and ``requests``."""

    name: str
    device_bytes: int
    weight_bytes: int
    weight_bits: int
    kv_bits: int
    page_size: int | None
    rows: list[dict]
    state_bits: int | str | None = None

    @property
    def free_bytes(self) -> int:
        return self.device_bytes - self.weight_bytes

    def row(self, context: int) -> dict:
        (found,) = [r for r in self.rows if r["context"] == context]
        return found

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "free_bytes": self.free_bytes}


def serving_contexts(config: HybridConfig, context: int | None = None) -> list[int]:
    """1K, 2K, 4K, ... up to ``context`` (default: the model's ``max_position_embeddings``, else 128K), which is
    included when it is not a power of two."""
    top = context or config.max_position_embeddings or 131072
    contexts = [2**k for k in range(10, 40) if 2**k <= top]
    return contexts + [top] if not contexts or contexts[-1] != top else contexts


def weight_parameters(config: HybridConfig) -> int:
    """Parameters of the model of ``config``, counted on the meta device. A model with many experts is built with
    few (its parameters are affine in ``num_experts``: each expert's MLP plus a router row) and extrapolated, since
    building 512 experts per layer takes minutes."""
    from hybridlm.model import HybridForCausalLM

    def count(cfg: HybridConfig) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in HybridForCausalLM(cfg).parameters())

    if not _many_experts(config):
        return count(config)
    few = max(config.num_experts_per_tok, 2)
    try:
        small, larger = (count(_with_experts(config, n)) for n in (few, few + 1))
    except ValueError:  # expert groups that few experts cannot form: count them all
        return count(config)
    return small + (config.num_experts - few) * (larger - small)


def _many_experts(config: HybridConfig) -> bool:
    return any(kind == "moe" for kind in (config.mlp_types or [])) and config.num_experts > 16


def _with_experts(config: HybridConfig, experts: int) -> HybridConfig:
    return HybridConfig(**{**config.to_dict(), "num_experts": experts})


def meta_model(config: HybridConfig):
    """A model of ``config`` on the meta device, with few experts when it has many (the cache is the same)."""
    from hybridlm.model import HybridForCausalLM

    if _many_experts(config):
        try:
            config = _with_experts(config, max(config.num_experts_per_tok, 2))
        except ValueError:
            pass
    with torch.device("meta"):
        return HybridForCausalLM(config)


def serving_cache(config: HybridConfig, kv_bits: int = 16, page_size: int | None = None, dtype=torch.bfloat16,
                  batch: int = 1, max_length: int | None = None, device="meta", model=None,
                  state_bits: int | str | None = None, state_rounding: str | None = None):
    """The cache a server holds for ``batch`` requests: KV quantized to ``kv_bits`` (KIVI) or paged in pages of
    ``page_size`` tokens where a layout takes it (sliding-window rings and MLA latents stay as they are); recurrent
    states quantized to ``state_bits`` (8 or ``"fp8"``, where this hybridlm's ``CachePolicy`` has the field)."""
    if page_size is not None and kv_bits != 16:
        raise ValueError(f"--page-size {page_size} with --kv-bits {kv_bits}: a paged cache holds every token in "
                         "full precision (CachePolicy); choose one")
    state_fields = {}
    if state_bits is not None or state_rounding is not None:
        if "state_bits" not in {field.name for field in dataclasses.fields(CachePolicy)}:
            raise ValueError("--state-bits: this hybridlm's CachePolicy has no state_bits (quantized recurrent "
                             "states are not in this build)")
        state_fields = dict(state_bits=state_bits, state_rounding=state_rounding)
    model = model if model is not None else meta_model(config)
    default = model.new_cache(batch, device=device, dtype=dtype)
    feature, kv_fields = None, {}
    if kv_bits != 16:
        feature, kv_fields = "kv_bits", dict(kv_bits=kv_bits)
    elif page_size is not None:
        feature, kv_fields = "page_size", dict(page_size=page_size)
    chosen = {}
    for index, state in enumerate(default.states):
        fields = {**(kv_fields if feature and _takes(state, feature) else {}),
                  **(state_fields if _recurrent(state) else {})}
        if fields:
            chosen[index] = CachePolicy(**fields)
    return model.new_cache(batch, max_length, device=device, dtype=dtype, policy=chosen or None)


def _recurrent(state) -> bool:
    parts = state.parts.values() if isinstance(state, StateGroup) else [state]
    return any(isinstance(part, RecurrentState) for part in parts)


def _takes(state, feature: str) -> bool:
    if feature == "kv_bits":
        return _quantizable(state)
    parts = state.parts.values() if isinstance(state, StateGroup) else [state]
    layouts = [part for part in parts if isinstance(part, KVLayout)]
    return bool(layouts) and all(feature in part.policy_features for part in layouts)


def _parts(cache) -> list[tuple[str, object]]:
    """``(layer kind, state)`` of every state of ``cache``; a ValueError naming the kinds the planner does not
    know."""
    found, unknown = [], []
    for kind, state in zip(cache.layer_types, cache.states):
        for part_kind, part in (state.parts.items() if isinstance(state, StateGroup) else [(kind, state)]):
            (unknown if part_kind not in KIND_PARTS else found).append((part_kind, part))
    if unknown:
        names = ", ".join(sorted({kind for kind, _ in unknown}))
        raise ValueError(f"--serve: the planner does not know the layer kinds {names} of this config (it counts "
                         f"{', '.join(KIND_PARTS)}); it will not guess their bytes")
    return found


def request_bytes(cache, context: int) -> tuple[dict[str, int], int]:
    """``(bytes by part, paged overhead)`` of the requests of ``cache`` holding ``context`` tokens each."""
    by_part: dict[str, int] = {}
    overhead = 0
    for kind, part in _parts(cache):
        parts = KIND_PARTS[kind]
        if isinstance(part, KVLayout):
            if parts != "KV":
                raise ValueError(f"--serve: a {kind} layer holds a KV layout ({type(part).__name__}) the planner "
                                 "does not expect")
            held = part.predicted_nbytes(context)
            by_part[f"{kind} KV"] = by_part.get(f"{kind} KV", 0) + held
            if isinstance(part, PagedKV):  # what contiguous storage of the same tokens would not need
                heads, _, _, dim = part.keys.shape
                exact = part.batch_size * (2 * heads * context * dim * part.keys.element_size()
                                           + part.padding.element_size())
                overhead += held - exact
            continue
        for name, tensor in part._tensors().items():
            base, _, suffix = name.rpartition("_")  # a quantized state's <field>_codes, _scales, _residual
            name = base if suffix in ("codes", "scales", "residual") and base in parts else name
            if parts == "KV" or name not in parts:
                raise ValueError(f"--serve: the planner does not know the {name!r} tensor of a {kind} layer's "
                                 f"{type(part).__name__}")
            key = f"{kind} {parts[name]}"
            by_part[key] = by_part.get(key, 0) + tensor.numel() * tensor.element_size()
    by_part["counters"] = cache.positions.numel() * cache.positions.element_size()
    return by_part, overhead


def plan_serving(config: HybridConfig, device_gib: float, contexts: list[int], kv_bits: int = 16,
                 page_size: int | None = None, weight_bits: int = 16, dtype=torch.bfloat16,
                 name: str = "model", parameters: int | None = None, model=None,
                 state_bits: int | str | None = None, state_rounding: str | None = None) -> ServingPlan:
    """The requests of each context in ``contexts`` that fit in ``device_gib`` GiB beside the weights (at
    ``weight_bits`` per parameter; scales of quantized weights not counted), with a ``dtype`` cache (recurrent
    states keep the dtype their mixer gives them: fp32). ``parameters`` (:func:`weight_parameters`) and ``model``
    (a meta model of ``config``) save rebuilding them when several plans are made."""
    if not isinstance(device_gib, (int, float)) or not device_gib > 0:
        raise ValueError(f"--device-gib must be a positive number of GiB, got {device_gib!r}")
    if weight_bits not in WEIGHT_BITS:
        raise ValueError(f"--weight-bits must be one of {', '.join(map(str, WEIGHT_BITS))}, got {weight_bits!r}")
    for context in contexts:
        if not isinstance(context, int) or context < 1:
            raise ValueError(f"--context: {context!r} must be a positive integer")
    device_bytes = int(device_gib * GIB)
    parameters = parameters if parameters is not None else weight_parameters(config)
    weight_bytes = math.ceil(parameters * weight_bits / 8)
    if weight_bytes >= device_bytes:
        raise ValueError(f"--device-gib {device_gib:g} ({device_bytes:,} B) is smaller than the {weight_bits}-bit "
                         f"weights alone: {weight_bytes / GIB:,.2f} GiB ({weight_bytes:,} B); no request fits "
                         "(give a larger device, the devices' total for tensor parallelism, or --weight-bits 8/4)")
    cache = serving_cache(config, kv_bits, page_size, dtype, model=model, state_bits=state_bits,
                          state_rounding=state_rounding)
    rows = []
    for context in contexts:
        by_part, overhead = request_bytes(cache, context)
        per_request = sum(by_part.values())
        rows.append(dict(context=context, bytes_by_part=by_part, bytes_per_request=per_request,
                         paged_overhead_bytes=overhead, requests=(device_bytes - weight_bytes) // per_request))
    return ServingPlan(name, device_bytes, weight_bytes, weight_bits, kv_bits, page_size, rows, state_bits)


def plot_plans(plans: list[ServingPlan], path: str) -> str:
    """Requests that fit against context, one line per plan (needs matplotlib: the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'hybridlm[plot]')"
    figure, axis = plt.subplots(figsize=(7, 4))
    models = len({plan.name for plan in plans})
    for plan in plans:
        label = f"{plan.name}, {plan.kv_bits}-bit KV" + (f", pages of {plan.page_size}" if plan.page_size else "") \
            + (f", {plan.state_bits} states" if plan.state_bits else "")
        if models > 1:  # each model's own weights
            label += f" ({plan.weight_bits}-bit weights {plan.weight_bytes / GIB:.0f} GiB)"
        axis.plot([r["context"] for r in plan.rows], [max(r["requests"], 0.5) for r in plan.rows], marker="o",
                  label=label)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("context (tokens per request)")
    axis.set_ylabel("concurrent requests that fit")
    first = plans[0]
    weights = "" if models > 1 else f", {first.weight_bits}-bit weights ({first.weight_bytes / GIB:.1f} GiB)"
    axis.set_title(f"{first.device_bytes / GIB:g} GiB device{weights}", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"wrote {path}"
