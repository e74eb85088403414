"""Request bodies of the OpenAI-style API (and of the `celerytp.generate` task), validated once.

A bad body is refused as CeleryTPError(bad_request) naming the field, whichever door it came in by.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.sampling import logit_bias_entries
from celerytp.core.secrets import clipped

Request = TypeVar("Request", bound="SamplingFields")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, strict=True)
    # vLLM's extension (load tools such as guidellm send it): with include_usage, every chunk
    # carries its choice's usage so far
    continuous_usage_stats: bool = Field(False, strict=True)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str  # a data URL (core/images.py); a remote one is refused by name
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ImagePart(BaseModel):
    """OpenAI's image content part, for a vision-language model."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (server/tools.py `history`)
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _images_from_the_user(self) -> Message:
        if self.role != "user" and isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
            raise ValueError(f"image parts are taken in user messages only (this one's role is {self.role!r})")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it: text parts joined; with images (a user's), the
        parts in order (core/images.py takes the images out)."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
            return {"role": role, "content": [p.model_dump(exclude_none=True) for p in self.content]}
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": role, "content": content}


# OpenAI (and vLLM) request fields this server does not implement, each with the value that means
# "not used": sent with that value (or null) they are accepted, as SDKs and frameworks send
# defaults; any other value is a 400 naming the field, never silently ignored. A request that
# declares one of them implements it (a completion's `suffix`: fill-in-the-middle, core/fim.py).
REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1), "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "reasoning_effort": (None,),
    "web_search_options": (None,), "min_tokens": (None, 0), "use_beam_search": (None, False),
}


MAX_CHOICES = 16  # `n`: each choice is a row of the batch


def _same(sent: Any, unused: Any) -> bool:
    if sent is None or unused is None:
        return sent is unused
    if isinstance(sent, bool) != isinstance(unused, bool):
        return False  # true is not 1
    return sent == unused


def strict_field(default: Any = None, **rules: Any) -> Any:
    """A field taken as sent: no "yes" for true, no "5" for 5, no NaN or infinity for a number."""
    return Field(default, strict=True, **rules)


