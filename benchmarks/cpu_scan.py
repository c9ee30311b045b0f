"""The recurrent scans and the short convolution on the CPU: the references (``hybridlm/ops/ssd.py``'s chunked
SSD, ``selective_scan.py``'s Mamba-1 scan, ``delta_rule.py``'s gated delta rule, ``causal_conv1d.py``'s
convolution; backend ``torch``) against our C++ kernels (backend ``cpu``, ``hybridlm/ops/cpu_kernels.py``, the
default where a C++ compiler exists). First the ops alone, at the shapes of the peer models and of larger layers,
then whole eager prefills: the bundled hybrid and the ``mamba2-lm-small`` preset (the models ``cpu_peers.py``
runs), and the Jamba and Qwen3-Next shapes of ``hf_speed.py`` (random weights), twice: every kernel against every
reference, then the convolution alone (the scans in C++ on both sides).

The two backends take turns call by call (order reversed every other round) after a warm-up round; the script
prints min / median and the medians' ratio (torch / cpu: > 1, the C++ kernel is faster).

    python benchmarks/cpu_scan.py [--threads 1 2] [--tokens 256 2048] [--rounds 15] [--parts scans conv prefill]
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
#: (name, channels, width) of short convolutions: the hybrid's and the peer Mamba-2's (x, B and C), the Jamba shape's
#: (Mamba-1: x alone), a Mamba-2 780M layer's
CONV_SHAPES = [("hybrid", 320, 4), ("peer mamba2", 640, 4), ("jamba shape", 512, 4), ("mamba2-780m layer", 3328, 4)]
BACKENDS = ("torch", "cpu")
KERNEL_OPS = ("ssd_chunk_scan", "selective_scan", "gated_delta_rule", "causal_conv1d")
PARTS = ("scans", "conv", "prefill")


def interleaved(call, rounds: int, switched: tuple[str, ...] = KERNEL_OPS) -> dict[str, tuple[float, float]]:
    """backend -> (min, median) seconds of ``call()`` with the ops ``switched`` on that backend (the others on
    their default)."""
    times = {backend: [] for backend in BACKENDS}
    for round_ in range(rounds + 1):
        for backend in BACKENDS if round_ % 2 == 0 else reversed(BACKENDS):
            with ops.use_backend(**dict.fromkeys(switched, backend)):
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


@torch.inference_mode()
def conv_call(tokens: int, channels: int, width: int):
    """The convolution as the mixers call it: x a time-major slice of a wider projection, a window, SiLU."""
    g = torch.Generator().manual_seed(0)
    projected = torch.randn(1, tokens, channels + 256, generator=g)
    x = projected[..., 128 : 128 + channels].transpose(1, 2)  # [1, channels, tokens], channels contiguous
    weight, bias = torch.randn(channels, width, generator=g), torch.randn(channels, generator=g)
    window = torch.randn(1, channels, width - 1, generator=g)
    return lambda: ops.causal_conv1d(x, weight, bias, initial_state=window, activation="silu")


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
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="the scans alone, the convolution alone, whole prefills")
    args = parser.parse_args()
    reason = ops.backends.unavailable_reason("cpu", "selective_scan", "cpu")
    if reason is not None:
        sys.exit(f"the C++ CPU kernels cannot run here: {reason}")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        if "scans" in args.parts:
            for name, heads, head_dim, dstate in SCAN_SHAPES:
                for tokens in args.tokens:
                    report(f"{threads} thread(s), scan {name} ({heads} heads x {head_dim} x {dstate}), {tokens} "
                           "tokens", interleaved(scan_call(tokens, heads, head_dim, dstate), args.rounds))
            for name, channels, dstate, groups in SELECTIVE_SHAPES:
                for tokens in args.tokens:
                    report(f"{threads} thread(s), selective scan {name} ({channels} channels x {dstate}), {tokens} "
                           "tokens", interleaved(selective_call(tokens, channels, dstate, groups), args.rounds))
            for name, key_heads, heads, dim_k, dim_v in DELTA_SHAPES:
                for tokens in args.tokens:
                    report(f"{threads} thread(s), gated delta rule {name} ({key_heads}/{heads} heads x {dim_k} x "
                           f"{dim_v}), {tokens} tokens",
                           interleaved(delta_call(tokens, key_heads, heads, dim_k, dim_v), args.rounds))
        if "conv" in args.parts:
            for name, channels, width in CONV_SHAPES:
                for tokens in args.tokens:
                    report(f"{threads} thread(s), conv {name} ({channels} channels x {width}), {tokens} tokens",
                           interleaved(conv_call(tokens, channels, width), args.rounds))
        if "prefill" in args.parts:
            for name, model in models().items():
                for tokens in args.tokens:
                    call = prefill_call(model.eval(), tokens)
                    report(f"{threads} thread(s), prefill {name}, {tokens} tokens", interleaved(call, args.rounds))
                    report(f"{threads} thread(s), prefill {name}, {tokens} tokens, the conv alone",
                           interleaved(call, args.rounds, ("causal_conv1d",)))

if __name__ == "__main__":
    main()
