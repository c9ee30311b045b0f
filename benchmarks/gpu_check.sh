#!/usr/bin/env bash
# The GPU check of the kernels (see benchmarks/gpu_check.py, which does the work):
#
#   benchmarks/gpu_check.sh [--out DIR] [--dry-run] [--steps a,b] [--budget SECONDS]
#
# Puts the project on PYTHONPATH (installed or not) and runs $PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