class SamplingFields(BaseModel):
    """What every generation request may say; a field it does not know is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = strict_field()
    max_tokens: int | None = strict_field(ge=1)
    temperature: float | None = strict_field(ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = strict_field(gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = strict_field(ge=-1)  # vLLM's extension: -1 or 0 keeps every token
    repetition_penalty: float | None = strict_field(gt=0, le=100, allow_inf_nan=False)  # vLLM's extension
    presence_penalty: float | None = strict_field(ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = strict_field(ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[int, float] | None = None  # token id (a JSON string of it) -> [-100, 100]
    min_p: float | None = strict_field(ge=0, le=1, allow_inf_nan=False)  # vLLM's extension
    n: int = strict_field(1, ge=1, le=MAX_CHOICES)
    stream: bool = strict_field(False)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # (str never takes a number, strict or not)
    seed: int | None = strict_field()
    user: str | None = strict_field()
    ignore_eos: bool = strict_field(False)  # vLLM's extension: run to max_tokens (benchmarks)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        if isinstance(body, dict):
            refused = {name: unused for name, unused in REFUSED_FIELDS.items() if name not in cls.model_fields}
            for name, unused in refused.items():
                if name in body and not any(_same(body[name], value) for value in unused):
                    raise ValueError(f"field '{name}': not supported by this server (docs/serving.md lists "
                                     "the supported fields); leave it out")
            body = {k: v for k, v in body.items() if k not in refused}  # sent as "unused": nothing to do
        return body

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _bias_entries(cls, bias: Any) -> dict[int, float] | None:
        return logit_bias_entries(bias)  # the ids' range is checked against the model's vocabulary later

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
            "top_k": None if self.top_k is None else max(self.top_k, 0), "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias, "min_p": self.min_p,
        }


MAX_PROMPTS = 64  # prompts in one completion request (each of its `n` choices is a row)
TokenIds = list[Annotated[int, Field(strict=True, ge=0)]]


class CompletionRequest(SamplingFields):
    """A text completion: `prompt` is a text, token ids, or a list of either (a batch: the
    choices of prompt i are i * n .. i * n + n - 1). `max_tokens` 0 with `echo` scores the prompt
    only (its logprobs, as lm-evaluation-harness asks for log-likelihoods). With `suffix`, each
    text prompt is the prefix of a fill-in-the-middle prompt (core/fim.py) and the text is the middle."""

    model: str
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = strict_field(ge=0)
    logprobs: int | None = strict_field(ge=0, le=20)
    echo: bool = strict_field(False)
    suffix: str | None = strict_field()  # "" or null: no suffix, a plain completion
    response_format: ResponseFormat | None = None  # as for chat (server/tools.py)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        prompts = cls.batch(prompt)
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise ValueError(f"1 to {MAX_PROMPTS} prompts are taken, got {len(prompts)}")
        if not all(prompts):
            raise ValueError("a non-empty string or a non-empty list of token ids is required")
        return prompt

    @staticmethod
    def batch(prompt: Any) -> list[str | list[int]]:
        """The prompts of a `prompt` field: one text or one list of token ids, or a list of them."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            return [prompt]
        return list(prompt)

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.batch(self.prompt)

    @model_validator(mode="after")
    def _echo_logprobs_not_streamed(self) -> CompletionRequest:
        if self.stream and self.echo and self.logprobs:  # the prompt's entries come with the result only
            raise ValueError("field 'echo': not with \"logprobs\" in a stream (the prompt tokens' "
                             "log-probabilities are listed by the non-streamed response)")
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise ValueError("field 'max_tokens': 0 only with \"echo\": true and not streamed (the prompt "
                             "scored, nothing generated)")
        return self

    @model_validator(mode="after")
    def _suffix_needs_text(self) -> CompletionRequest:
        if not self.suffix:
            return self
        if not all(isinstance(prompt, str) for prompt in self.prompts):
            raise ValueError("field 'suffix': needs a text prompt (the prefix it is filled in after); "
                             "token-id prompts cannot be put around it")
        if self.echo:  # the prompt sent is not the prompt run (core/fim.py): nothing sensible to echo
            raise ValueError("field 'suffix': not with \"echo\": true")
        return self

    @property
    def scores_only(self) -> bool:
        """max_tokens 0: the prompt is echoed (and scored), no token is generated."""
        return self.max_tokens == 0

    def options(self) -> dict[str, Any]:
        # echoed with logprobs, the prompt's tokens are listed too (OpenAI, vLLM)
        prompt_logprobs = self.logprobs if self.echo and self.logprobs else None
        options = {**super().options(), "prompt": self.prompts[0], "logprobs": self.logprobs or None,
                   "prompt_logprobs": prompt_logprobs}
        if self.scores_only:  # the ranks run at least one step: its token is dropped from the answer
            options["max_tokens"] = 1
        return options


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: `prompt` or a chat's `messages`, tokenized as a completion or chat would feed them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = strict_field()
    prompt: str | None = strict_field()
    messages: list[Message] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("field 'prompt': give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = strict_field()
    tokens: TokenIds = Field(max_length=1 << 17)


# ---- structured output and tools (server/tools.py) ---------------------------------------


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(None, strict=True)  # the output always matches the schema (a grammar), strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, strict=True)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = strict_field(ge=1)
    logprobs: bool = strict_field(False)
    top_logprobs: int | None = strict_field(ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:  # as OpenAI: not silently dropped
            raise ValueError("field 'top_logprobs': needs \"logprobs\": true")
        return self

    @model_validator(mode="after")
    def _tools_make_one_choice(self) -> ChatRequest:
        if self.n > 1 and (self.tools or (self.response_format and self.response_format.type != "text")):
            raise ValueError("field 'n': tools and structured output make one choice; leave n out")
        return self

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
    max_completion_tokens: int | None = strict_field(ge=1)
    response_format: ResponseFormat | None = None  # structured output and tools as for chat (server/tools.py)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)

    @model_validator(mode="after")
    def _one_input(self) -> TaskRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.tools and self.messages is None:
            raise ValueError("field 'tools': needs 'messages' (tools go to the model through its chat)")
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
        field = ".".join(clipped(part) for part in error["loc"]) or "body"  # a field name a caller made up, too
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"][:1] == ("stop",):
            field, message = "stop", "a string or a list of at most 4 strings is required"
        elif error["loc"][:1] == ("prompt",) and model is CompletionRequest and error["type"] != "value_error":
            field, message = "prompt", "a string, a list of token ids, or a list of either is required"
        if error["type"] == "extra_forbidden":
            message = "not a field this server knows or supports (docs/serving.md lists them); leave it out"
        elif error["type"] == "finite_number":
            message = "must be a finite number"
        if not error["loc"] and message.startswith("field '"):  # a check of the whole body that names its field
            raise CeleryTPError(ErrorKind.BAD_REQUEST, message) from None
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field '{field}': {message}") from None
