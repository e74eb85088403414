"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
admin model management, /health and /metrics.

Leader calls block, so they run in the thread pool; while one runs, the request's connection is
watched and a client that goes away has its generation cancelled on the ranks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from celerytp.client.generation import GenerationResult, Piece, TokenStream
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.fim import fim_form
from celerytp.core.secrets import clipped
from celerytp.core.tokenizer import load_tokenizer
from celerytp.server import responses, tools
from celerytp.server.errors import (
    HTTPProblem,
    celerytp_response,
    error_body,
    from_celerytp,
    http_error_response,
    internal_response,
    problem_response,
    validation_response,
)
from celerytp.server.logprobs import Decode, chat_logprobs, completion_logprobs, echoed_logprobs, text_length
from celerytp.server.openapi import admin_load_schema, with_request_bodies
from celerytp.server.responses import ResponsesRequest
from celerytp.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    StreamOptions,
    TokenizeRequest,
    parse,
)
from celerytp.server.service import Service

DISCONNECT_POLL_S = 0.1
ABANDONED_END_S = 10.0  # how long an abandoned stream's cancelled end is awaited, to count it
SEEDS = 1 << 63  # a seed is in 0..2**63-1 (core/sampling.py): choice i's seed wraps around
# The largest request body read (`celerytp serve --payload-limit`, bytes; TGI's option of the same
# name defaults to 2 MB): a larger one is answered 413 before it is read whole or parsed.
DEFAULT_PAYLOAD_LIMIT = 4 << 20
_END = object()


