"""Generation from the leader's side: prepare requests, run them fused or step by step, stream.

Fused mode (the default) queues the request for the model's serving loop, where it is batched
with whatever else runs (client/requests.py); step mode drives one `step` chord per token.
Both sample with the same function, so greedy and seeded outputs are identical.
"""

from __future__ import annotations

import os
import time
import uuid
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from celerytp.client.requests import Done, PendingRequest
from celerytp.core.detokenize import IncrementalText
from celerytp.core.images import DEFAULT_LIMITS, ImageLimits, image_size, take_images
from celerytp.core.images import encode as encode_images
from celerytp.core.protocol import GenSpec, RowResult, StepResult, validate_message
from celerytp.core.sampling import SamplingParams
from celerytp.core.stopping import StopChecker, cut_at_stop
from celerytp.core.tokenizer import Tokenizer, load_tokenizer
from celerytp.core.validation import (
    bad_request,
    check_logit_bias,
    check_tokens,
    prefill_chunks,
    refuse_step_penalties,
    sampling_params,
)
from celerytp.core.vision_inputs import checkpoint_vision, image_prompt

DEFAULT_MAX_TOKENS = 256
# A request that names no temperature samples at the model's generation_config.json, else at 1:
# OpenAI's default and vLLM's (0 would make `n` choices alike and every client that sends none greedy).
DEFAULT_SAMPLING = {"temperature": 1.0}
MODES = ("fused", "step")


class StepFn(Protocol):
    """One step chord of a model: `Leader.step` with the model bound."""

    def __call__(
        self, tokens: list[int], offset: int, sampling: SamplingParams | None = None, *, sample: bool = True
    ) -> StepResult: ...


@dataclass
class GenerationResult:
    """A finished completion. `token_ids` excludes the EOS token; `text` excludes stop strings."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "cancelled"
    prompt_tokens: int
    request_id: str = ""
    ttft_s: float = 0.0  # request start to the first generated token
    decode_s: float = 0.0
    total_s: float = 0.0
    mode: str = "fused"
    queued_s: float = 0.0  # waiting for a free row (fused)
    reused_tokens: int = 0  # prompt tokens found already cached (prefix reuse)
    images: int = 0  # images in the prompt (a vision-language model)
    logprobs: list | None = None  # per token: [logprob, [[id, logprob], ...]] when asked for
    # when asked for (`prompt_logprobs`): the prompt's ids and, per prompt token, the same entries (None first)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    token_gaps_s: list[float] = field(default_factory=list)  # between sampled tokens (fused; for metrics)
    resumed: bool = False  # resumed after a group failed under it

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time they took."""
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 and self.completion_tokens > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(completion_tokens=self.completion_tokens, tokens_per_s=round(self.tokens_per_s, 3))
        return out


@dataclass
class Prepared:
    """A request ready to run: its wire spec plus what the leader needs to finish it."""

    tokenizer: Tokenizer
    spec: dict[str, Any]  # a protocol GenSpec
    params: SamplingParams
    stops: list[str]
    started: float


# A prompt longer than max_context * this many characters cannot fit the model's context: it is
# refused before it is tokenized (tokenizing 10 MB took 7 s and 0.9 GB). Generous: a token is a
# few characters of text on average, and only a long run of one repeated character comes near.
PROMPT_CHARS_PER_TOKEN = 32


