"""What every item of ``real_model_remedies.py`` shares: the model and tokenizer (:class:`Bench`), chunked
prefill and teacher forcing, the cache policies compared, plotting."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from real_model import require_model

import hybridlm
from hybridlm import CachePolicy
from hybridlm.cache.kv.base import KVState
from hybridlm.files import write_file

ITEMS = ("blocks", "kivi", "stream", "passkey", "speculative", "prefix", "speed")
BLOCK = 64  # the longest forward read as decode steps (hybridlm.cache.rollback.AUTO_CHECKPOINT_TOKENS)




class Bench:
    """What every item gets: the models, the tokenizer, the settings."""

    def __init__(self, args):
        from transformers import AutoTokenizer

        _, self.directory = require_model()
        self.args = args
        self.model = hybridlm.load(self.directory).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory)
        self._hf = None

    @property
    def hf(self):
        """transformers' ``LlamaForCausalLM`` of the same directory (loaded on first use)."""
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32).eval()
        return self._hf

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)


def quantized_copy(model, source, policy: CachePolicy):
    """A cache under the KIVI ``policy`` holding what prefilling ``source``'s tokens in one chunk would: each
    contiguous state's keys (stored rotated) and values written through the quantized layout's own update."""
    target = model.new_cache(source.batch_size, policy=policy)
    seen = source.seen
    positions = torch.arange(seen).expand(source.batch_size, seen)
    for state, copy in zip(source.states, target.states):
        if not isinstance(state, KVState):
            raise TypeError(f"quantized_copy expects contiguous KV states, got {type(state).__name__}")
        copy.update(state.keys[:, :, :seen], state.values[:, :, :seen], positions, None, None)
    target.seen = seen
    target.positions.copy_(source.positions)
    return target


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids [batch, n]`` in ``chunk``-token forwards; the last position's logits ``[batch, vocab]``."""
    for start in range(0, ids.shape[1], chunk):
        logits = model(ids[:, start:start + chunk], cache=cache, logits_to_keep=1).logits
    return logits[:, -1]


@torch.no_grad()
def teacher_forced(model, cache, ids: torch.Tensor, block: int):
    """Feed ``ids [batch, n]`` in ``block``-token forwards; yields ``(start, logits [batch, block, vocab])``, the
    logits at positions ``start..``, i.e. of the tokens after them."""
    for start in range(0, ids.shape[1], block):
        yield start, model(ids[:, start:start + block], cache=cache).logits


def save_plot(figure, path: Path) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    write_file(path, buffer.getvalue())
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path.name


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def policy_label(policy: CachePolicy | None) -> str:
    if policy is None:
        return "full attention"
    if policy.kv_bits != 16:
        return f"KIVI {policy.kv_bits}-bit"
    if policy.heavy_hitters:
        return f"H2O {policy.heavy_hitters} + window {policy.window}"
    if policy.sink_tokens:
        return f"sinks {policy.sink_tokens} + window {policy.window}"
    return f"window {policy.window}"


def eviction_policies(window: int) -> dict[str, CachePolicy | None]:
    """Full attention and the three bounded policies, each holding ``window`` tokens."""
    policies = [None, CachePolicy(window=window), CachePolicy(sink_tokens=4, window=window - 4),
                CachePolicy(heavy_hitters=window // 2, window=window // 2)]
    return {policy_label(p): p for p in policies}
