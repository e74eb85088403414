"""What one request may ask of the server, checked before any work is done on it (docs/security.md
"Limits"): both front doors (HTTP and the Celery task) check a parsed request here."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celerytp.core.protocol import MAX_STOP_CHARS
from celerytp.core.secrets import clipped
from celerytp.core.validation import bad_request


@dataclass(frozen=True)
class RequestLimits:
    """Args:
    schema_bytes: a `response_format` JSON schema, or all of a request's tool parameter schemas
        together, written as compact JSON (OpenAI caps a strict schema near this size: 5,000
        properties, 120,000 characters of names and values).
    stop_chars: each stop string (at most the wire's MAX_STOP_CHARS, core/protocol.py).
    """

    schema_bytes: int = 256 << 10
    stop_chars: int = 512

    def __post_init__(self) -> None:
        if self.schema_bytes < 1:
            raise ValueError(f"the schema limit (--max-schema-bytes, ${ENV['schema_bytes']}) must be >= 1, "
                             f"got {self.schema_bytes}")
        if not 1 <= self.stop_chars <= MAX_STOP_CHARS:
            raise ValueError(f"the stop string limit (--max-stop-chars, ${ENV['stop_chars']}) must be in "
                             f"1..{MAX_STOP_CHARS}, got {self.stop_chars}")

    def check(self, body: Any) -> None:
        """Refuse (400 naming the field) a parsed request over a limit."""
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        for i, stop in enumerate(stops):
            if len(stop) > self.stop_chars:
                raise bad_request(f"stop[{i}]" if isinstance(body.stop, list) else "stop",
                                  f"{len(stop)} characters; a stop string may have at most {self.stop_chars}")
        fmt = getattr(body, "response_format", None)
        if fmt is not None and fmt.json_schema is not None:
            self._check_schemas("response_format.json_schema.schema", [fmt.json_schema.schema_])
        tools = getattr(body, "tools", None) or []
        self._check_schemas("tools", [tool.function.parameters for tool in tools])

    def _check_schemas(self, field: str, schemas: list[Any]) -> None:
        try:
            size = sum(len(json.dumps(schema, separators=(",", ":"))) for schema in schemas)
        except RecursionError:
            raise bad_request(field, "nested too deeply") from None
        if size > self.schema_bytes:
            raise bad_request(field, f"{size} bytes of JSON schema; at most {self.schema_bytes} are taken "
                                     "(`celerytp serve --max-schema-bytes`)")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RequestLimits:
        """The limits $CELERYTP_MAX_SCHEMA_BYTES and $CELERYTP_MAX_STOP_CHARS set (defaults where unset);
        how `celerytp serve` hands its options to its Celery front door, and how a front door started
        by `celery -A celerytp.app worker` is configured."""
        values = {}
        for name, variable in ENV.items():
            text = env.get(variable, "").strip()
            if text:
                try:
                    values[name] = int(text)
                except ValueError:
                    raise ValueError(f"${variable} must be an integer, got {clipped(text)!r}") from None
        return cls(**values)

    def as_env(self) -> dict[str, str]:
        return {variable: str(getattr(self, name)) for name, variable in ENV.items()}


ENV = {"schema_bytes": "CELERYTP_MAX_SCHEMA_BYTES", "stop_chars": "CELERYTP_MAX_STOP_CHARS"}
