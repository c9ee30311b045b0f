"""Int8 weight-only linears for inference (``quantize_weights(model)``), through torchao.

Every ``nn.Linear`` of the model (the mixers' projections, the MLPs, the LM head) keeps its weight as int8 codes
with one fp32 scale per output row: ``scale = absmax(row) / 127.5``, codes ``round(w / scale)`` in [-128, 127]
(torchao's ``Int8WeightOnlyConfig``); activations, norms, embeddings, conv weights and recurrent states stay in
the model dtype. A quantized linear computes ``x @ (codes * scale)^T + bias``: a quarter of fp32's weight bytes
to read per token, which is what decode on a CPU waits for. The compiled decode step
(:class:`~hybridlm.decoding.decode_step.DecodeStep`) takes such a model as it takes a float one. Quantize a bf16
model for speed there: inductor then multiplies the codes by the bf16 inputs in its weight-only GEMM (AVX-512 BF16
or AMX; SmolLM2-135M's step 2.1x fp32's), where on an fp32 model its freezing folds ``codes * scale`` back into
fp32 weights and the step is no faster than fp32's (docs/performance.md). Eager, on a CPU without bf16 products,
the codes of a decode step go to our kernel (:mod:`hybridlm.ops.cpu_linear`), which reads them as int8.

With ``group_size`` (32: llama.cpp's Q8_0 scheme) each weight row has one scale per group of that many input
features (torchao's ``PerGroup``), and each linear quantizes its input per group of the same features at every
product, ``scale = max |x| / 127``, codes rounded half to even (:mod:`hybridlm.ops.activation_groups`): on a CPU
the two are multiplied in int8 x int8, each group's sum exact in int32
(:func:`hybridlm.ops.cpu_linear.int8_groups_linear`, any CPU the kernels build on); elsewhere the same is computed
in fp32. On SmolLM2-135M (512 held-out tokens, next-token KL to fp32): 4.96e-3 nats on the fp32 model, 6.56e-3
on the bf16 one (per-row weight-only codes: 4.99e-3 and 6.44e-3; llama.cpp's Q8_0 4.76e-3).

A mixer that reads a projection's weight itself rather than calling the module (``Mixer.weights_read_directly``:
MLA's latent attention absorbs ``kv_b_proj`` into its queries) cannot take codes there; such a model is refused
naming the layers, unless those projections are left out (``exclude``). A tied LM head is untied: the embedding
keeps its float weight, the head gets the codes. A quantized model is for inference: it does not train and is
not saved (``save_pretrained`` refuses it); quantize again after loading.
"""

from __future__ import annotations

from torch import nn

from hybridlm.layers.linear import Linear

#: the attribute a quantized model carries (what ``save_pretrained`` checks)
QUANTIZED_WEIGHTS = "hybridlm_weight_bits"


def quantize_weights(model: nn.Module, bits: int = 8, exclude: tuple[str, ...] = (),
                     group_size: int | None = None) -> nn.Module:
    """Quantize ``model``'s linear weights to int8 in place (and return it). ``exclude``: module names
    (``"lm_head"``) or their last part (``"kv_b_proj"``) to keep in float. ``group_size`` (even, dividing each
    layer's input features): one scale per group of that many inputs instead of per output row, and the inputs
    quantized in the same groups at every product, multiplied in int8 x int8 (llama.cpp's Q8_0 with 32)."""
    if bits != 8:
        raise ValueError(f"quantize_weights: bits={bits!r}; only 8 (int8 weight-only) is supported")
    if group_size is not None and (type(group_size) is not int or group_size < 2 or group_size % 2):
        raise ValueError(f"quantize_weights: group_size={group_size!r}; it takes an even number of input features")
    if getattr(model, QUANTIZED_WEIGHTS, None):
        raise ValueError("quantize_weights: the model's weights are already quantized")
    excluded = set(exclude)
    refused = {f"{name}.{part}": (type(module).kind, part) for name, module in model.named_modules()
               for part in getattr(type(module), "weights_read_directly", ())
               if part not in excluded and f"{name}.{part}" not in excluded}
    if refused:
        kinds = sorted({kind for kind, _ in refused.values()})
        parts = ", ".join(repr(part) for part in sorted({part for _, part in refused.values()}))
        raise ValueError(f"quantize_weights: the {'/'.join(kinds)} layers read these weights themselves, which "
                         f"int8 codes cannot serve: {', '.join(refused)}; keep them in float with exclude=({parts},)")

    def chosen(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and name not in excluded and name.rsplit(".", 1)[-1] not in excluded

    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup, PerRow
    except ImportError as error:
        raise ImportError("quantize_weights needs torchao: pip install torchao (or hybridlm[int8])") from error
    grouped = {name: module for name, module in model.named_modules() if chosen(module, name)} if group_size else {}
    unfit = [name for name, module in grouped.items()
             if not isinstance(module, Linear) or module.in_features % group_size]
    if unfit:
        raise ValueError(f"quantize_weights: group_size={group_size} does not serve {', '.join(unfit)} (input "
                         f"features not a multiple of it, or not hybridlm's Linear); keep them in float with "
                         f"exclude, or choose a group size that divides their inputs")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and "lm_head" not in excluded and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)  # untie: the embedding stays
    model.requires_grad_(False)
    granularity = PerRow() if group_size is None else PerGroup(group_size)
    quantize_(model, Int8WeightOnlyConfig(granularity=granularity), filter_fn=chosen)
    for module in grouped.values():  # the int8 x int8 product takes symmetric codes: no zero points
        if module.weight.zero_point is not None and module.weight.zero_point.any():
            raise RuntimeError("quantize_weights: torchao gave the grouped int8 codes zero points; this torchao "
                               "version quantizes differently from the one hybridlm supports")
        module.input_group = group_size
    setattr(model, QUANTIZED_WEIGHTS, bits)
    return model
