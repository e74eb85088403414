"""celerytp: tensor-parallel LLM inference driven by Celery."""

from celerytp.leader import CeleryTPError, Leader, RankFailure

__all__ = ["CeleryTPError", "Leader", "RankFailure"]
__version__ = "0.1.0"
