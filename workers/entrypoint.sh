#!/usr/bin/env sh
# Rank worker entrypoint (systemd): every setting comes from the environment. The broker URL is
# read by `celerytp worker` from CELERYTP_BROKER itself, so its password never shows in `ps`.
set -eu
: "${CELERYTP_RANK:?set CELERYTP_RANK}" "${CELERYTP_WORLD_SIZE:?set CELERYTP_WORLD_SIZE}" "${CELERYTP_BROKER:?set CELERYTP_BROKER}"
exec celerytp worker \
  --rank "$CELERYTP_RANK" --world-size "$CELERYTP_WORLD_SIZE" \
  --device "${CELERYTP_DEVICE:-auto}" ${CELERYTP_MODEL_ROOT:+--model-root "$CELERYTP_MODEL_ROOT"}
