#!/usr/bin/env sh
# Rank worker entrypoint: every setting comes from the environment.
set -eu
: "${CELERYTP_RANK:?set CELERYTP_RANK}" "${CELERYTP_WORLD_SIZE:?set CELERYTP_WORLD_SIZE}"
exec celerytp worker \
  --rank "$CELERYTP_RANK" --world-size "$CELERYTP_WORLD_SIZE" \
  --group "${CELERYTP_GROUP:-default}" --broker "${CELERYTP_BROKER:-redis://redis:6379/0}" \
  --device "${CELERYTP_DEVICE:-auto}" ${CELERYTP_MODEL_ROOT:+--model-root "$CELERYTP_MODEL_ROOT"}
