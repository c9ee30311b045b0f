"""One engine of ``cpu_peers.py`` in a process of its own (``peer_engines.RemoteEngine`` starts it): no other
engine's threads live here, so none spins or sleeps in this process while this one is timed. It builds the
engine ``peer_engines.build`` makes of the JSON spec, then answers JSON lines on stdin, one per line on stdout:

* ``{"op": "ready"}`` → ``{"result": null}`` once the engine is built;
* ``{"op": M, "args": [...]}`` → ``{"result": ...}``, ``M`` one of the engine's measurements (``begin``,
  ``decode_ms``, ``prefill_seconds``, ``greedy``, ``top_two_margin``);
* ``{"op": "log_probs", "args": [row, path]}``: the engine's float64 log-probabilities over ``row``, written to
  ``path`` (safetensors, key ``log_probs``);
* a failure → ``{"error": "..."}``, and the worker goes on.

    python benchmarks/engine_worker.py SPEC_JSON THREADS
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_engines as peers  # noqa: E402

from hybridlm.files import written_aside  # noqa: E402

MEASUREMENTS = ("begin", "decode_ms", "prefill_seconds", "greedy", "top_two_margin")


def answer(engine, request: dict):
    if request["op"] == "ready":
        return None
    if request["op"] == "log_probs":
        row, path = request["args"]
        with written_aside(Path(path)) as temporary:
            save_file({"log_probs": engine.log_probs(row).contiguous()}, temporary)
        return None
    if request["op"] not in MEASUREMENTS:
        raise ValueError(f"unknown op {request['op']!r}")
    return getattr(engine, request["op"])(*request["args"])


def main() -> None:
    spec, threads = json.loads(sys.argv[1]), int(sys.argv[2])
    answers = os.fdopen(os.dup(1), "w")  # the answers keep stdout; anything else printed goes to stderr
    os.dup2(2, 1)
    torch.set_num_threads(threads)
    engine = peers.build(spec)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"result": answer(engine, request)}
        except Exception:  # the parent raises it, naming this worker's log
            traceback.print_exc()
            reply = {"error": traceback.format_exc(limit=2).strip().splitlines()[-1]}
        print(json.dumps(reply), file=answers, flush=True)
    if hasattr(engine, "close"):
        engine.close()


if __name__ == "__main__":
    main()
