"""OpenAI-style error bodies and the HTTP status of each celerytp error kind."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.secrets import clipped, mask_secrets
from celerytp.server.service import error_code

# Kinds the client can act on get their own status; everything else is the server's fault (500).
STATUS: dict[ErrorKind, int] = {
    ErrorKind.BAD_REQUEST: 400,
    ErrorKind.UNSUPPORTED_ARCH: 400,  # the file is no model this server can run: the request's fault
    ErrorKind.MODEL_NOT_LOADED: 404,
    ErrorKind.LOAD_FAILED: 422,  # a well-formed load of a model file that cannot be loaded (corrupt, no tokenizer, ...)
    ErrorKind.ALREADY_LOADED: 409,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.RANK_LOST: 503,
    ErrorKind.NOT_INITIALISED: 503,
    ErrorKind.GROUP_BROKEN: 503,
    ErrorKind.DEVICE_UNAVAILABLE: 503,
    ErrorKind.BROKER_UNAVAILABLE: 503,
    ErrorKind.BROKER_AUTH_FAILED: 503,  # the server's broker URL is wrong, not the client's request
    ErrorKind.RETRIES_EXHAUSTED: 503,
    ErrorKind.TIMEOUT: 504,
}
# OpenAI's `type` for each status (its SDKs map status codes to exception classes).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable", 504: "timeout"}
_FIELD = re.compile(r"field '([^']+)'")
# An error message shows at most this many characters: values a caller sent are clipped where a
# message quotes them (core/secrets.py `clipped`); this bounds the rest (and the work on it).
MAX_MESSAGE = 2000
MAX_PARAM = 128
# Python's names for what went wrong inside, in messages that reach a caller: replaced by plain words.
_RECURSION = re.compile(r"RecursionError(?::[^;\n]*)?")
_OS_ERROR = re.compile(r"(?:OSError|IOError|FileNotFoundError|PermissionError|IsADirectoryError|NotADirectoryError)"
                       r"(?::\s*|\(\s*)?(?:\[Errno \d+\]\s*)?")


class HTTPProblem(Exception):
    """An HTTP error raised by the API itself (auth, routing), not by the ranks."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def shown(message: str) -> str:
    """A message as a caller sees it: URL passwords masked, Python's exception names in plain words,
    at most MAX_MESSAGE characters, encodable as UTF-8 (a lone surrogate it quotes is escaped).
    Masked before it is cut, so a cut never leaves part of a password unmasked; only its first
    8 * MAX_MESSAGE characters are read at all (the work stays bounded whatever a caller sent)."""
    text = mask_secrets(message[:8 * MAX_MESSAGE])
    text = _OS_ERROR.sub("", _RECURSION.sub("nested too deeply", text))
    return clipped(text, MAX_MESSAGE)


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": shown(message), "type": TYPES.get(status, "server_error"),
                      "param": None if param is None else clipped(param, MAX_PARAM), "code": code}}


def as_sent(exc: CeleryTPError, grammar_field: str | None) -> CeleryTPError:
    """`exc` naming the request field a caller wrote where it names the wire's `grammar` (made from
    `response_format` or `tools`, server/tools.py)."""
    if grammar_field and "field 'grammar'" in exc.message:
        return CeleryTPError(exc.kind, exc.message.replace("field 'grammar'", f"field '{grammar_field}'"), op=exc.op)
    return exc


def from_celerytp(exc: CeleryTPError, grammar_field: str | None = None) -> tuple[int, dict]:
    """Status and body of a celerytp error; a bad field is named in `param` (`grammar` as the
    field of the request it came from, `grammar_field`)."""
    exc = as_sent(exc, grammar_field)
    status = STATUS.get(exc.kind, 500)
    field = _FIELD.search(exc.message, 0, 8 * MAX_MESSAGE)
    code = error_code(exc.kind)  # the same kind the Celery front door names
    return status, error_body(status, exc.message, code, field.group(1) if field else None)


def celerytp_response(exc: CeleryTPError, grammar_field: str | None = None) -> JSONResponse:
    status, body = from_celerytp(exc, grammar_field)
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


def problem_response(exc: HTTPProblem) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param), status_code=exc.status, headers=headers)


# Codes of the API's own refusals (routing, validation), as OpenAI names them where it has a name.
CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def http_error_response(status: int, detail: object, headers: dict | None = None) -> JSONResponse:
    """A Starlette/FastAPI HTTPException (an unknown path, a wrong method, ...) in OpenAI's shape."""
    message = detail if isinstance(detail, str) else "request refused"
    if status == 404:
        message = "no such endpoint (see docs/serving.md for the supported ones)"
    return JSONResponse(error_body(status, message, CODES.get(status, f"http_{status}")), status_code=status,
                        headers=headers)


def validation_response(errors: list[dict]) -> JSONResponse:
    """FastAPI's RequestValidationError (path or query parameters) as one 400 naming the first field."""
    first = errors[0] if errors else {}
    location = [clipped(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = ".".join(location) or None
    message = f"field '{param}': {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid request"))
    return JSONResponse(error_body(400, message, str(ErrorKind.BAD_REQUEST), param), status_code=400)


def internal_response() -> JSONResponse:
    """Anything unexpected: a 500 in OpenAI's shape that says nothing about the server's insides."""
    message = "internal server error (the server log has the details)"
    return JSONResponse(error_body(500, message, str(ErrorKind.INTERNAL)), status_code=500)