def _texts(value: Any) -> Iterator[str]:
    """The strings in a prompt, a chat's messages or its tools (nested lists and dicts), without recursion."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)


def check_prompt_text(prompt: Any, messages: Any, tools: Any, max_context: int) -> None:
    """What can be refused before tokenizing, in time linear in the text: text that the context
    could not hold (more than max_context * PROMPT_CHARS_PER_TOKEN characters in all), and text
    that is not Unicode a tokenizer can read (a lone surrogate, such as JSON's "\\ud800").
    A 400 naming `prompt`, `messages` or `tools`."""
    limit = max_context * PROMPT_CHARS_PER_TOKEN
    size = 0
    for name, value in (("prompt", prompt), ("messages", messages), ("tools", tools)):
        for text in _texts(value):
            size += len(text)
            if size > limit:
                raise bad_request(name, f"longer than the model's context of {max_context} tokens can hold "
                                        f"(more than {limit} characters of text in all); shorten it")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise bad_request(name, f"not valid Unicode text: a lone surrogate ({exc.object[exc.start]!a}) at "
                                        f"character {exc.start} of one of its strings") from None


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[int] | None, messages: list[dict] | None,
               tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids: a text tokenized, a chat rendered by the model's template and
    tokenized, or token ids as given (checked against the vocabulary later, with the spec)."""
    if (prompt is None) == (messages is None):
        raise bad_request("prompt", "give exactly one of prompt and messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages", "a non-empty list of {role, content} objects is required")
        return tokenizer.apply_chat_template(messages, tools=tools) if tools else tokenizer.apply_chat_template(messages)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("prompt", "a non-empty string or a non-empty list of token ids is required")
    return tokenizer.encode(prompt)


def tokenized(record: dict[str, Any], prompt: str | list[int] | None, messages: list[dict] | None,
              tools: list[dict] | None = None, roots: list[str] | None = None,
              image_limits: ImageLimits = DEFAULT_LIMITS) -> tuple[Tokenizer, list[int], list[bytes]]:
    """The model's tokenizer, the prompt's ids and its images' bytes (a chat's image parts, taken
    out and checked first: core/images.py; each image's token repeated for its features).
    `roots`: where image paths may point (a Leader caller's; none from the wire). `image_limits`:
    how many images, how large, and the media domains whose image URLs are fetched."""
    images: list[bytes] = []
    mmproj = record.get("load", {}).get("mmproj")  # a GGUF's vision tower, llama.cpp's mmproj file
    vision = checkpoint_vision(record["path"], mmproj)
    if isinstance(messages, list):
        messages, images = take_images(messages, vision is not None, image_limits, roots=roots or [])
    check_prompt_text(prompt, messages, tools, record["max_context"])  # before any tokenizing
    tokenizer = load_tokenizer(record["path"])
    if images:
        sizes = [image_size(data) for data in images]
        return tokenizer, image_prompt(tokenizer, messages, tools, vision, sizes), images
    return tokenizer, prompt_ids(tokenizer, prompt, messages, tools), images


def prepare(
    record: dict[str, Any],
    prompt: str | list[int] | None = None,
    messages: list[dict] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict[int | str, float] | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    stop: list[str] | str | None = None,
    request_id: str | None = None,
    stream: bool = False,
    ignore_eos: bool = False,
    grammar: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
    image_limits: ImageLimits | None = None,
) -> Prepared:
    """Tokenize and check a request on the leader against the loaded model's `record`.

    Bad arguments raise CeleryTPError(bad_request) naming the field, checked as the ranks
    check them. `ignore_eos` generates on past EOS to max_tokens (benchmarks, like vLLM's option).
    `grammar` constrains the output (structured output, worker/grammar.py); `tools` go to a chat
    template that renders them (server/tools.py decides). `prompt_logprobs` (0..20 alternatives)
    asks for the prompt tokens' log-probabilities too. `image_limits` bounds a chat's images and
    names the media domains whose image URLs are fetched (core/images.py; default: none is).
    """
    started = time.perf_counter()
    tokenizer, ids, images = tokenized(record, prompt, messages, tools, roots=[_model_directory(record["path"])],
                                       image_limits=image_limits or DEFAULT_LIMITS)
    given = {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty, "logit_bias": logit_bias,
        "min_p": min_p, "seed": seed, "logprobs": logprobs,
    }
    params = sampling_params({**DEFAULT_SAMPLING, **tokenizer.generation_defaults,
                              **{k: v for k, v in given.items() if v is not None}})
    stops = [stop] if isinstance(stop, str) else stop
    spec = {
        "request_id": request_id or uuid.uuid4().hex, "prompt": ids,
        "max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "sampling": params.to_dict(), "stop": [s for s in stops if s] if isinstance(stops, list) else stops or [],
        "stream": stream, "eos_token_ids": [] if ignore_eos else sorted(tokenizer.eos_token_ids),
    }
    if grammar is not None:
        spec["grammar"] = grammar
    if prompt_logprobs is not None:
        spec["prompt_logprobs"] = prompt_logprobs
    if images:
        spec["images"] = encode_images(images)
    check_spec(record, spec)
    room = record["max_context"] - len(ids)
    if max_tokens is not None and max_tokens > room:  # asked for: refused, not clamped (as vLLM)
        raise bad_request("max_tokens", f"{max_tokens} new tokens after the prompt's {len(ids)} exceed the context "
                                        f"limit {record['max_context']}; ask for at most {room}")
    return Prepared(tokenizer, spec, params, spec["stop"], started)


def _model_directory(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(path)


def check_spec(record: dict[str, Any], spec: dict[str, Any]) -> None:
    """A request's wire fields, checked on the leader as every rank checks them."""
    validate_message(GenSpec, spec, "generate")
    check_tokens(spec["prompt"], max_context=record["max_context"], vocab_size=record["vocab_size"], field="prompt")
    check_logit_bias(sampling_params(spec.get("sampling")), record["vocab_size"])


def finish(prepared: Prepared, row: RowResult, mode: str) -> GenerationResult:
    text, _ = cut_at_stop(prepared.tokenizer.decode(row.token_ids), prepared.stops)
    return GenerationResult(
        text=text, token_ids=row.token_ids, finish_reason=row.finish_reason, prompt_tokens=row.prompt_tokens,
        request_id=row.request_id, ttft_s=row.ttft_s, decode_s=row.decode_s,
        total_s=time.perf_counter() - prepared.started, mode=mode, queued_s=row.queued_s,
        reused_tokens=row.reused_tokens, logprobs=row.logprobs, token_gaps_s=row.token_gaps_s, resumed=row.resumed,
        prompt_token_ids=None if row.prompt_logprobs is None else prepared.spec["prompt"],
        prompt_logprobs=row.prompt_logprobs, images=len(prepared.spec.get("images", ())),
    )


def run_steps(step: StepFn, prepared: Prepared, max_context: int) -> RowResult:
    """Step mode: chunked prefill, then one `step` chord per token."""
    spec, ids = prepared.spec, prepared.spec["prompt"]
    if spec.get("grammar") is not None:
        raise bad_request("grammar", "structured output runs in the serving loop (fused mode) only")
    refuse_step_penalties(prepared.params)
    checker = StopChecker(
        set(spec["eos_token_ids"]), spec["max_tokens"], len(ids), max_context, prepared.stops, prepared.tokenizer.decode
    )
    start = time.perf_counter()
    *early, (last_start, _) = prefill_chunks(len(ids))
    for begin, end in early:  # all chunks but the last: no sample
        step(ids[begin:end], begin, sample=False)
    reply = step(ids[last_start:], last_start, prepared.params)
    offset = len(ids)
    first = time.perf_counter()
    while (reason := checker.after(reply.token)) is None:
        reply = step([reply.token], offset, prepared.params)
        offset += 1
    return RowResult(
        request_id=spec["request_id"], token_ids=checker.token_ids, finish_reason=reason,
        matched_stop=checker.matched, prompt_tokens=len(ids), ttft_s=first - start, decode_s=time.perf_counter() - first,
    )


@dataclass(frozen=True)
class Piece:
    """A streamed text delta and the tokens whose text it completes (the last piece: every token
    not given yet), their logprobs too when asked for, as in GenerationResult."""

    text: str
    token_ids: list[int]
    logprobs: list | None = None


class TokenStream:
    """Text deltas of one request as rank 0 publishes its tokens; `.result` at the end.

    UTF-8 sequences split across tokens are held back until complete, and so is text that
    could be the start of a stop string.
    """

    def __init__(self, pending: PendingRequest, prepared: Prepared, timeout: float):
        self.request_id = prepared.spec["request_id"]
        self.result: GenerationResult | None = None
        self.ttft_s: float | None = None
        self.tokens = 0  # tokens received so far
        self._pending = pending
        self._prepared = prepared
        self._timeout = timeout
        self._events: Iterator | None = None  # the request's events once iteration began

    @property
    def prompt_tokens(self) -> int:
        return len(self._prepared.spec["prompt"])

    def __iter__(self) -> Iterator[str]:
        pieces = self.pieces()
        try:
            for piece in pieces:
                if piece.text:
                    yield piece.text
        finally:
            pieces.close()

    def pieces(self) -> Iterator[Piece]:
        """The deltas with their tokens: concatenated, the pieces' text is the result's text and
        their tokens (and logprobs) are the result's, each token with the delta that completes its text."""
        text = StreamText(self._prepared.tokenizer.decode, self._prepared.stops)
        ids: list[int] = []  # received and not given yet, with their logprobs
        logprobs: list = []
        given = 0
        self._events = events = self._pending.events(self._timeout)
        try:
            for event in events:
                if isinstance(event, Done):
                    self.result = finish(self._prepared, event.result, "fused")
                    break
                self.ttft_s = self.ttft_s or time.perf_counter() - self._prepared.started
                self.tokens += 1
                delta = text.feed(event.id)
                ids.append(event.id)
                logprobs.append(event.logprob)
                if delta:
                    count = text.covered - given
                    yield Piece(delta, ids[:count], logprobs[:count] if self._prepared.params.logprobs else None)
                    del ids[:count], logprobs[:count]
                    given += count
        finally:
            events.close()  # left early (break, close, garbage): the request is cancelled
        result = self.result
        rest, left = result.text[text.sent:], result.token_ids[given:]  # the result's own list is the one kept
        if rest or left:
            left_logprobs = None if result.logprobs is None else result.logprobs[given : len(result.token_ids)]
            yield Piece(rest, left, left_logprobs)

    def close(self) -> None:
        """Stop following the request and cancel it (its row frees within a few steps)."""
        if self._events is not None:
            self._events.close()
        elif self.result is None:
            self._pending.queues.cancel(self.request_id)

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StreamText:
    """The text a stream may send as tokens arrive, decoded incrementally.

    After each token the text sent so far is `decode(ids)` cut at the earliest stop string, less a
    trailing incomplete UTF-8 sequence and less any ending that could be the start of a stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.stops = stops
        self.sent = 0  # characters of the text sent
        self._text = IncrementalText(decode)
        self._ends: list[int] = []  # per token whose text is final: where its text ends
        self._reach = max(map(len, stops), default=1) - 1  # how far back a stop string can begin
        self._cut: int | None = None  # where the earliest stop string found begins
        # The stops' proper prefixes, longest first: text ending in one may yet become a stop string.
        self._prefixes = sorted({stop[:n] for stop in stops for n in range(1, len(stop))}, key=len, reverse=True)

    def feed(self, token_id: int) -> str:
        """Record a token; return the text to send now (may be "")."""
        before = len(self._text.text)
        grown = self._text.feed(token_id)
        self._ends += [len(self._text.text)] * (self._text.settled - len(self._ends))
        if not grown:
            return ""
        text = self._text.text
        found, stop = cut_at_stop(text, self.stops, max(0, before - self._reach))
        if stop is not None and (self._cut is None or len(found) < self._cut):
            self._cut = len(found)
        end = len(text) if self._cut is None else self._cut
        end -= next((len(prefix) for prefix in self._prefixes if text.endswith(prefix, 0, end)), 0)
        delta = text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    @property
    def covered(self) -> int:
        """How many tokens have all their text sent."""
        return bisect_right(self._ends, self.sent)
