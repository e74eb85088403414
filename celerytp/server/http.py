"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
admin model management, /health and /metrics.

Leader calls block, so they run in the thread pool; while one runs, the request's connection is
watched and a client that goes away has its generation cancelled on the ranks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from celerytp.client.generation import GenerationResult
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.server.errors import HTTPProblem, celerytp_response, from_celerytp, problem_response
from celerytp.server.logprobs import Decode, chat_logprobs, completion_logprobs
from celerytp.server.schemas import ChatRequest, CompletionRequest, SamplingFields, parse
from celerytp.server.service import Service

DISCONNECT_POLL_S = 0.1
ABANDONED_END_S = 10.0  # how long an abandoned stream's cancelled end is awaited, to count it
_END = object()


def create_app(service: Service, api_key: str | None = None) -> FastAPI:
    """The API over `service`; with `api_key`, every endpoint but /health and /metrics wants
    `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="celerytp", docs_url=None, redoc_url=None)
    metrics = service.metrics
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authorised(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise HTTPProblem(401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key")

    auth = [Depends(authorised)]

    @app.exception_handler(CeleryTPError)
    async def _celerytp_error(request: Request, exc: CeleryTPError) -> JSONResponse:
        return celerytp_response(exc)

    @app.exception_handler(HTTPProblem)
    async def _problem(request: Request, exc: HTTPProblem) -> JSONResponse:
        return problem_response(exc)

    if metrics is not None:
        app.add_middleware(RequestCounter, metrics=metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        report = await run_in_threadpool(service.health)
        return JSONResponse(report, status_code=200 if report["ok"] else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict:
        models = await run_in_threadpool(service.loaded)
        return {"object": "list", "data": [model_card(m, r) for m, r in sorted(models.items())]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str) -> dict:
        models = await run_in_threadpool(service.models)
        if model_id not in models:
            raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded; loaded: {sorted(models)}")
        return model_card(model_id, models[model_id])

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await json_body(request))
        return await answer(request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatRequest, await json_body(request))
        return await answer(request, body, chat=True)

    @app.post("/admin/models", dependencies=auth)
    async def load_model(request: Request) -> dict:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'body': a JSON object is required")
        model_id, path = body.get("model"), body.get("path")
        if not isinstance(model_id, str) or not model_id:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'model': a model id is required")
        options = {k: body[k] for k in ("quant", "max_batch", "max_context", "max_queue", "dtype") if body.get(k) is not None}
        started = time.perf_counter()
        await run_in_threadpool(service.leader.load, model_id, path, **options)
        if metrics is not None:
            metrics.chord_latency.labels("load").observe(time.perf_counter() - started)
        return model_card(model_id, (await run_in_threadpool(service.models))[model_id])

    @app.delete("/admin/models/{model_id:path}", dependencies=auth)
    async def unload_model(model_id: str) -> dict:
        await run_in_threadpool(service.resolve, model_id)
        started = time.perf_counter()
        await run_in_threadpool(service.leader.unload, model_id)
        if metrics is not None:
            metrics.chord_latency.labels("unload").observe(time.perf_counter() - started)
        return {"id": model_id, "object": "model", "deleted": True}

    async def answer(request: Request, body: SamplingFields, chat: bool) -> Response:
        model_id = await run_in_threadpool(service.resolve, body.model)
        request_id = uuid.uuid4().hex
        options = {**body.options(), "request_id": request_id}
        decode = await run_in_threadpool(service.decoder, model_id) if options.get("logprobs") else None
        shape = Shape(chat, model_id, request_id, top_logprobs(body), decode)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = await run_in_threadpool(service.stream, model_id, options)  # a bad request fails here, as JSON
            events = sse(service, request, stream, shape, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await until_disconnected(request, run_in_threadpool(service.generate, model_id, options),
                                          lambda: service.leader.cancel(request_id))
        return JSONResponse(shape.complete(result))

    return app


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
            route = scope.get("route")  # the router writes the matched route into the same scope
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status[0])).inc()


async def json_body(request: Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'body': not valid JSON ({exc})") from None


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


def pump(stream: Any, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    """In its own thread: move a TokenStream's deltas (then _END, or the error) onto `queue`, so
    the event loop is woken once per token instead of handing each token across threads."""
    try:
        for delta in stream:
            loop.call_soon_threadsafe(queue.put_nowait, delta)
        loop.call_soon_threadsafe(queue.put_nowait, _END)
    except RuntimeError:  # the event loop closed: the server is stopping
        pass
    except Exception as exc:  # noqa: BLE001 - handed to the event loop, which answers it
        loop.call_soon_threadsafe(queue.put_nowait, exc)


async def sse(service: Service, request: Request, stream: Any, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of a TokenStream, in OpenAI's chunk format; cancels on disconnect."""
    queue: asyncio.Queue = asyncio.Queue()
    pumping = threading.Thread(target=pump, args=(stream, asyncio.get_running_loop(), queue), daemon=True)
    pumping.start()
    finished, checked = False, time.monotonic()
    try:
        if shape.chat:
            yield event(shape.chunk({"role": "assistant", "content": ""}, None))
        while True:
            try:
                items = [await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)]
            except TimeoutError:
                items = []
            if time.monotonic() - checked > DISCONNECT_POLL_S:  # tokens may never leave a gap to check in
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if not items:
                continue
            while not queue.empty():  # whatever else arrived meanwhile goes out in one write
                items.append(queue.get_nowait())
            deltas = [item for item in items if isinstance(item, str)]
            if deltas:
                yield "".join(event(shape.chunk(delta, None)) for delta in deltas)
            if isinstance(items[-1], Exception):  # _END or an error is always the last item
                raise items[-1]
            if items[-1] is _END:
                break
        result: GenerationResult = stream.result
        finished = True
        if result is None:
            return
        service.count(shape.model_id, result)
        yield event(shape.chunk("", finish_reason(result)))
        if include_usage:
            yield event({**shape.chunk("", None), "choices": [], "usage": usage(result)})
        yield "data: [DONE]\n\n"
    except CeleryTPError as exc:
        finished = True
        yield event(from_celerytp(exc)[1])
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away (or the server is stopping): free the row
            await asyncio.shield(run_in_threadpool(abandon, service, stream, pumping, shape.model_id))


