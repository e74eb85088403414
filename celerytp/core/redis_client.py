"""Redis clients that ride out a broker outage, and the typed error when it lasts too long.

Every celerytp process reaches Redis through `connect`: a command that meets a refused or
dropped connection is retried (redis-py's own Retry, exponential backoff capped at
RETRY_CAP_S) for about `CELERYTP_BROKER_RETRY_S` seconds (default 30), so a Redis restart
delays callers instead of failing them. Past that window the caller gets
CeleryTPError(broker_unavailable), never a raw redis exception (`broker_errors`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from celerytp.core.errors import CeleryTPError, ErrorKind

RETRY_WINDOW_S = 30.0
RETRY_BASE_S = 0.02
RETRY_CAP_S = 0.5
SOCKET_TIMEOUT_S = 30.0  # a command (not a blocking read) waits at most this for its reply


def retry_window_s() -> float:
    value = os.environ.get("CELERYTP_BROKER_RETRY_S")
    return float(value) if value else RETRY_WINDOW_S


def retries_for(window_s: float) -> int:
    """How many retries of backoff RETRY_BASE_S doubling to RETRY_CAP_S add up to `window_s`."""
    retries, waited, pause = 0, 0.0, RETRY_BASE_S
    while waited < window_s:
        waited += pause
        pause = min(pause * 2, RETRY_CAP_S)
        retries += 1
    return retries


class RetryOutages(Retry):
    """redis-py's Retry, less a refused password: AuthenticationError is a ConnectionError to
    redis-py, but waiting does not fix a wrong password, so it fails at once."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[no-untyped-def]
        def retryable(error: Exception) -> bool:
            if isinstance(error, redis.AuthenticationError):
                return False
            return is_retryable(error) if is_retryable is not None else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


MIN_BLOCK_S = 0.01


def block_timeout(seconds: float) -> float:
    """A blocking command's timeout (BLPOP, BLMOVE) for a wait of `seconds` left: Redis reads it in
    whole milliseconds, and one under 1 ms becomes 0, which blocks forever, so never under 10 ms."""
    return max(seconds, MIN_BLOCK_S)


def connect(url: str, window_s: float | None = None) -> redis.Redis:
    """A client of the Redis at `url` that retries through an outage of `window_s` (default: the
    configured window)."""
    window = retry_window_s() if window_s is None else window_s
    return redis.Redis.from_url(
        url,
        retry=RetryOutages(ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), retries_for(window)),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_connect_timeout=5.0,
        socket_keepalive=True,
        socket_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=10,
    )


def unavailable(exc: redis.RedisError) -> CeleryTPError:
    if isinstance(exc, redis.AuthenticationError):  # not an outage: the URL's password (or user) is wrong
        return CeleryTPError(
            ErrorKind.BROKER_AUTH_FAILED, f"Redis refused the broker URL's credentials (authentication failed): {exc}"
        )
    return CeleryTPError(
        ErrorKind.BROKER_UNAVAILABLE, f"Redis is unreachable (retried for {retry_window_s():.0f}s): {type(exc).__name__}: {exc}"
    )


P = ParamSpec("P")
T = TypeVar("T")


def broker_errors(function: Callable[P, T]) -> Callable[P, T]:
    """A client method whose Redis failures reach its caller as CeleryTPError(broker_unavailable)."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return function(*args, **kwargs)
        except redis.RedisError as exc:
            raise unavailable(exc) from None

    return wrapper
