"""The student of a distillation: the teacher's stack with some attention layers replaced by a recurrent mixer,
everything else copied, each new mixer initialised from the attention layer it replaces.

Copied exactly (same tensors): the embeddings, the LM head, every norm, every MLP, every kept attention layer and
every teacher layer that is not attention. Replaced: the attention layers not in ``keep``.

The new mixer's sizes follow the attention it replaces, so its projections can take the attention's weights
(``--init attention``; Mamba in the Llama's mapping, with grouped-query K/V heads repeated so that query head ``h``
reads K/V head ``h // (heads / kv_heads)`` as attention does):

* **mamba2**: one SSD head per query head (``heads``), ``mamba2_head_dim = head_dim``, one B/C group per head
  (``mamba2_n_groups = heads``, ``mamba2_d_state = head_dim``), projection biases on: in_proj's x rows <- V
  (repeated), B rows <- K (repeated), C rows <- Q; out_proj <- o_proj. The gate z starts neutral (weight 0, bias
  :data:`GATE_BIAS`: every channel gated alike, which the gated RMSNorm cancels); dt, A, D fresh.
* **gated_deltanet**: ``heads`` key and value heads of ``head_dim``: in_proj_qkvz's q <- Q, k <- K (repeated),
  v <- V (repeated); out_proj <- o_proj. It has no projection biases, so its gate z cannot start neutral: z, b,
  a (in_proj_ba), A_log, dt_bias fresh.
* **mamba** (Mamba-1): ``mamba_expand = heads * head_dim / hidden_size`` (it must be a whole number), projection
  biases on: in_proj's x rows <- V (repeated), out_proj <- o_proj, the gate z neutral (weight 0, bias
  :data:`GATE_BIAS`, ``silu(GATE_BIAS) = 1``). Mamba-1 computes B and C from the SSM input (x_proj), not from the
  layer input, so Q and K have no counterpart; x_proj, dt_proj fresh.

In every case the short convolution starts as the identity (last tap 1, bias 0): attention has none, so x/B/C
(or q/k/v) reach the scan as the projections give them (after the mixer's SiLU). Biases of q/k/v/o are copied
into the projection biases (0 where attention has none); Gated DeltaNet has none, so a teacher with attention
biases cannot initialise it. Attention with q/k norms or an output gate has no counterpart either. Where the
mapping cannot apply, :func:`init_problem` says why and ``--init random`` is offered. (Stage 1 then starts by
fitting each new mixer's output scale to its attention's in closed form:
:func:`hybridlm.training.distill_transfer.fit_output_scales`.)

``--init random`` keeps the same shapes and copies, with the new mixers left at their fresh initialisation: the
ablation that measures what the attention weights are worth.
"""

from __future__ import annotations

import torch

from hybridlm.training.distill_options import INITS, NEW_MIXERS

#: The bias of a neutral gate: ``silu(GATE_BIAS) = 1``.
GATE_BIAS = 1.2784645


def attention_layers(config) -> list[int]:
    """The indices of the teacher's softmax-attention layers."""
    return [i for i, kind in enumerate(config.layer_types) if kind == "attention"]


def parse_layers(text: str) -> list[int]:
    """``--keep-attention 3,7,11``: sorted distinct layer indices."""
    try:
        layers = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        raise ValueError(f"--keep-attention {text!r}: not a comma-separated list of layer indices") from None
    if not layers:
        raise ValueError("--keep-attention is empty: name the attention layers to keep (e.g. 3,7,11)")
    return layers


def kept_layers(config, keep: list[int] | None = None, every: int | None = None) -> list[int]:
    """The attention layers the student keeps: ``keep`` (checked), or every ``every``-th layer (layers
    ``every - 1, 2 * every - 1, ...`` that are attention). Errors name the option."""
    attention = attention_layers(config)
    if not attention:
        raise ValueError("the teacher has no attention layers to replace (its layers: "
                         f"{', '.join(sorted(set(config.layer_types)))})")
    if (keep is None) == (every is None):
        raise ValueError("give exactly one of --keep-attention I,J,... and --attention-every N")
    if every is not None:
        if every < 1:
            raise ValueError(f"--attention-every must be a positive integer, got {every}")
        return [i for i in attention if i % every == every - 1]
    if not keep:
        raise ValueError("--keep-attention is empty: name the attention layers to keep (e.g. 3,7,11)")
    n = config.num_hidden_layers
    outside = [i for i in keep if not 0 <= i < n]
    if outside:
        raise ValueError(f"--keep-attention {','.join(map(str, keep))}: {outside} out of range (the teacher has {n} "
                         f"layers, 0..{n - 1})")
    not_attention = [i for i in keep if i not in attention]
    if not_attention:
        raise ValueError(f"--keep-attention: layers {not_attention} are not attention layers of the teacher "
                         f"({', '.join(sorted({config.layer_types[i] for i in not_attention}))})")
    return sorted(set(keep))


