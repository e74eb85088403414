#!/usr/bin/env bash
# The GPU measurements (benchmarks/gpu_bench.py): one device call of about five minutes.
#
#   bash scripts/gpu_bench.sh [--device cpu] [--budget-s 280] [--parts NAME ...]
#       Exit 0: every part ran; 1: a part failed (the table says which and why); 2 and 3 as
#       scripts/gpu_check.sh's.
#
# It runs where scripts/gpu_check.sh runs and as it does (the machine's own Python and CUDA torch,
# the wheels and model parts that `bash scripts/gpu_check.sh --prepare` puts in .gpu/ and
# .gpu-model/, carried to the machine); its SmolLM2 part also needs transformers there.
set -euo pipefail
GPU_SCRIPT=benchmarks/gpu_bench.py exec bash "$(dirname "$0")/gpu_check.sh" "$@"