def create_app(service: Service, api_keys: str | Sequence[str] | None = None, admin_key: str | None = None,
               payload_limit: int = DEFAULT_PAYLOAD_LIMIT, metrics_key: str | None = None) -> FastAPI:
    """The API over `service`. With `api_keys` (one key or several), every endpoint but /health and
    /metrics wants `Authorization: Bearer <one of them>`; the /admin endpoints want `admin_key`
    (never an inference key) and do not exist without one. /health details need `admin_key` too.
    A request body over `payload_limit` bytes is answered 413 before it is parsed. With `metrics_key`,
    /metrics wants it (or the admin key)."""
    # No docs pages; the schema is an endpoint like the others (behind the key, below). A trailing
    # slash is a path like any other: no redirect that would answer a real route before the key.
    app = FastAPI(title="celerytp", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    metrics = service.metrics
    keys = (api_keys,) if isinstance(api_keys, str) else tuple(api_keys or ())
    inference = [f"Bearer {key}".encode() for key in keys if key]
    admin = [f"Bearer {admin_key}".encode()] if admin_key else []
    scraper = [f"Bearer {metrics_key}".encode(), *admin] if metrics_key else []
    enable_access_log()

    def authorised(request: Request) -> None:
        if inference and not bearer_in(request, inference):
            raise HTTPProblem(401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key")

    def administrator(request: Request) -> None:
        if not admin:  # no admin key configured: the admin endpoints are off
            raise StarletteHTTPException(404)
        if not bearer_in(request, admin):
            raise HTTPProblem(401, "missing or wrong admin key (Authorization: Bearer <admin key>; the inference "
                              "keys do not open /admin)", "invalid_api_key")

    auth = [Depends(authorised)]
    admin_auth = [Depends(administrator)]

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths and wrong methods: after the key check, so an unauthenticated caller learns
        nothing about which endpoints exist (401 first)."""
        path = request.url.path
        if exc.status_code in (404, 405) and path not in PUBLIC_PATHS:
            needed = admin if path.startswith("/admin") else inference
            if needed and not bearer_in(request, needed):
                return problem_response(HTTPProblem(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                                    "invalid_api_key"))
        return http_error_response(exc.status_code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(list(exc.errors()))

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        return celerytp_response(CeleryTPError(ErrorKind.BAD_REQUEST, "field 'body': nested too deeply"))

    @app.exception_handler(CeleryTPError)
    async def _celerytp_error(request: Request, exc: CeleryTPError) -> JSONResponse:
        return celerytp_response(exc, getattr(request.state, "grammar_field", None))

    @app.exception_handler(HTTPProblem)
    async def _problem(request: Request, exc: HTTPProblem) -> JSONResponse:
        return problem_response(exc)

    if metrics is not None:
        app.add_middleware(RequestCounter, metrics=metrics)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Up or down for anyone; the ranks' hosts, pids and devices only with the admin key."""
        report = await run_in_threadpool(service.health)
        status = 200 if report["ok"] else 503
        if admin and bearer_in(request, admin):
            return JSONResponse(report, status_code=status)
        return JSONResponse({"ok": report["ok"], "status": "up" if report["ok"] else "down"}, status_code=status)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if scraper and not bearer_in(request, scraper):
            raise HTTPProblem(401, "missing or wrong metrics key (Authorization: Bearer <metrics key>)",
                              "invalid_api_key")
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi_schema() -> dict:
        """The OpenAPI schema, for key holders; the /admin routes only where admin is on."""
        if app.openapi_schema is None:
            app.openapi_schema = with_request_bodies(app.openapi(), admin_load_schema(ADMIN_INTS, ADMIN_STRINGS))
        schema = app.openapi_schema
        if admin:
            return schema
        return {**schema, "paths": {p: v for p, v in schema["paths"].items() if not p.startswith("/admin")}}

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict:
        models = await run_in_threadpool(service.loaded)
        return {"object": "list", "data": [model_card(m, r, bool(inference)) for m, r in sorted(models.items())]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str) -> dict:
        models = await run_in_threadpool(service.models)
        if model_id not in models:
            raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED,
                                f"model {clipped(model_id)!r} is not loaded; loaded: {sorted(models)}")
        return model_card(model_id, models[model_id], bool(inference))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await json_body(request))
        return await answer(request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatRequest, await json_body(request))
        return await answer(request, body, chat=True)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict:
        body = parse(TokenizeRequest, await json_body(request))
        model_id = await run_in_threadpool(service.resolve, body.model)
        messages = None if body.messages is None else [m.as_dict() for m in body.messages]
        return await run_in_threadpool(service.tokenize, model_id, body.prompt, messages)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict:
        body = parse(DetokenizeRequest, await json_body(request))
        model_id = await run_in_threadpool(service.resolve, body.model)
        return await run_in_threadpool(service.detokenize, model_id, body.tokens)

    @app.post("/admin/models", dependencies=admin_auth)
    async def load_model(request: Request) -> dict:
        model_id, path, options = load_fields(await json_body(request))
        started = time.perf_counter()
        await run_in_threadpool(service.leader.load, model_id, path, **options)
        if metrics is not None:
            metrics.chord_latency.labels("load").observe(time.perf_counter() - started)
        return model_card(model_id, (await run_in_threadpool(service.models))[model_id], True)

    @app.delete("/admin/models/{model_id:path}", dependencies=admin_auth)
    async def unload_model(model_id: str) -> dict:
        await run_in_threadpool(service.resolve, model_id)
        started = time.perf_counter()
        await run_in_threadpool(service.leader.unload, model_id)
        if metrics is not None:
            metrics.chord_latency.labels("unload").observe(time.perf_counter() - started)
        return {"id": model_id, "object": "model", "deleted": True}

    async def begin(request: Request, body: SamplingFields, chat: bool) -> tuple[Shape, list[dict[str, Any]]]:
        """What a request will run: its response's shape (model, tools, echo) and the leader
        options of each of its rows (choices, and prompts of a completion batch)."""
        service.limits.check(body)
        model_id = await run_in_threadpool(service.resolve, body.model)
        if isinstance(body, CompletionRequest) and body.suffix:
            body = await run_in_threadpool(filled_in, service, model_id, body)
        request_id = uuid.uuid4().hex
        options = {**body.options(), "request_id": request_id}
        decode = await run_in_threadpool(service.decoder, model_id) if options.get("logprobs") else None
        mode = await run_in_threadpool(tools.apply, service, model_id, body, options)  # structured output
        shape = (StreamedCalls if body.stream and mode else Shape)(chat, model_id, request_id, top_logprobs(body), decode)
        shape.tools = mode
        shape.grammar_field = request.state.grammar_field = tools.grammar_field(mode, options)
        prompts = body.prompts if isinstance(body, CompletionRequest) else [None]
        rows = [row for i, prompt in enumerate(prompts) for row in choice_options(
            options if prompt is None else prompt_options(options, prompt, i, len(prompts)), body.n)]
        shape.n = body.n
        if isinstance(body, CompletionRequest) and body.echo:
            texts = await run_in_threadpool(echo_texts, service, model_id, prompts)
            shape.echoes = [text for text in texts for _ in range(body.n)]
        shape.scores_only = isinstance(body, CompletionRequest) and body.scores_only
        return shape, rows

    async def answer(request: Request, body: SamplingFields, chat: bool) -> Response:
        shape, rows = await begin(request, body, chat)
        if body.stream:
            streams = await run_in_threadpool(open_streams, service, shape.model_id, rows)  # a bad request fails here
            events = sse(service, request, streams, shape, body.stream_options)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results = await generate_choices(request, service, shape.model_id, rows)
        return JSONResponse(shape.complete(*results))

    @app.post("/v1/responses", dependencies=auth)
    async def create_response(request: Request) -> Response:
        body = parse(ResponsesRequest, await json_body(request))
        history = await run_in_threadpool(responses.history, service, body.previous_response_id)
        earlier = len(history) + bool(body.instructions)  # the chat's messages before input's
        try:
            shape, rows = await begin(request, responses.as_chat(body, history), chat=True)
        except CeleryTPError as exc:
            raise responses.renamed(exc, earlier) from None
        if shape.grammar_field == "response_format":  # an error about the grammar names the field as written
            shape.grammar_field = request.state.grammar_field = "text.format"
        answer = responses.Answer(body, shape.model_id, history, shape.tools)
        try:  # a request refused as it is tokenized (its images checked) names the fields as written too
            if body.stream and shape.tools is None:  # text streams as it comes; tool calls are decided at the end
                stream = await run_in_threadpool(service.stream, shape.model_id, rows[0])
            else:
                result = (await generate_choices(request, service, shape.model_id, rows))[0]
        except CeleryTPError as exc:
            raise responses.renamed(exc, earlier) if exc.kind == ErrorKind.BAD_REQUEST else exc from None
        if body.stream and shape.tools is None:
            events = responses.text_events(answer, stream, request, service)
        else:
            if not body.stream:
                return JSONResponse(await run_in_threadpool(answer.finish, service, result))
            events = responses.whole_events(answer, result, service)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    app.add_middleware(BodyLimit, limit=payload_limit)
    app.add_middleware(RequestContext)  # added last: outermost, so it sees (and shapes) every response
    return app


