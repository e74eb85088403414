"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it, over the chat path.

A request becomes a chat request: `instructions` a first system message, then the stored
conversation of `previous_response_id`, then `input` (a string, or items: messages with
`input_text` parts, `function_call` and `function_call_output` items). `max_output_tokens`,
`temperature`, `top_p`, `text.format` (JSON schema, via structured output), function `tools` and
`tool_choice` map to their chat fields. The answer is a `message` item with `output_text`, or
`function_call` items. With `store` (the default) the conversation is kept in Redis for
RESPONSE_TTL_S, so a follow-up can name it. Streamed, the semantic events come as the text
does; a request with tools streams its items once the answer is decided.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from celerytp.client.generation import GenerationResult, TokenStream
from celerytp.core.errors import CeleryTPError
from celerytp.core.redis_client import broker_errors
from celerytp.core.secrets import clipped
from celerytp.core.validation import bad_request
from celerytp.server import tools
from celerytp.server.errors import from_celerytp
from celerytp.server.schemas import ChatRequest, parse, strict_field

ROLES = ("user", "system", "developer", "assistant")
RESPONSE_TTL_S = 3600  # how long a stored response can be named by `previous_response_id`
_KEY = "celerytp:response:{id}"
_ID = r"^resp_[A-Za-z0-9]{1,64}$"


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, strict=True)


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, strict=True)


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    """The fields of `POST /v1/responses` this server implements; any other is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = strict_field()
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = strict_field()
    max_output_tokens: int | None = strict_field(ge=1)
    temperature: float | None = strict_field(ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = strict_field(gt=0, le=1, allow_inf_nan=False)
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = strict_field()
    previous_response_id: str | None = Field(None, pattern=_ID)
    store: bool = strict_field(True)
    stream: bool = strict_field(False)
    user: str | None = strict_field()
    metadata: dict[str, str] | None = Field(None, max_length=16)
    truncation: Literal["disabled"] | None = None

    @model_validator(mode="after")
    def _format_has_schema(self) -> ResponsesRequest:
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise ValueError("field 'text.format.schema': required when type is 'json_schema'")
        return self


# ---- the request as a chat -----------------------------------------------------------------

@broker_errors
def history(service: Any, previous_id: str | None) -> list[dict[str, Any]]:
    """The conversation a stored response ended with (its input and its answer); [] for none."""
    if previous_id is None:
        return []
    stored = service.leader.redis.get(_KEY.format(id=previous_id))
    if stored is None:
        raise bad_request("previous_response_id", f"no stored response {previous_id!r} (responses are kept "
                                                  f"{RESPONSE_TTL_S} s, and only with \"store\": true)")
    return json.loads(stored)["messages"]


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages (a 400 naming the item for one this server cannot take)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise bad_request(f"input[{i}].role", f"one of {', '.join(ROLES)} is required")
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise bad_request(f"input[{i}].type", f"{clipped(str(kind))!r} is not an input item this server takes "
                                                  "(message, function_call, function_call_output)")
    return messages


def _text(content: Any, field: str) -> Any:
    """A message's content: a string, or its parts as chat parts (`input_text`, `output_text`: text;
    `input_image`: an image)."""
    if not isinstance(content, list):
        return content  # a string, or what the chat schema refuses by name
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):  # a data URL (core/images.py)
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            raise bad_request(f"{field}[{j}].image_url", "a data URL (data:image/png;base64,...) is required "
                                                         "(file_id is not supported)")
        elif kind in ("input_file", "input_audio"):
            raise bad_request(f"{field}[{j}]", f"{kind} is not supported by this server")
        else:
            raise bad_request(f"{field}[{j}].type", "input_text, input_image or output_text is required")
    return parts


def as_chat(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> ChatRequest:
    """The chat request that answers `body` after the conversation `earlier`."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else [])
    messages += [*earlier, *input_messages(body.input)]
    chat: dict[str, Any] = {"model": body.model or "", "messages": messages}
    fields = {"max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
              "parallel_tool_calls": body.parallel_tool_calls, "user": body.user}
    chat.update({name: value for name, value in fields.items() if value is not None})
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            chat["response_format"]["json_schema"] = {
                "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {})}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    try:
        request = parse(ChatRequest, chat)
    except CeleryTPError as exc:
        raise renamed(exc) from None
    if not body.model:
        request.model = None  # the one model served
    return request


# chat field -> the Responses field it came from, for errors
_RENAMED = (("field 'messages", "field 'input"), ("field 'max_completion_tokens", "field 'max_output_tokens"),
            ("field 'response_format", "field 'text.format"), ("field 'tools", "field 'tools"))


def renamed(exc: CeleryTPError, earlier: int = 0) -> CeleryTPError:
    """A chat request's error naming the field as the Responses request wrote it; `earlier`: the
    chat's messages before `input`'s (instructions, the stored conversation)."""
    message = exc.message
    at = re.match(r"field 'messages\[(\d+)\]", message)
    if at and int(at.group(1)) >= earlier:  # one of input's items, counted from input's start
        message = f"field 'input[{int(at.group(1)) - earlier}]" + message[at.end():]
    for chat, written in _RENAMED:
        if message.startswith(chat):
            message = written + message[len(chat):]
            break
    message = message.replace("text.format.json_schema.", "text.format.").replace(".function.", ".")
    return CeleryTPError(exc.kind, message, op=exc.op)


# ---- the answer ------------------------------------------------------------------------------

class Answer:
    """One response: its id, the output items made of a result, and what is stored of it."""

    def __init__(self, body: ResponsesRequest, model_id: str, earlier: list[dict[str, Any]],
                 mode: tools.ToolMode | None):
        self.body, self.model_id, self.earlier, self.mode = body, model_id, earlier, mode
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], result: GenerationResult | None = None) -> dict:
        body = self.body
        incomplete = result is not None and result.finish_reason == "length"
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model_id,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": fmt or {"type": "text"}},
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction)
                            else body.tool_choice or "auto"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
            "truncation": "disabled", "output": output, "usage": None if result is None else usage(result),
        }

    def items(self, result: GenerationResult) -> list[dict[str, Any]]:
        """The output items: a message, or the function calls the model made."""
        content, calls = self.mode.answer(result.text) if self.mode is not None else (result.text, None)
        items = [] if not content and calls else [self.message(content or "", "completed")]
        for call in calls or []:
            items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": "completed"})
        return items

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def finish(self, service: Any, result: GenerationResult) -> dict[str, Any]:
        """The response object (blocking: it stores the conversation and counts the request)."""
        output = self.items(result)
        if self.body.store:
            self.store(service, output)
        return self.response("completed", output, result)

    @broker_errors
    def store(self, service: Any, output: list[dict[str, Any]]) -> None:
        """Keep the conversation (without `instructions`, which a follow-up does not inherit)."""
        messages = [*self.earlier, *input_messages(self.body.input)]
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in output if item["type"] == "function_call"]
        text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
        messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
        service.leader.redis.set(_KEY.format(id=self.id), json.dumps({"model": self.model_id, "messages": messages}),
                                 ex=RESPONSE_TTL_S)


