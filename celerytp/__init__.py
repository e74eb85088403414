"""celerytp: tensor-parallel LLM inference driven by Celery."""

from celerytp.client import Leader
from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure

__all__ = ["CeleryTPError", "ErrorKind", "Leader", "RankFailure"]
__version__ = "0.1.0"
