"""lm-eval on hybridlm checkpoints by its standard command: a local ``loglikelihood_rolling`` task over the
held-out standard-library files (hybridlm's training split), scored by ``lm_eval --model hf`` with
``trust_remote_code=True`` in a process that does not import hybridlm.

    python benchmarks/lm_eval_stdlib.py [--models DIR ...] [--max-length 512] [--limit N]

Default models: the two bundled ones. It writes the task (a YAML file and the documents as JSONL) into a
temporary folder, runs ``lm_eval`` once per model and prints bits per byte, byte and word perplexity. A
``--max-length`` of 0 leaves lm-eval to read the length from the checkpoint (see docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TASK = """task: stdlib_heldout
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{documents}"}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: bits_per_byte}}, {{metric: byte_perplexity}}, {{metric: word_perplexity}}]
"""


def write_task(folder: Path, limit: int | None) -> None:
    from hybridlm.training.corpus import stdlib_corpus

    texts = stdlib_corpus().held_out_texts[:limit]
    (folder / "documents.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "stdlib_heldout.yaml").write_text(TASK.format(documents=folder / "documents.jsonl"))


def score(model: str, tasks: Path, max_length: int, out: Path) -> dict:
    arguments = f"pretrained={model},trust_remote_code=True,dtype=float32"
    if max_length:
        arguments += f",max_length={max_length}"
    command = ["lm_eval", "--model", "hf", "--model_args", arguments, "--tasks", "stdlib_heldout", "--include_path",
               str(tasks), "--batch_size", "1", "--device", "cpu", "--output_path", str(out)]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
    (result,) = out.rglob("results_*.json")
    return json.loads(result.read_text())["results"]["stdlib_heldout"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", help="checkpoint directories (default: the bundled models)")
    parser.add_argument("--max-length", type=int, default=512, help="lm-eval's window (0: read from the model)")
    parser.add_argument("--limit", type=int, help="score only the first N held-out files")
    args = parser.parse_args()
    if args.models is None:
        from hybridlm.bundled import BUNDLED_MODELS, bundled_model_dir

        args.models = [str(bundled_model_dir(name)) for name in BUNDLED_MODELS]  # str: lm-eval takes a Path as a model
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        write_task(folder, args.limit)
        rows = {model: score(model, folder, args.max_length, folder / f"out{i}") for i, model in
                enumerate(args.models)}
    print(f"\nheld-out stdlib, lm-eval loglikelihood_rolling, max_length={args.max_length or 'from the model'}")
    print("| model | bits per byte | byte perplexity | word perplexity |\n|---|---|---|---|")
    for model, result in rows.items():
        print(f"| {Path(model).name} | {result['bits_per_byte,none']:.4f} | {result['byte_perplexity,none']:.4f} | "
              f"{result['word_perplexity,none']:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
