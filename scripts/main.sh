#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default: a private Redis and
# local rank workers, no configuration. Extra arguments go to `celerytp check`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/celerytp check "$@"
