"""lm-eval's standard path on a hybridlm checkpoint: ``--model hf`` with ``trust_remote_code=True`` loads it in a
process that never imports hybridlm itself (the checkpoint's shim does), and scores a local multiple-choice task
and a ``loglikelihood_rolling`` task with the numbers a direct computation gives."""

import json
import math
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import hybridlm

pytest.importorskip("lm_eval")

MC_DOCS = [
    {"question": "def add(a, b):\n    return a", "choices": ["+ b", "- b", "* b"], "answer": 0},
    {"question": "import", "choices": ["os", "the", "xyzzy"], "answer": 0},
    {"question": "for i in", "choices": ["range(10):", "banana", "42)"], "answer": 0},
]
TEXT_DOCS = [{"text": "import sys\n\n\ndef main():\n    print(sys.argv)\n"},
             {"text": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"}]
TASKS = {
    "tiny_mc": """
        task: tiny_mc
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: "{dir}/mc.jsonl"}}}}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list: [{{metric: acc}}]
    """,
    "tiny_rolling": """
        task: tiny_rolling
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: "{dir}/text.jsonl"}}}}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list: [{{metric: bits_per_byte}}]
    """,
}
RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

assert "hybridlm" not in sys.modules
out = lm_eval.simple_evaluate(model="hf", model_args="pretrained={model},trust_remote_code=True,dtype=float32",
                              tasks=["tiny_mc", "tiny_rolling"], task_manager=TaskManager(include_path="{tasks}"),
                              batch_size=1, device="cpu", log_samples=True)
mc = [[float(r[0]) for r in s["filtered_resps"]] for s in sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])]
print(json.dumps({{"results": out["results"], "mc": mc}}))
"""


@torch.no_grad()
def continuation_logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    logprobs = model(ids[:, :-1]).logits.double().log_softmax(-1)[0]
    targets = torch.tensor(continuation)
    return logprobs[len(context) - 1:].gather(-1, targets[:, None]).sum().item()


@pytest.mark.slow
def test_lm_eval_scores_a_hybridlm_checkpoint_through_trust_remote_code(tmp_path):
    source = hybridlm.bundled_model_dir()
    model_dir = tmp_path / "model"
    model = hybridlm.load(source).eval()
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, model_dir / name)
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(d) + "\n" for d in TEXT_DOCS))
    for name, text in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(textwrap.dedent(text).format(dir=tmp_path))
    run = subprocess.run([sys.executable, "-c", RUN.format(model=model_dir, tasks=tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encode = tokenizer.encode
    expected_mc = []
    for doc in MC_DOCS:  # lm-eval encodes context + " " + choice whole, then splits at the context's length
        context = encode(doc["question"])
        expected_mc.append([continuation_logprob(model, context, encode(doc["question"] + " " + c)[len(context):])
                            for c in doc["choices"]])
    assert torch.allclose(torch.tensor(got["mc"]), torch.tensor(expected_mc), atol=1e-4, rtol=1e-5), \
        (got["mc"], expected_mc)
    accuracy = sum(max(range(3), key=row.__getitem__) == d["answer"] for row, d in zip(expected_mc, MC_DOCS)) / 3
    assert got["results"]["tiny_mc"]["acc,none"] == pytest.approx(accuracy)

    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    total = sum(continuation_logprob(model, [prefix], encode(d["text"])) for d in TEXT_DOCS)
    bits_per_byte = -total / sum(len(d["text"].encode()) for d in TEXT_DOCS) / math.log(2)
    assert 0.5 < bits_per_byte < 20
    assert got["results"]["tiny_rolling"]["bits_per_byte,none"] == pytest.approx(bits_per_byte, rel=1e-5)