def usage(result: GenerationResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "input_tokens_details": {"cached_tokens": result.reused_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


# ---- streamed: the semantic events -----------------------------------------------------------

class Events:
    """Server-sent events of one response, numbered."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


def _opening(answer: Answer, event: Events) -> Iterator[str]:
    yield event("response.created", response=answer.response("in_progress", []))
    yield event("response.in_progress", response=answer.response("in_progress", []))


def _item_events(event: Events, index: int, item: dict[str, Any]) -> Iterator[str]:
    """A whole output item's events, its text or arguments in one delta."""
    if item["type"] == "message":
        yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                            "content": []})
        yield from _text_events(event, index, item["id"], item["content"][0]["text"], whole=True)
    else:
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"])
    yield event("response.output_item.done", output_index=index, item=item)


def _text_events(event: Events, index: int, item_id: str, text: str, whole: bool) -> Iterator[str]:
    """The content part's opening (and with `whole`, its one delta) or its end."""
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    part = {"type": "output_text", "text": text, "annotations": []}
    if whole:
        yield event("response.content_part.added", **where, part={**part, "text": ""})
        if text:
            yield event("response.output_text.delta", **where, delta=text)
    yield event("response.output_text.done", **where, text=text)
    yield event("response.content_part.done", **where, part=part)


async def whole_events(answer: Answer, result: GenerationResult, service: Any) -> AsyncIterator[str]:
    """The events of a response generated whole (one with tools: its items are known at the end)."""
    event = Events()
    for text in _opening(answer, event):
        yield text
    response = await run_in_threadpool(answer.finish, service, result)
    for index, item in enumerate(response["output"]):
        for text in _item_events(event, index, item):
            yield text
    yield event("response.completed", response=response)


async def text_events(answer: Answer, stream: TokenStream, request: Request, service: Any) -> AsyncIterator[str]:
    """The events of a text answer as its tokens come; the request is cancelled if the client leaves."""
    event = Events()
    pieces = stream.pieces()
    finished = False
    try:
        for text in _opening(answer, event):
            yield text
        yield event("response.output_item.added", output_index=0, item=answer.message("", "in_progress"))
        where = {"item_id": answer.message_id, "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
        text = ""
        while (piece := await run_in_threadpool(next, pieces, None)) is not None:
            if piece.text:
                text += piece.text
                yield event("response.output_text.delta", **where, delta=piece.text)
            if await request.is_disconnected():
                return
        finished = True
        result = stream.result
        await run_in_threadpool(service.count, answer.model_id, result)
        for closing in _text_events(event, 0, answer.message_id, text, whole=False):
            yield closing
        response = await run_in_threadpool(answer.finish, service, result)
        yield event("response.output_item.done", output_index=0, item=response["output"][0])
        yield event("response.completed", response=response)
    except CeleryTPError as exc:
        finished = True
        await run_in_threadpool(service.count_error, answer.model_id, exc)
        error = from_celerytp(exc)[1]["error"]
        yield event("error", code=error["code"], message=error["message"], param=error["param"])
    finally:
        if not finished:
            await run_in_threadpool(stream.close)

