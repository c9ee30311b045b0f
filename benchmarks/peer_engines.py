"""The engines that ``cpu_peers.py`` times side by side, behind one interface: ``prefill(rows)`` resets the
engine's state, feeds the rows (one sequence each) and returns each row's greedy next token; ``step(tokens)``
feeds one token per row and returns the next greedy ones. :class:`SteppedEngine` builds the measurements on
those two, and :class:`RemoteEngine` takes the same measurements of an engine in its own process
(``engine_worker.py``), so that no other engine's threads share its process.

* :class:`HybridlmEngine`: a checkpoint directory through ``HybridForCausalLM.from_pretrained``, prefilled by
  its forward and stepped by :class:`~hybridlm.decoding.decode_step.DecodeStep` on a static cache (compiled or
  eager).
* :class:`TransformersEngine`: the same directory through transformers' ``AutoModelForCausalLM`` and its own
  cache, stepped by its forward (what hybridlm's decoders are compared with elsewhere, ``hf_speed.py``).
* :class:`LlamaCppEngine`: a GGUF file through llama.cpp's C API, called in the process that holds it through
  the ctypes bindings of the llama-cpp-python sdist that ``setup_peers.sh`` builds (``llama_decode`` per batch,
  the greedy token read from ``llama_get_logits_ith``).
* :class:`RemoteEngine`: any of the three above, built from a spec (:func:`build`) in ``engine_worker.py``.
* :class:`VllmEngine`: vLLM's CPU build in its own venv and process (``vllm_worker.py``), which times whole
  requests itself; it is not stepped (``decode_ms``, ``prefill_s`` and ``greedy`` instead).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import hybridlm
from hybridlm.decoding.decode_step import DecodeStep

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "hybridlm" / "peers"))
SDIST_DIR = PEERS_DIR / "llama_cpp_python-0.3.36"
LLAMA_LIB_DIR = PEERS_DIR / "llama.cpp-build" / "bin"
VLLM_PYTHON = PEERS_DIR / "vllm-venv" / "bin" / "python"
SETUP = "bash benchmarks/setup_peers.sh"
GGML_TYPE_F32 = 0  # ggml_type values for the KV cache
GGML_TYPE_F16 = 1


class SteppedEngine:
    """The measurements every engine offers, on top of its ``prefill`` and ``step``; the same code times an engine
    in the harness's process and in a worker's."""

    next_tokens: list[int]  # the greedy tokens the next step feeds, set by begin()

    def begin(self, rows: list[list[int]]) -> None:
        """Prefill ``rows`` (untimed): :meth:`decode_ms` steps on from there."""
        self.next_tokens = self.prefill(rows)

    def decode_ms(self, warmup: int, steps: int) -> list[float]:
        """Milliseconds of each of ``steps`` steps after ``warmup`` untimed ones, going on from the last step."""
        times = []
        for index in range(warmup + steps):
            start = time.perf_counter()
            self.next_tokens = self.step(self.next_tokens)
            if index >= warmup:
                times.append(1000 * (time.perf_counter() - start))
        return times

    def prefill_seconds(self, rows: list[list[int]]) -> float:
        start = time.perf_counter()
        self.prefill(rows)
        return time.perf_counter() - start

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """``new_tokens`` greedy tokens after ``prompt`` (batch 1)."""
        tokens = self.prefill([prompt])
        while len(tokens) < new_tokens:
            tokens += self.step(tokens[-1:])
        return tokens


class HybridlmEngine(SteppedEngine):
    """``directory`` loaded by hybridlm at ``dtype`` (int8: int8 weight-only linears,
    :func:`~hybridlm.model.quantize_weights`, on the bf16 model: compiled, inductor multiplies the int8 codes by the
    bf16 inputs in its weight-only GEMM, where on an fp32 model its freezing folds the codes back into fp32 weights;
    q8: int8 codes in groups of 32 inputs and the inputs quantized per group, on the bf16 model)."""

    def __init__(self, directory: Path, dtype: str, headroom: int, compiled: bool, mode: str | None = None):
        torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
        self.model = hybridlm.HybridForCausalLM.from_pretrained(directory, dtype=torch_dtype).eval()
        if dtype in ("int8", "q8"):
            hybridlm.model.quantize_weights(self.model, group_size=32 if dtype == "q8" else None)
        self.headroom = headroom  # the static cache holds the prompt and this many more tokens
        self.step_fn = DecodeStep(self.model, compile=compiled, mode=mode)
        self.cache = None

    @torch.inference_mode()
    def prefill(self, rows: list[list[int]]) -> list[int]:
        self.cache = self.model.new_cache(len(rows), max_length=len(rows[0]) + self.headroom, static=True)
        logits = self.model(torch.tensor(rows), cache=self.cache, logits_to_keep=1).logits[:, -1]
        return logits.argmax(-1).tolist()

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> list[int]:
        return self.step_fn(torch.tensor(tokens), self.cache).argmax(-1).tolist()

    @torch.inference_mode()
    def log_probs(self, row: list[int]) -> torch.Tensor:
        """Next-token log-probabilities after each token of ``row``: float64 ``[len(row), vocab]``."""
        return self.model(torch.tensor([row])).logits[0].double().log_softmax(-1)

    @torch.inference_mode()
    def top_two_margin(self, prompt: list[int], tokens: list[int], index: int) -> float:
        """The gap between the two largest logits where the model chose ``tokens[index]`` after ``prompt``."""
        logits = self.model(torch.tensor([prompt + tokens[:index]])).logits[0, -1].float()
        top = logits.topk(2).values
        return float(top[0] - top[1])


class TransformersEngine(SteppedEngine):
    """``directory`` loaded by transformers at ``dtype`` (f32 or bf16), decoding with its default cache."""

    def __init__(self, directory: Path, dtype: str):
        from transformers import AutoModelForCausalLM

        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype).eval()
        self.cache = None

    @torch.inference_mode()
    def prefill(self, rows: list[list[int]]) -> list[int]:
        out = self.model(torch.tensor(rows), use_cache=True, logits_to_keep=1)
        self.cache = out.cache
        return out.logits[:, -1].argmax(-1).tolist()

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> list[int]:
        out = self.model(torch.tensor(tokens)[:, None], cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1].argmax(-1).tolist()


_callbacks = []  # ctypes callbacks must outlive the library's use of them


def llama_cpp_built() -> bool:
    return (LLAMA_LIB_DIR / "libllama.so").is_file()


@functools.cache
def load_llama_cpp():
    """The llama-cpp-python bindings bound to ``setup_peers.sh``'s build (quiet), or None when it has not run."""
    if not llama_cpp_built():
        return None
    os.environ["LLAMA_CPP_LIB_PATH"] = str(LLAMA_LIB_DIR)
    sys.path.insert(0, str(SDIST_DIR))
    import llama_cpp

    _callbacks.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
    llama_cpp.llama_log_set(_callbacks[-1], ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    return llama_cpp


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX int8 tiles (llama.cpp then puts quantized weights in its AMX buffers)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


class LlamaCppEngine(SteppedEngine):
    """A GGUF file in llama.cpp at ``threads`` threads, ``batch`` sequences, KV cache in f32 for f32 weights (equal
    precision) and llama.cpp's default f16 otherwise. ``extra_buffers=False`` keeps the weights out of llama.cpp's
    repacking buffers (AMX on CPUs that have it; its ``--no-repack``)."""

    def __init__(self, llama_cpp, gguf: Path, threads: int, max_length: int, batch: int, f32_cache: bool,
                 extra_buffers: bool = True):
        self.lib = llama_cpp
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = extra_buffers
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_length * batch
        params.n_batch, params.n_ubatch = 2048, 512  # llama-bench's defaults
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = threads
        if f32_cache:
            params.type_k = params.type_v = GGML_TYPE_F32
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {gguf} (n_ctx {params.n_ctx}, {batch} seqs)")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.chunk = llama_cpp.llama_n_batch(self.ctx)  # n_batch as the context took it (at most n_ctx)
        self.batch_buffer = llama_cpp.llama_batch_init(max(self.chunk, batch), 0, batch)
        self.positions: list[int] = []

    def _logits(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Feed ``(token, position, sequence, wants_logits)`` entries as one batch; the logits ``[vocab]`` of each
        entry that wants them, in order (views into llama.cpp's buffer, valid until the next batch)."""
        b = self.batch_buffer
        for i, (token, pos, seq, wants) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, int(wants)
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if (status := self.lib.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return [np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                for i, entry in enumerate(entries) if entry[3]]

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """:meth:`_logits`' greedy tokens."""
        return [int(logits.argmax()) for logits in self._logits(entries)]

    def prefill(self, rows: list[list[int]]) -> list[int]:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        firsts = []
        for seq, row in enumerate(rows):
            for start in range(0, len(row), self.chunk):
                piece = row[start:start + self.chunk]
                last = start + len(piece) == len(row)
                entries = [(t, start + i, seq, last and i == len(piece) - 1) for i, t in enumerate(piece)]
                firsts += self._decode(entries)
        self.positions = [len(row) for row in rows]
        return firsts

    def step(self, tokens: list[int]) -> list[int]:
        entries = [(t, self.positions[s], s, True) for s, t in enumerate(tokens)]
        self.positions = [p + 1 for p in self.positions]
        return self._decode(entries)

    def log_probs(self, row: list[int]) -> torch.Tensor:
        """Next-token log-probabilities after each token of ``row`` (one sequence, from an empty cache): float64
        ``[len(row), vocab]``."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        rows = []
        for start in range(0, len(row), self.chunk):
            entries = [(token, start + i, 0, True) for i, token in enumerate(row[start:start + self.chunk])]
            rows += [logits.copy() for logits in self._logits(entries)]
        return torch.from_numpy(np.stack(rows)).double().log_softmax(-1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch_buffer)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def build(spec: dict) -> SteppedEngine:
    """The engine a spec describes: ``kind`` (``hybridlm``, ``transformers`` or ``llama.cpp``) and the keyword
    arguments of its class (paths as strings, so that a spec goes through JSON to ``engine_worker.py``)."""
    kind, arguments = spec["kind"], {key: value for key, value in spec.items() if key != "kind"}
    if kind == "hybridlm":
        return HybridlmEngine(Path(arguments.pop("directory")), **arguments)
    if kind == "transformers":
        return TransformersEngine(Path(arguments.pop("directory")), **arguments)
    if kind == "llama.cpp":
        llama_cpp = load_llama_cpp()
        if llama_cpp is None:
            raise RuntimeError(f"llama.cpp is not built in {PEERS_DIR} (`{SETUP}`)")
        return LlamaCppEngine(llama_cpp, Path(arguments.pop("gguf")), **arguments)
    raise ValueError(f"unknown engine kind {kind!r} (hybridlm, transformers or llama.cpp)")


class JsonLinesWorker:
    """A child process answering one JSON line on its stdout for each request line on its stdin; its other
    output goes to ``log``."""

    def __init__(self, command: list[str], env: dict, log: Path):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                            env=env, text=True)

    def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.process.args[1]} exited (code {self.process.wait()}); its output is in "
                               f"{self.log}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.process.args[1]} failed on {request.get('op')}: {answer['error']} (its "
                               f"output: {self.log})")
        return answer

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


class RemoteEngine(JsonLinesWorker):
    """:func:`build`'s engine for ``spec`` in ``engine_worker.py``, at ``threads`` threads: the measurements of
    :class:`SteppedEngine` (and ``log_probs`` and ``top_two_margin`` where its engine has them), each timed in
    the worker, so the pipe's cost is outside every figure."""

    def __init__(self, spec: dict, threads: int, label: str):
        worker = Path(__file__).with_name("engine_worker.py")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        super().__init__([sys.executable, str(worker), json.dumps(spec), str(threads)], env,
                         PEERS_DIR / f"worker-{label}.log")
        self._ask({"op": "ready"})

    def _call(self, op: str, *args):
        return self._ask({"op": op, "args": list(args)})["result"]

    def begin(self, rows: list[list[int]]) -> None:
        self._call("begin", rows)

    def decode_ms(self, warmup: int, steps: int) -> list[float]:
        return self._call("decode_ms", warmup, steps)

    def prefill_seconds(self, rows: list[list[int]]) -> float:
        return self._call("prefill_seconds", rows)

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        return self._call("greedy", prompt, new_tokens)

    def top_two_margin(self, prompt: list[int], tokens: list[int], index: int) -> float:
        return self._call("top_two_margin", prompt, tokens, index)

    def log_probs(self, row: list[int]) -> torch.Tensor:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "log_probs.safetensors"
            self._call("log_probs", row, str(path))
            return load_file(path)["log_probs"]


class VllmEngine(JsonLinesWorker):
    """``vllm_worker.py`` in the vLLM venv, one request at a time over its stdin/stdout (JSON lines)."""

    def __init__(self, directory: Path, dtype: str, threads: int, max_length: int, batch: int):
        worker = Path(__file__).with_name("vllm_worker.py")
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else "0-1",
                   VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(threads))
        # vLLM's own output, which is long, goes to the log
        super().__init__([str(VLLM_PYTHON), str(worker), str(directory), dtype, str(max_length), str(batch)], env,
                         PEERS_DIR / "vllm-worker.log")
        self._ask({"op": "ready"})

    def greedy(self, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        return self._ask({"op": "greedy", "rows": rows, "new_tokens": new_tokens})["tokens"]

    def timed(self, rows: list[list[int]], new_tokens: int) -> float:
        """Seconds for one ``generate`` of ``new_tokens`` greedy tokens after ``rows``."""
        return self._ask({"op": "timed", "rows": rows, "new_tokens": new_tokens})["seconds"]
