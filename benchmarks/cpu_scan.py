"""The recurrent scans on the CPU: the chunked references (``hybridlm/ops/ssd.py``'s SSD, ``selective_scan.py``'s
Mamba-1 scan, ``delta_rule.py``'s gated delta rule; backend ``torch``) against our C++ sequential scans (backend
``cpu``, ``hybridlm/ops/cpu_kernels.py``, the default where a C++ compiler exists). First the ops alone, at the
shapes of the peer models and of larger layers, then whole eager prefills: the bundled hybrid and the
``mamba2-lm-small`` preset (the models ``cpu_peers.py`` runs), and the Jamba and Qwen3-Next shapes of
``hf_speed.py`` (random weights).

The two backends take turns call by call (order reversed every other round) after a warm-up round; the script
prints min / median and the medians' ratio (torch / cpu: > 1, the C++ scan is faster).

    python benchmarks/cpu_scan.py [--threads 1 2] [--tokens 256 2048] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import hybridlm  # noqa: E402
from hybridlm import ops  # noqa: E402
from hybridlm.presets import preset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_speed  # noqa: E402

#: (name, heads, head_dim, dstate): the bundled hybrid's Mamba-2 layers, cpu_peers.py's Mamba-2 model, and a
#: mid-sized layer (Mamba-2 780M: 48 heads of 64, state 128)
SCAN_SHAPES = [("hybrid", 8, 32, 32), ("peer mamba2", 16, 32, 64), ("mamba2-780m layer", 48, 64, 128)]
#: (name, channels, dstate, groups) of Mamba-1 layers: hf_speed.py's Jamba shape, Mamba-130m, Mamba-1.4b
SELECTIVE_SHAPES = [("jamba shape", 512, 16, 1), ("mamba-130m layer", 1536, 16, 1), ("mamba-1.4b layer", 4096, 16, 1)]
#: (name, key heads, value heads, dim_k, dim_v) of gated delta rule layers: hf_speed.py's Qwen3-Next shape, and
#: Qwen3-Next-80B's (16 key and 32 value heads of 128)
DELTA_SHAPES = [("qwen3_next shape", 4, 8, 64, 64), ("qwen3-next-80b layer", 16, 32, 128, 128)]
BACKENDS = ("torch", "cpu")


def interleaved(call, rounds: int) -> dict[str, tuple[float, float]]:
    """backend -> (min, median) seconds of ``call()`` under ``use_backend(ssd_chunk_scan=backend)``."""
    times = {backend: [] for backend in BACKENDS}
    for round_ in range(rounds + 1):
        for backend in BACKENDS if round_ % 2 == 0 else reversed(BACKENDS):
            with ops.use_backend(ssd_chunk_scan=backend, selective_scan=backend, gated_delta_rule=backend):
                start = time.perf_counter()
                call()
                if round_:
                    times[backend].append(time.perf_counter() - start)
    return {backend: (min(t), statistics.median(t)) for backend, t in times.items()}


def report(head: str, times: dict) -> None:
    ratio = times["torch"][1] / times["cpu"][1]
    print(f"{head}: " + ", ".join(f"{backend} {t[0] * 1e3:.2f} / {t[1] * 1e3:.2f}" for backend, t in times.items())
          + f" ms min / median; torch / cpu x{ratio:.2f}", flush=True)


@torch.inference_mode()
def scan_call(tokens: int, heads: int, head_dim: int, dstate: int):
    g = torch.Generator().manual_seed(0)
    x, B, C = (torch.randn(1, tokens, *shape, generator=g) for shape in ((heads, head_dim), (1, dstate), (1, dstate)))
    dt, A = torch.rand(1, tokens, heads, generator=g) * 0.1, -torch.rand(heads, generator=g)
    D, state = torch.ones(heads), torch.zeros(1, heads, head_dim, dstate)
    return lambda: ops.ssd_chunk_scan(x, dt, A, B, C, 256, D=D, initial_state=state)


@torch.inference_mode()
def selective_call(tokens: int, channels: int, dstate: int, groups: int):
    g = torch.Generator().manual_seed(0)
    u, delta, z = (torch.randn(1, channels, tokens, generator=g) for _ in range(3))
    A = -torch.rand(channels, dstate, generator=g) * 4
    B, C = (torch.randn(1, groups, dstate, tokens, generator=g) for _ in range(2))
    D, bias, state = torch.ones(channels), torch.randn(channels, generator=g), torch.zeros(1, channels, dstate)
    return lambda: ops.selective_scan(u, delta, A, B, C, D, z, delta_bias=bias, delta_softplus=True,
                                      initial_state=state)


@torch.inference_mode()
def delta_call(tokens: int, key_heads: int, heads: int, dim_k: int, dim_v: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, tokens, key_heads, dim_k, generator=g)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, key_heads, dim_k, generator=g), dim=-1)
    v, beta = torch.randn(1, tokens, heads, dim_v, generator=g), torch.rand(1, tokens, heads, generator=g)
    log_gate = -torch.rand(1, tokens, heads, generator=g) * 0.1
    return lambda: ops.gated_delta_rule(q, k, v, log_gate, beta)


def models() -> dict[str, hybridlm.HybridForCausalLM]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        hf_speed.jamba().save_pretrained(directory)
        jamba = hybridlm.HybridForCausalLM.from_pretrained(directory)
    with tempfile.TemporaryDirectory() as directory:
        hf_speed.qwen3_next().save_pretrained(directory)
        qwen3_next = hybridlm.HybridForCausalLM.from_pretrained(directory)
    return {"bundled hybrid": hybridlm.HybridForCausalLM.from_pretrained(hybridlm.bundled_model_dir("hybrid")),
            "mamba2-lm-small": hybridlm.HybridForCausalLM(preset("mamba2-lm-small")), "jamba shape": jamba,
            "qwen3_next shape": qwen3_next}


def prefill_call(model: hybridlm.HybridForCausalLM, tokens: int):
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def call():
        cache = model.new_cache(1, max_length=tokens + 64, static=True)
        model(ids, cache=cache, logits_to_keep=1)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    reason = ops.backends.unavailable_reason("cpu", "selective_scan", "cpu")
    if reason is not None:
        sys.exit(f"the C++ CPU scan cannot run here: {reason}")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, heads, head_dim, dstate in SCAN_SHAPES:
            for tokens in args.tokens:
                report(f"{threads} thread(s), scan {name} ({heads} heads x {head_dim} x {dstate}), {tokens} tokens",
                       interleaved(scan_call(tokens, heads, head_dim, dstate), args.rounds))
        for name, channels, dstate, groups in SELECTIVE_SHAPES:
            for tokens in args.tokens:
                report(f"{threads} thread(s), selective scan {name} ({channels} channels x {dstate}), {tokens} tokens",
                       interleaved(selective_call(tokens, channels, dstate, groups), args.rounds))
        for name, key_heads, heads, dim_k, dim_v in DELTA_SHAPES:
            for tokens in args.tokens:
                report(f"{threads} thread(s), gated delta rule {name} ({key_heads}/{heads} heads x {dim_k} x {dim_v}), "
                       f"{tokens} tokens", interleaved(delta_call(tokens, key_heads, heads, dim_k, dim_v), args.rounds))
        for name, model in models().items():
            for tokens in args.tokens:
                report(f"{threads} thread(s), prefill {name}, {tokens} tokens",
                       interleaved(prefill_call(model.eval(), tokens), args.rounds))


if __name__ == "__main__":
    main()
