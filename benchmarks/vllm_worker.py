"""vLLM's side of ``cpu_peers.py``: run by the vLLM venv's Python (``setup_peers.sh``), it loads one checkpoint
directory and answers JSON lines on stdin, one per line on stdout:

* ``{"op": "ready"}`` → ``{}`` once the engine is up;
* ``{"op": "greedy", "rows": [[ids]], "new_tokens": n}`` → ``{"tokens": [[ids]]}``, greedy, EOS ignored;
* ``{"op": "timed", "rows": ..., "new_tokens": n}`` → ``{"seconds": s}`` for that ``generate``, timed here.

    vllm-venv/bin/python benchmarks/vllm_worker.py DIRECTORY fp32|bf16 MAX_LENGTH BATCH

Prefix caching is off, so a repeated prompt is computed again each time. Only the answers go to stdout (vLLM's
own output is sent to stderr).
"""

import json
import os
import sys
import time


def main() -> None:
    directory, dtype, max_length, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    answers = os.fdopen(os.dup(1), "w")  # the answers keep stdout; vLLM's own prints go to stderr
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=directory, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], max_model_len=max_length,
              max_num_seqs=batch, enable_prefix_caching=False, skip_tokenizer_init=True)

    def generate(rows, new_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=row) for row in rows]
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]

    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "ready":
            answer = {}
        elif request["op"] == "greedy":
            answer = {"tokens": generate(request["rows"], request["new_tokens"])}
        else:
            start = time.perf_counter()
            generate(request["rows"], request["new_tokens"])
            answer = {"seconds": time.perf_counter() - start}
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    main()
