"""Held-out evaluation in bits per byte: comparable across tokenizers, since it counts the text's bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridlm.training.loop import evaluate
from hybridlm.training.packing import PackedRows, pack_documents, tokenize_documents


@dataclass
class HeldOut:
    """Held-out rows and the held-out text's tokens per byte (each document separator counted as a byte)."""

    rows: PackedRows
    tokens_per_byte: float

    @classmethod
    def of(cls, tokenizer, texts: list[str], seq_len: int) -> HeldOut:
        stream = tokenize_documents(tokenizer, texts)
        text_bytes = sum(len(text.encode("utf-8")) + 1 for text in texts)
        rows = pack_documents(stream, seq_len, tokenizer.eos_token_id, what="the held-out text (--eval-data)")
        return cls(rows, len(stream) / text_bytes)

    def bits_per_byte(self, loss: float) -> float:
        """Bits per byte of a mean loss in nats per token."""
        return loss * self.tokens_per_byte / math.log(2)

    def evaluate(self, model, layout: str, limit: int | None = None) -> dict:
        """``eval_loss`` (nats/token), ``bits_per_byte`` and ``eval_tokens`` over the first ``limit`` rows."""
        loss = evaluate(model, self.rows, layout, limit)
        rows = len(self.rows) if limit is None else min(limit, len(self.rows))
        return {"eval_loss": loss, "bits_per_byte": self.bits_per_byte(loss),
                "eval_tokens": rows * self.rows.ids.shape[1]}