PUBLIC_PATHS = ("/health", "/metrics")
ACCESS = logging.getLogger("celerytp.access")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def bearer_in(request: Request, expected: list[bytes]) -> bool:
    """Whether the request's Authorization header is one of `expected` ("Bearer <key>"; the scheme
    in any case, as RFC 9110 has it), compared in constant time against every one (no early exit
    that would tell which key came close)."""
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    given = (f"Bearer {credentials}" if scheme.lower() == "bearer" else scheme + credentials).encode()
    found = False
    for candidate in expected:
        found |= hmac.compare_digest(given, candidate)
    return found


def enable_access_log() -> None:
    """One line per request on stderr (uvicorn's own access log is off: it runs at warning)."""
    if not ACCESS.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s access: %(message)s"))
        ACCESS.addHandler(handler)
        ACCESS.setLevel(logging.INFO)
        ACCESS.propagate = False


def request_id_of(scope: dict) -> str:
    """The caller's X-Request-Id when it is short and of safe characters, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _REQUEST_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class RequestContext:
    """Per request: an id (the caller's `X-Request-Id`, or a new one) echoed in the response's
    `X-Request-Id`, one access-log line (method, path, status, ms, id; never a header or a key), and
    a 500 in OpenAI's shape for anything unexpected. Plain ASGI, like RequestCounter, so the
    client's disconnect stays visible to the endpoints."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        started, status = time.perf_counter(), [0]

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - answered here, in OpenAI's shape, and logged
            logging.getLogger(__name__).exception("unexpected error in %s %s (request %s)", scope.get("method"),
                                                  printable(scope.get("path", "")), request_id)
            if not status[0]:  # nothing sent yet (after that, the connection just ends)
                await internal_response()(scope, receive, send_with_id)
        finally:
            ACCESS.info("%s %s %s %.1fms request_id=%s", scope.get("method"), printable(scope.get("path", "")),
                        status[0] or 500, (time.perf_counter() - started) * 1000, request_id)


class BodyLimit:
    """Reads a request's body before anything parses it, at most `limit` bytes: a larger one (by
    its Content-Length, or as it arrives) is answered 413 in OpenAI's shape, unread beyond the
    limit. The body read is handed on in one piece; later reads (a disconnect) go to the client."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                return await self.refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self.refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, handed = b"".join(chunks), [False]

        async def replay() -> dict:
            if not handed[0]:
                handed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = (f"request body larger than {self.limit} bytes (the server's limit, celerytp serve "
                   "--payload-limit)")
        response = JSONResponse(error_body(413, message, "request_too_large"), status_code=413,
                                headers={"Connection": "close"})
        await response(scope, receive, send)


def printable(path: str) -> str:
    """A path as one log line shows it: control characters escaped, at most 200 characters."""
    return json.dumps(path[:200])[1:-1]


ADMIN_INTS = {"max_batch": 1 << 16, "max_context": 1 << 24, "max_queue": 1 << 20}
ADMIN_STRINGS = ("quant", "dtype")


def load_fields(body: Any) -> tuple[str, str | None, dict[str, Any]]:
    """The model id, path and load options of an admin load, every field type-checked (400 naming it)."""

    def bad(field: str, why: str) -> CeleryTPError:
        return CeleryTPError(ErrorKind.BAD_REQUEST, f"field '{field}': {why}")

    if not isinstance(body, dict):
        raise bad("body", "a JSON object is required")
    unknown = sorted(set(body) - {"model", "path", *ADMIN_INTS, *ADMIN_STRINGS})
    if unknown:
        raise bad(clipped(unknown[0]), f"unknown field; accepted: model, path, {', '.join([*ADMIN_INTS, *ADMIN_STRINGS])}")
    model_id, path = body.get("model"), body.get("path")
    if not isinstance(model_id, str) or not model_id.strip():
        raise bad("model", "a non-empty string is required")
    if len(model_id) > 256 or not model_id.isprintable():
        raise bad("model", "at most 256 printable characters")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise bad("path", f"a non-empty string is required, got {type(path).__name__}")
        if "\x00" in path or len(path) > 4096:
            raise bad("path", "no NUL bytes, at most 4096 characters")
        if any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in path.split("/")):
            raise bad("path", "a file or directory name is at most 255 bytes")
        if not path.startswith("/"):  # made absolute on this host, a refusal would show its working directory
            raise bad("path", "an absolute path is required (under the server's model roots)")
    options: dict[str, Any] = {}
    for name, limit in ADMIN_INTS.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise bad(name, f"an integer in 1..{limit} is required, got {json.dumps(value)[:40]}")
        options[name] = value
    for name in ADMIN_STRINGS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value or len(value) > 32:
            raise bad(name, f"a non-empty string of at most 32 characters is required, got {json.dumps(value)[:40]}")
        options[name] = value
    return model_id, path, options


class RequestCounter:
    """Counts responses by route and status. Plain ASGI on purpose: Starlette's BaseHTTPMiddleware
    (`app.middleware("http")`) hides the client's disconnect, so `request.is_disconnected()` never
    turned true and a non-streaming request whose client left kept decoding."""

    def __init__(self, app: Any, metrics: Any):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            # The router writes the matched route into the same scope. A refused or unknown request
            # counts as unmatched, so an anonymous caller cannot map the routes through /metrics.
            route = scope.get("route") if status[0] not in (401, 404) else None
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status[0])).inc()


async def json_body(request: Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'body': not valid JSON ({exc})") from None
    except RecursionError:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'body': JSON nested too deeply") from None


async def until_disconnected(request: Request, work: Awaitable[Any], on_disconnect: Callable[[], None]) -> Any:
    """Await `work`; if the client goes away first, call `on_disconnect` (it ends the work) and
    still wait for the work to end."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            await run_in_threadpool(on_disconnect)
            break
    return await task


def prompt_options(options: dict[str, Any], prompt: str | list[int], index: int, prompts: int) -> dict[str, Any]:
    """The leader options of prompt `index` of a completion's `prompts`."""
    request_id = options["request_id"] if prompts == 1 else f"{options['request_id']}-p{index}"
    return {**options, "prompt": prompt, "request_id": request_id}


def filled_in(service: Service, model_id: str, body: CompletionRequest) -> CompletionRequest:
    """The completion with each prompt and its `suffix` as the model's fill-in-the-middle prompt
    (core/fim.py): what the model writes is the middle. A model without the tokens refuses it."""
    form = fim_form(load_tokenizer(service.models()[model_id]["path"]))
    if form is None:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'suffix': model {model_id!r} has no fill-in-the-middle "
                                                   "tokens in its vocabulary; leave suffix out")
    prompts = [form.prompt(prompt, body.suffix) for prompt in body.prompts]  # text prompts: schemas.py checked
    return body.model_copy(update={"prompt": prompts[0] if isinstance(body.prompt, str) else prompts, "suffix": None})


