"""Where a worker keeps what it builds once per machine: compiled graphs and kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CELERYTP_CACHE_DIR"


def cache_dir() -> Path:
    """The worker's cache directory: CELERYTP_CACHE_DIR, else $XDG_CACHE_HOME/celerytp or ~/.cache/celerytp."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "celerytp"
