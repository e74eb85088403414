"""Settings of `celerytp serve`, checked before anything starts."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import redis

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.secrets import mask_secrets


def bad(message: str) -> CeleryTPError:
    return CeleryTPError(ErrorKind.BAD_REQUEST, message)


def positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise bad(f"{name} must be >= 1, got {value}")


def existing_model(path: str) -> str:
    """The absolute path of a model file or directory; "no such file" when it is missing."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise bad(f"no such file or directory: {path}")
    return str(resolved)


def reachable_broker(url: str, timeout_s: float = 3.0) -> None:
    """Ping the Redis at `url`; a refused, unknown or password-protected host says so (password masked)."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s).ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        raise bad(f"cannot reach the broker at {mask_secrets(url)}: {mask_secrets(str(exc))}") from None


def free_port(host: str, port: int) -> None:
    """Refuse a port another process holds now, rather than after the model loaded."""
    if not 1 <= port <= 65535:
        raise bad(f"--port must be in 1..65535, got {port}")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise bad(f"cannot listen on {host}:{port}: {exc.strerror}") from None


@dataclass(frozen=True)
class ServeConfig:
    """Args:
    model_path: model file or directory (absolute).
    model_id: the id clients name it by.
    tp: ranks (world size).
    host, port: where the HTTP API listens.
    broker: Redis URL of running rank workers; None: an embedded LocalCluster.
    group: the rank workers' group.
    api_key: Bearer key required on the API (None: open).
    quant, max_batch, max_context: load settings.
    frontend: also consume `celerytp.generate` tasks (the Celery front door).
    request_timeout: seconds a request may take before it is cancelled and answered 504.
    """

    model_path: str
    model_id: str
    tp: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    broker: str | None = None
    group: str = "default"
    api_key: str | None = None
    quant: str | None = None
    max_batch: int = 16
    max_context: int | None = None
    frontend: bool = True
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        positive("--tp", self.tp)
        positive("--max-batch", self.max_batch)
        positive("--max-context", self.max_context)
        if not self.request_timeout > 0:
            raise bad(f"--request-timeout must be > 0, got {self.request_timeout}")
        if not self.model_id:
            raise bad("--model-id must not be empty")

    def check_environment(self) -> None:
        """What can be refused before starting: the model file, the port, the broker."""
        if not os.path.exists(self.model_path):
            raise bad(f"no such file or directory: {self.model_path}")
        free_port(self.host, self.port)
        if self.broker:
            reachable_broker(self.broker)
