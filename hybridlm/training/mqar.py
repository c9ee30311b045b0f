"""Multi-query associative recall (MQAR, from Zoology): the data, the models and accuracy on the answers.

A row of ``seq_len`` tokens starts with ``kv_pairs`` key-value pairs (keys drawn from ``[1, vocab/2)``, values
from ``[vocab/2, vocab)``, both distinct within a row). The rest of the row is the query region: each key is
queried once, at even offset ``2 g`` where the gaps ``g`` are drawn without replacement with probability
``∝ g^(power_a - 1)`` (``power_a=0.01``: most queries come soon after the pairs, a few far away), and its value
follows it. Every other position holds a random token of the whole vocabulary (Zoology's
``random_non_queries``). Labels are the value at each answer position and -100 elsewhere, so the training loss
and the accuracy count the answers only.

One difference from Zoology: there the answer position holds a random token and the value appears only as a
label; here it holds the value, so a row reads as a sequence. A causal model cannot see it before it must
predict it, and every key is queried once, so this changes nothing that is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100
#: The model shapes of the benchmark: ``layer_pattern`` of each named mixer (Zoology's 2 layers; the hybrids
#: and their all-Mamba-2 twin have 4). The hybrids put attention last in each group, after the Mamba-2 layers
#: whose convolutions can shift the previous token in. ``conv-attention`` is Zoology's attention baseline: 2
#: layers, a width-3 convolution (here LFM2's gated short convolution; there BaseConv), then attention. The
#: convolution hands attention the previous token; plain ``attention`` must learn that shift itself, and on a CPU
#: budget it learns it slowly (docs/mqar.md).
MIXER_PATTERNS = {
    "attention": "AA", "conv-attention": "CA", "mamba": "MM", "mamba2": "SS", "performer": "PP",
    "linformer": "LL", "mamba2-4layer": "SSSS", "hybrid-1:1": "SASA", "hybrid-1:3": "SSSA",
    "mamba3": "RR", "hybrid3-1:3": "RRRA",
}
#: Letters of the layer kinds whose state has no size to choose (attention's grows, the short conv's is its
#: window): a model made of these alone takes ``state_size=None``.
_UNSIZED_LETTERS = frozenset("AC")


def needs_state_size(mixer: str) -> bool:
    """Whether benchmark model ``mixer`` has a fixed-size state whose dimension ``state_size`` sets."""
    return not set(MIXER_PATTERNS[mixer]) <= _UNSIZED_LETTERS


@dataclass
class MQARRows:
    """``ids`` and ``labels`` ``[rows, seq_len]``; the same interface as :class:`~hybridlm.training.PackedRows`,
    so :func:`hybridlm.training.train` trains on it. Each row is one sequence in either layout."""

    ids: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, rows: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[rows], "labels": self.labels[rows]}


def check_mqar_shape(vocab_size: int, seq_len: int, kv_pairs: int) -> None:
    """Raise ``ValueError`` naming the argument when ``kv_pairs`` pairs and their queries do not fit."""
    for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len), ("kv_pairs", kv_pairs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if 4 * kv_pairs > seq_len:
        raise ValueError(f"kv_pairs={kv_pairs} do not fit in seq_len={seq_len}: the pairs take 2 tokens each and "
                         f"their queries and answers as many again, so seq_len must be >= 4 * kv_pairs "
                         f"= {4 * kv_pairs}")
    if vocab_size // 2 - 1 < kv_pairs:
        raise ValueError(f"vocab_size={vocab_size} is too small for kv_pairs={kv_pairs} distinct keys: the keys are "
                         f"[1, vocab_size // 2), so vocab_size must be >= {2 * kv_pairs + 2}")


def query_gap_probabilities(slots: int, power_a: float = 0.01) -> torch.Tensor:
    """``[slots]``: the probability of each query gap ``g = 0..slots-1``, ``∝ (g + 1)^(power_a - 1)``."""
    weights = torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)
    return weights / weights.sum()


def _distinct(rows: int, low: int, high: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, count]`` distinct integers from ``[low, high)`` per row, uniformly."""
    weights = torch.ones(high - low).expand(rows, -1)
    return low + torch.multinomial(weights, count, replacement=False, generator=generator)