def echo_texts(service: Service, model_id: str, prompts: list[str | list[int]]) -> list[str]:
    """Each prompt as a completion with `echo` starts its text: as sent, or token ids decoded."""
    if all(isinstance(prompt, str) for prompt in prompts):
        return list(prompts)
    decode = service.decoder(model_id)
    return [prompt if isinstance(prompt, str) else decode(prompt) for prompt in prompts]


def choice_options(options: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The leader options of each of `n` choices: request ids derived from the response's, and
    with a seed, choice i seeded seed + i (so choice 0 is the n=1 request, and all reproducible)."""
    if n == 1:
        return [options]
    seed = options.get("seed")
    return [{**options, "request_id": f"{options['request_id']}-{i}",
             "seed": None if seed is None else (seed + i) % SEEDS} for i in range(n)]


async def generate_choices(request: Request, service: Service, model_id: str,
                           rows: list[dict[str, Any]]) -> list[GenerationResult]:
    """Every choice's result, run side by side; all are cancelled if the client goes away or one fails."""
    def cancel_all() -> None:
        for row in rows:
            service.leader.cancel(row["request_id"])

    work = asyncio.gather(*(run_in_threadpool(service.generate, model_id, row) for row in rows))
    try:
        return await until_disconnected(request, work, cancel_all)
    except CeleryTPError:
        if len(rows) > 1:
            await run_in_threadpool(cancel_all)
        raise


def open_streams(service: Service, model_id: str, rows: list[dict[str, Any]]) -> list[TokenStream]:
    """A stream per choice; if one cannot be queued, the ones already queued are cancelled."""
    streams: list[TokenStream] = []
    try:
        for row in rows:
            streams.append(service.stream(model_id, row))
    except Exception:
        for stream in streams:
            stream.close()
        raise
    return streams


def pump(stream: TokenStream, index: int, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    """In its own thread: move a TokenStream's pieces (then _END, or the error) onto `queue` as
    (choice index, item), so the event loop is woken once per token instead of handing each
    token across threads."""
    try:
        for piece in stream.pieces():
            loop.call_soon_threadsafe(queue.put_nowait, (index, piece))
        loop.call_soon_threadsafe(queue.put_nowait, (index, _END))
    except RuntimeError:  # the event loop closed: the server is stopping
        pass
    except Exception as exc:  # noqa: BLE001 - handed to the event loop, which answers it
        loop.call_soon_threadsafe(queue.put_nowait, (index, exc))


async def sse(service: Service, request: Request, streams: list[TokenStream], shape: Shape,
              options: StreamOptions | None) -> AsyncIterator[str]:
    """Server-sent events of the choices' TokenStreams, in OpenAI's chunk format, the choices'
    chunks interleaved as their tokens come; cancels every running choice on disconnect or error."""
    include_usage = bool(options and options.include_usage)
    sent = [0] * len(streams)  # each choice's tokens sent so far

    def counted(chunk: dict, index: int) -> dict:
        if include_usage and options.continuous_usage_stats:  # vLLM's: every chunk with its usage so far
            chunk["usage"] = {"prompt_tokens": streams[index].prompt_tokens, "completion_tokens": sent[index],
                              "total_tokens": streams[index].prompt_tokens + sent[index]}
        return chunk

    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    pumps = [threading.Thread(target=pump, args=(s, i, loop, queue), daemon=True) for i, s in enumerate(streams)]
    for pumping in pumps:
        pumping.start()
    running, checked = set(range(len(streams))), time.monotonic()
    try:
        opening = "".join(event(counted(chunk, i)) for i in sorted(running) for chunk in shape.opening(i))
        if opening:
            yield opening
        while running:
            try:
                items = [await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)]
            except TimeoutError:
                items = []
            if time.monotonic() - checked > DISCONNECT_POLL_S:  # tokens may never leave a gap to check in
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            while not queue.empty():  # whatever else arrived meanwhile goes out in one write
                items.append(queue.get_nowait())
            out = []
            for index, item in items:
                if isinstance(item, Exception):
                    running.discard(index)  # it ended, with its error
                    raise item
                if item is _END:
                    running.discard(index)
                    result = streams[index].result
                    await run_in_threadpool(service.count, shape.model_id, result)  # a Redis write (metrics)
                    sent[index] = result.completion_tokens
                    out.append(event(counted(shape.chunk("", finish_reason(result), index), index)))
                elif item.text or item.logprobs:
                    sent[index] += len(item.token_ids)
                    out.append(event(counted(shape.piece(item, index), index)))
            if out:
                yield "".join(out)
        if include_usage:
            yield event({**shape.chunk("", None), "choices": [], "usage": shape.usage([s.result for s in streams])})
        yield "data: [DONE]\n\n"
    except CeleryTPError as exc:
        await run_in_threadpool(service.count_error, shape.model_id, exc)
        yield event(from_celerytp(exc, shape.grammar_field)[1])
        yield "data: [DONE]\n\n"
    finally:
        if running:  # the client went away, a choice failed or the server is stopping: free the rows
            left = [(streams[i], pumps[i]) for i in sorted(running)]
            await asyncio.shield(run_in_threadpool(abandon, service, left, shape.model_id))


def abandon(service: Service, rows: list[tuple[TokenStream, threading.Thread]], model_id: str) -> None:
    """Cancel streams nobody reads any more, then count each one's end (cancelled, or whatever it
    reached first) once its pump has read it."""
    for stream, _ in rows:
        service.leader.cancel(stream.request_id)
    for stream, pumping in rows:
        pumping.join(ABANDONED_END_S)
        if stream.result is not None:
            service.count(model_id, stream.result)


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def prompt_only(result: GenerationResult) -> GenerationResult:
    """A completion's result with what was generated dropped (max_tokens 0: the prompt scored only)."""
    return dataclasses.replace(result, text="", token_ids=[], finish_reason="length",
                               logprobs=None if result.logprobs is None else [])


def usage(*results: GenerationResult) -> dict[str, int]:
    """The choices of one prompt: the prompt counted once, every choice's tokens."""
    prompt, completion = results[0].prompt_tokens, sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def top_logprobs(body: SamplingFields) -> int:
    """How many alternatives per token the response lists."""
    if isinstance(body, ChatRequest):
        return body.top_logprobs or 0
    return getattr(body, "logprobs", None) or 0


def model_card(model_id: str, record: dict, authenticated: bool = False) -> dict:
    """A /v1/models entry, with vLLM's `max_model_len` and `root`: the model's path for a caller who
    presented a key (tools find the tokenizer there), the model id on a server without keys."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "celerytp",
            "root": record.get("path", model_id) if authenticated else model_id, "parent": None,
            "max_model_len": record.get("max_context"),
            "max_context": record.get("max_context"), "max_batch": record.get("max_batch"),
            "replicas": sorted(record.get("replicas", {}))}  # the groups serving it behind its one queue


class Shape:
    """OpenAI's response and chunk objects for one request (chat or text completion)."""

    def __init__(self, chat: bool, model_id: str, request_id: str, top_n: int = 0, decode: Decode | None = None):
        self.chat, self.model_id, self.request_id = chat, model_id, request_id
        self.top_n, self.decode = top_n, decode
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.tools: tools.ToolMode | None = None  # a chat with tools: its answer may be tool calls
        self.echoes: list[str] = []  # a completion with `echo`: per choice, the prompt its text starts with
        self.n = 1  # choices per prompt (a completion may have several prompts)
        self.scores_only = False  # a completion with max_tokens 0: the prompt echoed, the one token run dropped
        self.grammar_field: str | None = None  # the request field its grammar came from (errors name it)
        self._offsets: dict[int, int] = {}  # a streamed completion's text_offset so far, per choice

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    def complete(self, *results: GenerationResult) -> dict:
        """The response of one or more choices (the results in choice order: n per prompt)."""
        obj = "chat.completion" if self.chat else "text_completion"
        if self.scores_only:
            results = tuple(prompt_only(result) for result in results)
        choices = [self._choice(result, index) for index, result in enumerate(results)]
        return {**self._head(obj), "choices": choices, "usage": self.usage(results)}

    def usage(self, results: Sequence[GenerationResult]) -> dict[str, int]:
        """Each prompt counted once (its n choices share it), every choice's tokens."""
        counts = [usage(*results[i : i + self.n]) for i in range(0, len(results), self.n)]
        return {key: sum(count[key] for count in counts) for key in counts[0]}

    def echo(self, index: int) -> str:
        return self.echoes[index] if self.echoes else ""

    def _choice(self, result: GenerationResult, index: int) -> dict:
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": result.text}}
        else:
            choice = {"index": index, "text": self.echo(index) + result.text}
        logprobs = None
        if self.decode is not None and self.chat:
            logprobs = chat_logprobs(result, self.decode, self.top_n)
        elif self.decode is not None:
            logprobs = echoed_logprobs(result, self.decode, self.top_n, self.echo(index))
        choice.update(logprobs=logprobs, finish_reason=finish_reason(result))
        content, calls = self.tools.answer(result.text) if self.chat and self.tools is not None else (None, None)
        if calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            choice["finish_reason"] = tools.finish(choice["finish_reason"], True)
        return choice

    def chunk(self, delta: str | dict, reason: str | None, index: int = 0, logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": index,
                      "delta": delta if isinstance(delta, dict) else ({"content": delta} if delta else {})}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": index, "text": delta}, "text_completion"
        choice.update(logprobs=logprobs, finish_reason=reason)
        return {**self._head(obj), "choices": [choice]}

    def opening(self, index: int) -> list[dict]:
        """What a streamed choice starts with: a chat's role; a completion's echoed prompt."""
        if self.chat:
            return [self.chunk({"role": "assistant", "content": ""}, None, index)]
        return [self.chunk(self.echo(index), None, index)] if self.echo(index) else []

    def piece(self, piece: Piece, index: int) -> dict:
        """The chunk of a streamed delta, with the logprobs of the tokens whose text it carries."""
        if self.decode is None or piece.logprobs is None:
            return self.chunk(piece.text, None, index)
        if self.chat:
            return self.chunk(piece.text, None, index, chat_logprobs(piece, self.decode, self.top_n))
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + text_length(piece, self.decode)
        return self.chunk(piece.text, None, index, completion_logprobs(piece, self.decode, self.top_n, offset))


class StreamedCalls(Shape):
    """A streamed chat with tools: each choice's text goes through a tools.CallStream, so content
    streams until the model starts a call and the calls stream as OpenAI streams them (the first
    chunk of a call names it, the next ones carry its arguments); the end flushes what was held
    back and says "tool_calls"."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._calls: dict[int, tools.CallStream] = {}

    def _stream(self, index: int) -> tools.CallStream:
        assert self.tools is not None
        return self._calls.setdefault(index, tools.CallStream(self.tools))

    def piece(self, piece: Piece, index: int) -> dict:
        chunk = super().piece(piece, index)  # the logprobs as without tools; the text read for calls
        chunk["choices"][0]["delta"] = self._stream(index).feed(piece.text)
        return chunk

    def chunk(self, delta: str | dict, reason: str | None, index: int = 0, logprobs: dict | None = None) -> dict:
        if reason is not None:  # a choice's end
            calls = self._stream(index)
            delta, reason = calls.feed("", final=True), tools.finish(reason, calls.called)
        return super().chunk(delta, reason, index, logprobs)
