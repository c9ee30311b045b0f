#!/usr/bin/env bash
# The GPU check of the kernels, for a CUDA machine (no network needed: it uses whatever is installed).
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu_check_out)
#
# 1. hybridlm's backend report for CUDA tensors            -> OUT_DIR/backends.txt
# 2. the kernel tests (tests/ops) with CUDA tensors         -> OUT_DIR/tests.log
#    (the Triton tests use the GPU when there is one; the CUDA extension is built by torch on first use)
# 3. kernel benchmarks against the torch reference and, where installed, mamba-ssm and flash-linear-attention
#                                                           -> OUT_DIR/benchmarks.md, OUT_DIR/benchmarks.json
# Exit status: 0 if the tests and the benchmarks ran through (targets missed are reported, not fatal), else 1;
# 2 if there is no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the project itself, installed or not
PYTHON="${PYTHON:-python3}"
python() { "$PYTHON" "$@"; }
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
unset TRITON_INTERPRET  # the Triton kernels must compile for the GPU, not run in the interpreter
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda  # where torch's extension builder finds nvcc and the CUDA headers
fi

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to torch: nothing to check" | tee "$out/backends.txt"
    exit 2
fi
python - <<'EOF' | tee "$out/backends.txt"
import importlib.util, torch
print(f"{torch.cuda.get_device_name()}, compute capability {torch.cuda.get_device_capability()}, "
      f"torch {torch.__version__} (CUDA {torch.version.cuda})")
for name in ("triton", "mamba_ssm", "causal_conv1d", "flash_attn", "fla", "ninja"):
    print(f"  {name}: {'installed' if importlib.util.find_spec(name) else 'not installed (skipped)'}")
print()
from hybridlm.ops import backends
print(backends.report("cuda"))
EOF

status=0
echo "== kernel tests on the GPU (tests/ops) =="
python -m pytest tests/ops -q -rs -p no:cacheprovider 2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "kernel tests FAILED (see $out/tests.log)"; status=1; }

echo "== kernel benchmarks =="
python benchmarks/gpu_kernels.py --out "$out" || { echo "benchmarks FAILED"; status=1; }
exit $status
