"""OpenAI-style error bodies and the HTTP status of each celerytp error kind."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.secrets import mask_secrets

# Kinds the client can act on get their own status; everything else is the server's fault (500).
STATUS: dict[ErrorKind, int] = {
    ErrorKind.BAD_REQUEST: 400,
    ErrorKind.MODEL_NOT_LOADED: 404,
    ErrorKind.ALREADY_LOADED: 409,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.RANK_LOST: 503,
    ErrorKind.NOT_INITIALISED: 503,
    ErrorKind.GROUP_BROKEN: 503,
    ErrorKind.DEVICE_UNAVAILABLE: 503,
    ErrorKind.BROKER_UNAVAILABLE: 503,
    ErrorKind.RETRIES_EXHAUSTED: 503,
    ErrorKind.TIMEOUT: 504,
}
# OpenAI's `type` for each status (its SDKs map status codes to exception classes).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
         429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
_FIELD = re.compile(r"field '([^']+)'")


class HTTPProblem(Exception):
    """An HTTP error raised by the API itself (auth, routing), not by the ranks."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": mask_secrets(message), "type": TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def from_celerytp(exc: CeleryTPError) -> tuple[int, dict]:
    """Status and body of a celerytp error; a bad field is named in `param`."""
    status = STATUS.get(exc.kind, 500)
    field = _FIELD.search(exc.message)
    code = "model_not_found" if exc.kind is ErrorKind.MODEL_NOT_LOADED else str(exc.kind)
    return status, error_body(status, exc.message, code, field.group(1) if field else None)


def celerytp_response(exc: CeleryTPError) -> JSONResponse:
    status, body = from_celerytp(exc)
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


def problem_response(exc: HTTPProblem) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param), status_code=exc.status, headers=headers)
