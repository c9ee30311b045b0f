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

A mixer that reads a projection's weight itself rather than calling the module (``Mixer.weights_read_directly``:
MLA's latent attention absorbs ``kv_b_proj`` into its queries) cannot take codes there; such a model is refused
naming the layers, unless those projections are left out (``exclude``). A tied LM head is untied: the embedding
keeps its float weight, the head gets the codes. A quantized model is for inference: it does not train and is
not saved (``save_pretrained`` refuses it); quantize again after loading.
"""

from __future__ import annotations

from torch import nn

#: the attribute a quantized model carries (what ``save_pretrained`` checks)
QUANTIZED_WEIGHTS = "hybridlm_weight_bits"


def quantize_weights(model: nn.Module, bits: int = 8, exclude: tuple[str, ...] = ()) -> nn.Module:
    """Quantize ``model``'s linear weights to int8 in place (and return it). ``exclude``: module names
    (``"lm_head"``) or their last part (``"kv_b_proj"``) to keep in float."""
    if bits != 8:
        raise ValueError(f"quantize_weights: bits={bits!r}; only 8 (int8 weight-only) is supported")
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
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as error:
        raise ImportError("quantize_weights needs torchao: pip install torchao (or hybridlm[int8])") from error
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and "lm_head" not in excluded and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)  # untie: the embedding stays

    def chosen(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and name not in excluded and name.rsplit(".", 1)[-1] not in excluded

    model.requires_grad_(False)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=chosen)
    setattr(model, QUANTIZED_WEIGHTS, bits)
    return model
