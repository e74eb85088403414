#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default: a private Redis and
# local rank workers, no configuration: SmolLM2-135M-Instruct answers at TP=2.
# Arguments replace the default question: any `celerytp generate` options.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- --prompt "What is tensor parallelism, in two sentences?" --tp 2 --max-tokens 96
fi
exec .venv/bin/celerytp generate "$@"
