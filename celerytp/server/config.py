"""Settings of `celerytp serve`, checked before anything starts."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.images import ImageLimits
from celerytp.core.secrets import mask_secrets
from celerytp.server.limits import RequestLimits


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
    except redis.AuthenticationError as exc:
        raise bad(f"the broker at {mask_secrets(url)} refused its password (authentication failed): "
                  f"{mask_secrets(str(exc))}") from None
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


def _checked_key(key: str, where: str) -> str:
    """A key as an Authorization header can carry it; the message never shows the key."""
    if not key.isascii() or not key.isprintable() or " " in key:
        raise bad(f"{where}: a key must be printable ASCII without spaces")
    return key


def keys_from_file(path: str, option: str) -> tuple[str, ...]:
    """The keys in a file, one a line (blank lines and `#` comments skipped)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise bad(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise bad(f"{option}: {path} is not UTF-8 text") from None
    lines = [line.strip() for line in text.splitlines()]
    keys = tuple(_checked_key(line, f"{option} {path}") for line in lines if line and not line.startswith("#"))
    if not keys:
        raise bad(f"{option}: {path} holds no key")
    return keys


def api_keys_from(key_file: str | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """The inference keys: --api-key-file, $CELERYTP_API_KEYS (comma-separated) and $CELERYTP_API_KEY
    together; none: the API is open."""
    keys = list(keys_from_file(key_file, "--api-key-file")) if key_file else []
    keys += [_checked_key(k.strip(), "$CELERYTP_API_KEYS") for k in env.get("CELERYTP_API_KEYS", "").split(",")
             if k.strip()]
    if env.get("CELERYTP_API_KEY", "").strip():
        keys.append(_checked_key(env["CELERYTP_API_KEY"].strip(), "$CELERYTP_API_KEY"))
    return tuple(dict.fromkeys(keys))


def admin_key_from(key_file: str | None, env: Mapping[str, str]) -> str | None:
    """The admin key: --admin-key-file (one key) or $CELERYTP_ADMIN_KEY; none: the admin endpoints are off."""
    return _one_key(key_file, env, "--admin-key-file", "CELERYTP_ADMIN_KEY")


def metrics_key_from(key_file: str | None, env: Mapping[str, str]) -> str | None:
    """The key of /metrics: --metrics-key-file (one key) or $CELERYTP_METRICS_KEY; none: /metrics is open."""
    return _one_key(key_file, env, "--metrics-key-file", "CELERYTP_METRICS_KEY")


def _one_key(key_file: str | None, env: Mapping[str, str], option: str, variable: str) -> str | None:
    if key_file:
        keys = keys_from_file(key_file, option)
        if len(keys) != 1:
            raise bad(f"{option}: {key_file} must hold exactly one key, found {len(keys)}")
        return keys[0]
    key = env.get(variable, "").strip()
    return _checked_key(key, f"${variable}") if key else None


@dataclass(frozen=True)
class ServeConfig:
    """Args:
    model_path: model file or directory (absolute).
    mmproj: llama.cpp's mmproj file of a gemma3 or qwen2vl .gguf model (absolute), or None.
    model_id: the id clients name it by.
    tp: ranks (world size).
    host, port: where the HTTP API listens.
    broker: Redis URL of running rank workers; None: an embedded LocalCluster.
    group: the rank workers' group.
    api_keys: Bearer keys, any one of which opens the API (empty: open).
    admin_key: Bearer key of the /admin endpoints and /health's details (None: the admin endpoints are off).
    metrics_key: Bearer key of /metrics (None: /metrics is open); the admin key opens it too.
    quant, max_batch, max_context, kv_memory_fraction: load settings.
    frontend: also consume `celerytp.generate` tasks (the Celery front door).
    request_timeout: seconds a request may take before it is cancelled and answered 504.
    payload_limit: the largest request body in bytes; a larger one is answered 413 before it is parsed.
    limits: what one request may ask otherwise (server/limits.py), on both front doors.
    images: a chat's images, on both front doors: the media domains whose image URLs are fetched
        (--allowed-media-domains; none: a remote image URL is refused) and the fetch timeout.
    device: the embedded cluster's worker --device (embedded_devices.py `embedded_device`).
    """

    model_path: str
    model_id: str
    mmproj: str | None = None
    tp: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    broker: str | None = None
    group: str = "default"
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_key: str | None = field(default=None, repr=False)
    metrics_key: str | None = field(default=None, repr=False)
    quant: str | None = None
    max_batch: int = 16
    max_context: int | None = None
    kv_memory_fraction: float | None = None
    frontend: bool = True
    request_timeout: float = 600.0
    device: str = "cpu"
    payload_limit: int = 4 << 20  # server/http.py DEFAULT_PAYLOAD_LIMIT
    limits: RequestLimits = field(default_factory=RequestLimits)
    images: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        positive("--tp", self.tp)
        positive("--max-batch", self.max_batch)
        positive("--max-context", self.max_context)
        positive("--payload-limit", self.payload_limit)
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise bad(f"--kv-memory-fraction must be within (0, 1], got {self.kv_memory_fraction}")
        if not self.request_timeout > 0:
            raise bad(f"--request-timeout must be > 0, got {self.request_timeout}")
        if not self.model_id:
            raise bad("--model-id must not be empty")
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise bad("the admin key must differ from every inference key")

    def check_environment(self) -> None:
        """What can be refused before starting: the model file, the port, the broker."""
        if not os.path.exists(self.model_path):
            raise bad(f"no such file or directory: {self.model_path}")
        free_port(self.host, self.port)
        if self.broker:
            reachable_broker(self.broker)
