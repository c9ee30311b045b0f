"""Pretrain a small hybrid on bytes of text that needs no download: Python's own standard library sources.

    python recipes/pretrain_bytes.py --steps 300 --out runs/bytes
    hybridlm generate --model runs/bytes --ids 100,101,102

Byte-level (vocab 256), so no tokenizer is needed; the model is saved with ``save_pretrained`` and loads with
``from_pretrained`` / ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
from tqdm import tqdm

from hybridlm import HybridConfig, HybridForCausalLM
from hybridlm.generation import IncrementalDecoder


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to ``limit`` bytes of the interpreter's standard-library ``.py`` files, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - length - 1, (batch,), generator=generator)
        yield torch.stack([data[s:s + length] for s in starts.tolist()])


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default="MMAM", help="layer pattern (A attention, M Mamba, S Mamba-2, ...)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--out", type=Path, help="directory for save_pretrained")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    config = HybridConfig(vocab_size=256, hidden_size=args.hidden, layer_pattern=args.pattern,
                          num_attention_heads=4, num_key_value_heads=2, mamba2_head_dim=32, mamba2_d_state=32,
                          mamba2_chunk_size=64, eos_token_id=None)
    model = HybridForCausalLM(config)
    data = stdlib_bytes(args.corpus_bytes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20)
                                                 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    stream = batches(data, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    model.train()
    progress = tqdm(range(args.steps), desc="training")
    loss = float("nan")
    for _ in progress:
        ids = next(stream)
        out = model(ids, labels=ids)
        optimizer.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss = out.loss.item()
        progress.set_postfix(loss=f"{loss:.3f}", bits_per_byte=f"{loss / math.log(2):.2f}")
    model.eval()
    prompt = list(b"def ")
    text = IncrementalDecoder(model).generate([prompt], max_new_tokens=48)[0].tolist()
    print(repr(bytes(text).decode("utf-8", errors="replace")))
    if args.out:
        model.save_pretrained(args.out)
        print(f"saved to {args.out}")
    return loss


if __name__ == "__main__":
    main()