def mixer_fields(config, mixer: str) -> dict:
    """The HybridConfig fields that size ``mixer`` after the teacher's attention (see the module docstring)."""
    heads, head_dim = config.num_attention_heads, config.head_dim  # K/V heads are repeated: sizes ignore them
    inner = heads * head_dim
    if mixer == "mamba2":  # the inner width as an expansion of hidden_size where it is one (what Bamba can write)
        width = dict(mamba2_expand=inner // config.hidden_size, mamba2_inner_size=None) \
            if inner % config.hidden_size == 0 else dict(mamba2_inner_size=inner)
        return dict(**width, mamba2_head_dim=head_dim, mamba2_n_groups=heads, mamba2_d_state=head_dim,
                    mamba2_proj_bias=True)
    if mixer == "gated_deltanet":
        return dict(deltanet_num_key_heads=heads, deltanet_num_value_heads=heads, deltanet_key_head_dim=head_dim,
                    deltanet_value_head_dim=head_dim)
    if mixer == "mamba":
        expand = inner // config.hidden_size if inner % config.hidden_size == 0 else config.mamba_expand
        return dict(mamba_expand=max(expand, 1), mamba_proj_bias=True)
    raise ValueError(f"--mixer {mixer!r}: a student's new layers are one of {', '.join(NEW_MIXERS)}")


def init_problem(config, mixer: str) -> str | None:
    """Why ``mixer`` cannot take the teacher's attention weights (None when it can)."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    features = [name for name in ("attention_qk_norm", "attention_output_gate") if getattr(config, name)]
    if features:
        return f"the teacher's attention has {' and '.join(features)}, which {mixer} has no counterpart for"
    if mixer == "gated_deltanet" and (config.attention_bias or config.attention_output_bias):
        return "the teacher's attention projections have biases and gated_deltanet's have none"
    if mixer == "mamba" and (heads * head_dim) % config.hidden_size:
        return (f"mamba's inner width is a whole multiple of hidden_size={config.hidden_size}, but the attention's "
                f"values are heads x head_dim = {heads * head_dim} wide")
    return None


def student_config(teacher_config, keep: list[int], mixer: str, init: str = "attention"):
    """The teacher's config with every attention layer not in ``keep`` replaced by ``mixer``."""
    from hybridlm.config import HybridConfig

    if mixer not in NEW_MIXERS:
        raise ValueError(f"--mixer {mixer!r}: a student's new layers are one of {', '.join(NEW_MIXERS)}")
    if init not in INITS:
        raise ValueError(f"--init {init!r}: one of {', '.join(INITS)}")
    if init == "attention":
        problem = init_problem(teacher_config, mixer)
        if problem:
            raise ValueError(f"--mixer {mixer} cannot be initialised from this teacher's attention: {problem}; "
                             "pass --init random (or another --mixer)")
    replaced = [i for i in attention_layers(teacher_config) if i not in keep]
    if not replaced:
        raise ValueError(f"--keep-attention keeps every attention layer of the teacher ({keep}): nothing to replace")
    fields = teacher_config.to_dict()
    for name in ("layer_pattern", "attn_layer_period", "attn_layer_offset", "architectures", "transformers_version",
                 "_name_or_path"):
        fields.pop(name, None)
    fields["layer_types"] = [mixer if i in replaced else kind for i, kind in enumerate(teacher_config.layer_types)]
    fields.update(mixer_fields(teacher_config, mixer))
    return HybridConfig.from_dict(fields)


def replaced_layers(teacher_config, student_config) -> list[int]:
    """The layers where the student's mixer is not the teacher's."""
    return [i for i, (a, b) in enumerate(zip(teacher_config.layer_types, student_config.layer_types)) if a != b]


def _repeat_heads(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """K/V rows ``[kv_heads * head_dim, ...]`` repeated to ``heads`` heads, head ``h`` a copy of head
    ``h // (heads / kv_heads)`` (grouped-query attention's sharing)."""
    kv_heads = weight.shape[0] // head_dim
    return weight.reshape(kv_heads, head_dim, *weight.shape[1:]).repeat_interleave(heads // kv_heads, dim=0) \
        .reshape(heads * head_dim, *weight.shape[1:])


def _identity_conv(conv) -> None:
    conv.weight.zero_()
    conv.weight[:, 0, -1] = 1.0
    if conv.bias is not None:
        conv.bias.zero_()


def _qkvo(attention, heads: int, head_dim: int) -> dict[str, torch.Tensor | None]:
    """The attention's weights (and biases, None when absent) with K/V repeated to ``heads`` heads."""
    def repeat(tensor):
        return None if tensor is None else _repeat_heads(tensor, heads, head_dim)

    q, k, v, o = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
    return {"q": q.weight, "k": repeat(k.weight), "v": repeat(v.weight), "o": o.weight, "q_bias": q.bias,
            "k_bias": repeat(k.bias), "v_bias": repeat(v.bias), "o_bias": o.bias}


def _fill(linear, rows: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> None:
    """Copy ``(first row, weight, bias)`` blocks into ``linear`` (a missing bias block becomes 0)."""
    for start, weight, bias in rows:
        linear.weight[start:start + weight.shape[0]] = weight
        if linear.bias is not None:
            block = linear.bias[start:start + weight.shape[0]]
            block.copy_(bias) if bias is not None else block.zero_()


def _neutral_gate(linear, start: int, size: int) -> None:
    """Rows ``start:start + size`` of ``linear`` (a gate): weight 0, bias :data:`GATE_BIAS`."""
    linear.weight[start:start + size].zero_()
    linear.bias[start:start + size] = GATE_BIAS


def _copy_out(linear, weights: dict) -> None:
    linear.weight.copy_(weights["o"])
    if linear.bias is not None:
        linear.bias.copy_(weights["o_bias"]) if weights["o_bias"] is not None else linear.bias.zero_()


def init_from_attention(mixer, attention, config) -> None:
    """Set ``mixer``'s projections from ``attention``'s weights, as the module docstring documents."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    w = _qkvo(attention, heads, head_dim)
    kind = type(mixer).kind
    if kind == "mamba2":
        inner, group = mixer.d_inner, mixer.n_groups * mixer.d_state  # in_proj rows: z, x, B, C, dt
        _fill(mixer.in_proj, [(inner, w["v"], w["v_bias"]), (2 * inner, w["k"], w["k_bias"]),
                              (2 * inner + group, w["q"], w["q_bias"])])
        _neutral_gate(mixer.in_proj, 0, inner)
        mixer.in_proj.bias[2 * inner + 2 * group:].zero_()  # dt (its bias is dt_bias)
    elif kind == "gated_deltanet":  # in_proj_qkvz rows: q, k, v, z
        _fill(mixer.in_proj_qkvz, [(0, w["q"], None), (mixer.key_dim, w["k"], None),
                                   (2 * mixer.key_dim, w["v"], None)])
    elif kind == "mamba":  # in_proj rows: x, z
        _fill(mixer.in_proj, [(0, w["v"], w["v_bias"])])
        _neutral_gate(mixer.in_proj, mixer.d_inner, mixer.d_inner)
    else:
        raise ValueError(f"no attention initialisation for mixer kind {kind!r}")
    _copy_out(mixer.out_proj, w)
    _identity_conv(mixer.conv1d)


@torch.no_grad()
def build_student(teacher, keep: list[int], mixer: str, init: str = "attention", seed: int = 0):
    """The student of ``teacher`` (see the module docstring); ``seed`` draws the new mixers' fresh parameters."""
    from hybridlm.model import HybridForCausalLM

    config = student_config(teacher.config, keep, mixer, init)
    torch.manual_seed(seed)
    student = HybridForCausalLM(config).to(next(teacher.parameters()).dtype)
    replaced = set(replaced_layers(teacher.config, config))
    prefixes = tuple(f"model.layers.{i}.mixer." for i in replaced)
    teacher_weights = teacher.state_dict()
    copied = {name: tensor for name, tensor in teacher_weights.items() if not name.startswith(prefixes)}
    missing, unexpected = student.load_state_dict(copied, strict=False)
    missing = [name for name in missing if not name.startswith(prefixes)]
    if missing or unexpected:
        raise ValueError(f"the student does not match the teacher's copied weights (missing {missing}, unexpected "
                         f"{unexpected})")
    if init == "attention":
        for i in sorted(replaced):
            init_from_attention(student.model.layers[i].mixer, teacher.model.layers[i].mixer, teacher.config)
    if config.tie_word_embeddings:
        student.tie_weights()
    student.generation_config = teacher.generation_config
    return student.train(teacher.training)

