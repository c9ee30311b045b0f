"""The recall probes of hybridlm.training.distill_measure (passkey at 1024/2048 tokens x depths 0.1/0.5/0.9,
key-value recall with 8 and 32 pairs) for one model, so the teacher's need not be recomputed beside each student.
usage: recall_one.py NAME MODEL_DIR TEACHER_DIR OUT.json"""
import json
import sys
import time

import torch

from hybridlm.model import load
from hybridlm.training.distill import teacher_tokenizer
from hybridlm.training.distill_measure import kv_recall, passkey_cells

torch.set_num_threads(1)
name, model_dir, teacher_dir, out = sys.argv[1:5]
start = time.time()
model = load(model_dir, dtype=torch.float32).eval()
tokenizer = teacher_tokenizer(teacher_dir, model.config.vocab_size)
models = {name: model}
result = {"model": name, "dir": model_dir, "passkey": passkey_cells(models, tokenizer, [1024, 2048]),
          "kv_recall": {str(n): kv_recall(models, tokenizer, n)[name] for n in (8, 32)}}
result["seconds"] = time.time() - start
with open(out, "w") as file:
    json.dump(result, file, indent=1)
marks = " ".join(f"L={c['length']}@{c['depth']}:{'+' if c['correct'] else '-'}({c['answer']!r})"
                 for c in result["passkey"])
print(name, "passkey", marks, "kv", result["kv_recall"])