def abandon(service: Service, stream: Any, pumping: threading.Thread, model_id: str) -> None:
    """Cancel a stream nobody reads any more, then count its end (cancelled, or whatever it
    reached first) once the pump has read it."""
    service.leader.cancel(stream.request_id)
    pumping.join(ABANDONED_END_S)
    if stream.result is not None:
        service.count(model_id, stream.result)


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(result: GenerationResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def top_logprobs(body: SamplingFields) -> int:
    """How many alternatives per token the response lists."""
    if isinstance(body, ChatRequest):
        return body.top_logprobs or 0
    return getattr(body, "logprobs", None) or 0


def model_card(model_id: str, record: dict) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "celerytp",
            "max_context": record.get("max_context"), "max_batch": record.get("max_batch"),
            "replicas": sorted(record.get("replicas", {}))}  # the groups serving it behind its one queue


class Shape:
    """OpenAI's response and chunk objects for one request (chat or text completion)."""

    def __init__(self, chat: bool, model_id: str, request_id: str, top_n: int = 0, decode: Decode | None = None):
        self.chat, self.model_id, self.request_id = chat, model_id, request_id
        self.top_n, self.decode = top_n, decode
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    def complete(self, result: GenerationResult) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}}
        else:
            choice = {"index": 0, "text": result.text}
        logprobs = None
        if self.decode is not None:
            shape = chat_logprobs if self.chat else completion_logprobs
            logprobs = shape(result, self.decode, self.top_n)
        choice.update(logprobs=logprobs, finish_reason=finish_reason(result))
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": usage(result)}

    def chunk(self, delta: str | dict, reason: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta if isinstance(delta, dict) else ({"content": delta} if delta else {})}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": delta}, "text_completion"
        choice.update(logprobs=None, finish_reason=reason)
        return {**self._head(obj), "choices": [choice]}