def mqar_rows(num_rows: int, seq_len: int, kv_pairs: int, vocab_size: int = 8192, *, power_a: float = 0.01,
              seed: int = 0, chunk: int = 1024) -> MQARRows:
    """``num_rows`` MQAR rows (see the module docstring), a function of the arguments alone."""
    check_mqar_shape(vocab_size, seq_len, kv_pairs)
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")
    generator = torch.Generator().manual_seed(seed)
    context = 2 * kv_pairs
    slots = (seq_len - context) // 2  # places a (query, answer) pair can start at: context + 2 g
    gap_probabilities = query_gap_probabilities(slots, power_a).float()
    ids = torch.randint(vocab_size, (num_rows, seq_len), generator=generator)  # filler
    labels = torch.full((num_rows, seq_len), IGNORE, dtype=torch.long)
    for start in range(0, num_rows, chunk):
        n = min(chunk, num_rows - start)
        keys = _distinct(n, 1, vocab_size // 2, kv_pairs, generator)  # [n, kv_pairs]
        values = _distinct(n, vocab_size // 2, vocab_size, kv_pairs, generator)  # [n, kv_pairs]
        gaps = torch.multinomial(gap_probabilities.expand(n, -1), kv_pairs, replacement=False,
                                 generator=generator)  # [n, kv_pairs]
        queries = context + 2 * gaps  # [n, kv_pairs]: where key j is queried
        block = ids[start:start + n]
        block[:, 0:context:2], block[:, 1:context:2] = keys, values
        block.scatter_(1, queries, keys)
        block.scatter_(1, queries + 1, values)
        labels[start:start + n].scatter_(1, queries + 1, values)
    return MQARRows(ids, labels)


def shift_rows(rows: MQARRows, max_shift: int, vocab_size: int = 8192, *, seed: int = 0) -> MQARRows:
    """Each row moved right by its own random offset in ``[0, max_shift]``, inside a row ``max_shift`` tokens
    longer with random filler before and after: the pairs no longer sit at the same positions in every row. (A
    model that compresses by position, as causal Linformer does, can recall fixed pairs by their slots; shifted,
    it has to find them by content: docs/mqar.md.)"""
    if not isinstance(max_shift, int) or isinstance(max_shift, bool) or max_shift < 0:
        raise ValueError(f"max_shift must be a non-negative integer, got {max_shift!r}")
    num_rows, length = rows.ids.shape
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab_size, (num_rows, length + max_shift), generator=generator)  # filler
    labels = torch.full_like(ids, IGNORE)
    shift = torch.randint(0, max_shift + 1, (num_rows, 1), generator=generator)
    where = shift + torch.arange(length)  # [rows, length]: where each token of a row goes
    return MQARRows(ids.scatter_(1, where, rows.ids), labels.scatter_(1, where, rows.labels))


def pair_ladder(kv_pairs: int, rungs: int) -> list[int]:
    """``rungs`` pair counts halving down from ``kv_pairs`` (each at least 1, repeats dropped): the pair counts
    of a mixed training set. Zoology trains on a mix of easy and hard cells; the easy rows teach the lookup
    that the hard ones alone rarely reveal in a short run."""
    if not isinstance(rungs, int) or rungs < 1:
        raise ValueError(f"rungs must be a positive integer, got {rungs!r}")
    return sorted({max(1, kv_pairs >> k) for k in range(rungs)}, reverse=True)


def mixed_mqar_rows(num_rows: int, seq_len: int, pair_counts: list[int], vocab_size: int = 8192, *,
                    seed: int = 0) -> MQARRows:
    """``num_rows`` rows of length ``seq_len``, split evenly over ``pair_counts`` (any remainder to the first),
    one block per count: the training loop's shuffled order mixes them."""
    if not pair_counts:
        raise ValueError("pair_counts must name at least one kv_pairs")
    share, extra = divmod(num_rows, len(pair_counts))
    parts = [mqar_rows(share + (extra if i == 0 else 0), seq_len, kv_pairs, vocab_size, seed=seed * 1009 + i)
             for i, kv_pairs in enumerate(pair_counts)]
    return MQARRows(torch.cat([p.ids for p in parts]), torch.cat([p.labels for p in parts]))


def answer_logits(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, vocab]`` predicted for the batch's N answer positions, and their ``targets [N]``.

    Only the answer positions go through the output head: with an 8,192-entry vocabulary the head is most of the
    cost of a small model, and MQAR labels a few positions per row. ``model`` is a single-process
    :class:`~hybridlm.HybridForCausalLM` (its body and head are called separately)."""
    targets = batch["labels"][:, 1:]  # [B, T-1]: the token each position predicts
    answered = targets != IGNORE  # [B, T-1]
    out = model.model(input_ids=batch["input_ids"])
    hidden = out.last_hidden_state[:, :-1][answered]  # [N, D]
    logits = model.get_output_embeddings()(hidden) * model.config.logits_multiplier  # [N, V]
    return logits, targets[answered]


def answer_losses(model, batch: dict[str, torch.Tensor], precision: str = "fp32"):
    """:func:`hybridlm.training.loop.token_losses` for MQAR (``train(..., losses=answer_losses)``): summed
    cross-entropy over the answer positions, their count, and no auxiliary loss (the models have no MoE)."""
    if precision != "fp32":
        raise ValueError(f"MQAR trains in fp32, got precision={precision!r}")
    logits, targets = answer_logits(model, batch)
    return F.cross_entropy(logits.float(), targets, reduction="sum"), targets.numel(), None


@torch.no_grad()
def answer_accuracy(model, rows: MQARRows, batch_size: int = 64) -> float:
    """The fraction of answer positions whose value the model predicts (argmax) from the tokens before it."""
    was_training = model.training
    model.eval()
    correct = total = 0
    for start in range(0, len(rows), batch_size):
        logits, targets = answer_logits(model, rows.batch(torch.arange(start, min(start + batch_size, len(rows))),
                                                          "stream"))
        correct += int((logits.argmax(-1) == targets).sum())
        total += targets.numel()
    model.train(was_training)
    return correct / max(total, 1)


def mqar_config(mixer: str, hidden_size: int, state_size: int | None, seq_len: int, vocab_size: int = 8192,
                mamba2_norm: str = "gated"):
    """The :class:`~hybridlm.HybridConfig` of benchmark model ``mixer`` (a key of :data:`MIXER_PATTERNS`):
    no MLPs (Zoology's MQAR models are mixers only), tied embeddings, heads of width 32. ``state_size`` is the
    recurrent state dimension of the fixed-state kinds (Mamba/Mamba-2/Mamba-3 ``d_state``, Performer features,
    Linformer rank); attention and conv-attention have none. ``mamba2_norm``: Mamba-2's output gating
    (:class:`~hybridlm.HybridConfig` field of that name)."""
    from hybridlm.config import HybridConfig

    if mixer not in MIXER_PATTERNS:
        raise ValueError(f"mixer must be one of {', '.join(MIXER_PATTERNS)}, got {mixer!r}")
    pattern = MIXER_PATTERNS[mixer]
    if not needs_state_size(mixer):
        if state_size is not None:
            raise ValueError(f"state_size must be None for {mixer}: its state is the KV cache (and conv windows)")
    elif state_size is None:
        raise ValueError(f"mixer {mixer!r} needs a state_size")
    state = state_size or 16
    return HybridConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, layer_pattern=pattern, mlp_types=["none"] * len(pattern),
        tie_word_embeddings=True, num_attention_heads=max(1, hidden_size // 32), head_dim=min(32, hidden_size),
        mamba_d_state=state, mamba2_d_state=state, mamba2_head_dim=min(32, hidden_size), mamba2_chunk_size=64,
        mamba3_d_state=state, mamba3_head_dim=min(32, hidden_size),
        performer_num_features=state, linformer_rank=state, linformer_max_length=seq_len,
        max_position_embeddings=None, eos_token_id=None, mamba2_norm=mamba2_norm,
    )


def state_bytes_per_sequence(model, seq_len: int) -> int:
    """Bytes of the model's cache (all layers) after reading one sequence of ``seq_len`` tokens."""
    with torch.no_grad():
        cache = model.new_cache(1)
        model(input_ids=torch.zeros(1, seq_len, dtype=torch.long), cache=cache)
    return cache.nbytes()
