"""The data of a distillation: text (files, directories, globs; the standard library by default, with
:data:`~hybridlm.training.corpus.HELD_OUT_STDLIB` held out) or a JSONL file, always in the teacher's tokenizer.

A JSONL line is one document: ``{"text": str}``, ``{"prompt": str, "response": str}`` (the two joined), a chat
``{"messages": [{"role", "content"}, ...]}`` (rendered with the teacher's chat template) or token ids
``{"input_ids": [int, ...]}``, which must be the teacher tokenizer's: an id outside its vocabulary, or ids that
decoding and encoding again changes (another tokenizer's ids), are an error naming the line. Documents are packed
into rows of ``--seq-len`` with positions restarting at each (padding-free); every token is a distillation target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridlm.training.evaluation import HeldOut
from hybridlm.training.packing import PackedRows, pack_documents

#: Documents of an ``input_ids`` JSONL file checked to round-trip through the teacher's tokenizer, and the share
#: of them that must.
ROUND_TRIP_SAMPLE, ROUND_TRIP_SHARE = 16, 0.5


def _is_jsonl(specs: list[str] | None) -> bool:
    return bool(specs) and len(specs) == 1 and specs[0].endswith(".jsonl") and Path(specs[0]).is_file()


def read_jsonl_documents(path: str | Path, tokenizer, option: str = "--data") -> list[tuple[str, str | list[int]]]:
    """``(where, text or ids)`` per non-empty line of a JSONL file (see the module docstring)."""
    path = Path(path)
    documents = []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{option} {path}:{number}"
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not a JSON line ({error})") from None
        documents.append((where, _document(record, tokenizer, where)))
    if not documents:
        raise ValueError(f"{option} {path}: no documents")
    return documents


def _document(record, tokenizer, where: str) -> str | list[int]:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    if isinstance(record, dict) and all(isinstance(record.get(k), str) for k in ("prompt", "response")):
        return record["prompt"] + record["response"]
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: a chat example, but the teacher's tokenizer has no chat template")
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    ids = record.get("input_ids") if isinstance(record, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return ids
    raise ValueError(f"{where}: a line needs 'text', 'prompt' and 'response', 'messages', or a non-empty list of "
                     "integer 'input_ids'")


def check_ids(documents: list[tuple[str, str | list[int]]], tokenizer) -> None:
    """Token-id documents must be the teacher tokenizer's (see the module docstring)."""
    vocab = len(tokenizer)
    id_documents = [(where, ids) for where, ids in documents if isinstance(ids, list)]
    for where, ids in id_documents:
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} is not one of the teacher tokenizer's {vocab} ids: the data "
                             "was tokenized with another tokenizer; give text, or ids of the teacher's tokenizer")
    sample = id_documents[:ROUND_TRIP_SAMPLE]
    same = sum(tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids for _, ids in sample)
    if sample and same < ROUND_TRIP_SHARE * len(sample):
        raise ValueError(f"{sample[0][0].rsplit(':', 1)[0]}: these token ids are not the teacher tokenizer's "
                         f"(decoding and encoding again changes {len(sample) - same} of the first {len(sample)} "
                         "documents): the data was tokenized with another tokenizer; give text instead")


def _stream(documents: list[str | list[int]], tokenizer) -> torch.Tensor:
    """One id stream, each document followed by the end-of-text id."""
    eos, ids = tokenizer.eos_token_id, []
    texts = [d for d in documents if isinstance(d, str)]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    for document in documents:
        ids += (next(encoded) if isinstance(document, str) else document) + [eos]
    return torch.tensor(ids, dtype=torch.long)


def _texts(documents: list[str | list[int]], tokenizer) -> list[str]:
    return [d if isinstance(d, str) else tokenizer.decode(d) for d in documents]


def documents(data: list[str] | None, eval_data: list[str] | None, tokenizer):
    """Training and held-out documents (each text or ids) from ``--data`` / ``--eval-data``."""
    from hybridlm.training.corpus import expand_paths, stdlib_corpus, text_corpus

    if data is None and eval_data is None:
        corpus = stdlib_corpus()
        return corpus.train_texts, corpus.held_out_texts
    if data is None:
        raise ValueError("--eval-data needs --data")
    if not _is_jsonl(data):
        corpus = text_corpus(data, None if _is_jsonl(eval_data) else eval_data)
        train = corpus.train_texts
        held_out = corpus.held_out_texts if not _is_jsonl(eval_data) else None
    else:
        lines = read_jsonl_documents(data[0], tokenizer)
        check_ids(lines, tokenizer)
        if eval_data is None:
            if len(lines) < 2:
                raise ValueError(f"--data {data[0]}: too few documents to hold some out; pass --eval-data")
            train = [d for i, (_, d) in enumerate(lines) if i % 50]
            held_out = [d for _, d in lines[::50]]
        else:
            train, held_out = [d for _, d in lines], None
    if held_out is None:
        if _is_jsonl(eval_data):
            lines = read_jsonl_documents(eval_data[0], tokenizer, "--eval-data")
            check_ids(lines, tokenizer)
            held_out = [d for _, d in lines]
        else:
            held_out = [path.read_text(encoding="utf-8", errors="replace")
                        for path in expand_paths(eval_data, "--eval-data")]
    return train, held_out


def distill_rows(args, tokenizer) -> tuple[PackedRows, HeldOut]:
    """The packed training rows and the held-out set (at most ``--held-out-rows`` rows, evenly spaced over it)."""
    train, held_out_documents = documents(args.data, args.eval_data, tokenizer)
    rows = pack_documents(_stream(train, tokenizer), args.seq_len, tokenizer.eos_token_id)
    held_out = HeldOut.of(tokenizer, _texts(held_out_documents, tokenizer), args.seq_len)
    limit = args.held_out_rows
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--held-out-rows must be a positive integer, got {limit}")
        if limit < len(held_out.rows):
            keep = torch.linspace(0, len(held_out.rows) - 1, limit).round().long().unique()
            held_out.rows = PackedRows(held_out.rows.ids[keep], held_out.rows.positions[keep])
    return rows, held_out
