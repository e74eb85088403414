#!/usr/bin/env sh
# Container health: a rank worker (CELERYTP_RANK set) is healthy while its heartbeat key lives in
# Redis; anything else (the serve leader) while GET /health answers 200.
set -eu
if [ -n "${CELERYTP_RANK:-}" ]; then
  exec python -c "import os, redis, sys; sys.exit(0 if redis.Redis.from_url(os.environ['CELERYTP_BROKER'], \
socket_timeout=5).exists('celerytp:%s:rank:%s:owner' % (os.environ.get('CELERYTP_GROUP', 'default'), \
os.environ['CELERYTP_RANK'])) else 1)"
fi
exec python -c "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen( \
'http://127.0.0.1:${CELERYTP_PORT:-8000}/health', timeout=5).status == 200 else 1)"
