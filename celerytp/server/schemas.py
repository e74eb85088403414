"""Request bodies of the OpenAI-style API (and of the `celerytp.generate` task), validated once.

A bad body is refused as CeleryTPError(bad_request) naming the field, whichever door it came in by.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from celerytp.core.errors import CeleryTPError, ErrorKind

Request = TypeVar("Request", bound="SamplingFields")


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class SamplingFields(BaseModel):
    """What every generation request may say (unknown fields are ignored, as OpenAI's SDKs add some)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (run several requests for several choices)")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def options(self) -> dict[str, Any]:
        """Keyword options for Leader.generate/stream (unset ones left to the model's defaults)."""
        return {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "stop": self.stop, "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str:
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError("exactly one prompt is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("a non-empty string is required")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    def options(self) -> dict[str, Any]:
        return {**super().options(), "prompt": self.prompt, "logprobs": self.logprobs or None}


class ChatRequest(SamplingFields):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def options(self) -> dict[str, Any]:
        out = {**super().options(), "messages": [m.as_dict() for m in self.messages]}
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            out["logprobs"] = max(self.top_logprobs or 0, 1)
        return out


class TaskRequest(SamplingFields):
    """The kwargs of the `celerytp.generate` Celery task: `prompt` or `messages`, like either endpoint."""

    prompt: str | None = None
    messages: list[Message] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_input(self) -> TaskRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self

    def options(self) -> dict[str, Any]:
        out = super().options()
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["messages"] = [m.as_dict() for m in self.messages or []]
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        return out


def parse(model: type[Request], body: Any) -> Request:
    """`body` as `model`; the first problem as CeleryTPError(bad_request) naming its field."""
    if not isinstance(body, dict):
        raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'body': a JSON object is required")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "body"
        message = error["msg"].removeprefix("Value error, ")
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field '{field}': {message}") from None
