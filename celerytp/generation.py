"""Generation driven by the leader: tokenize, chunked prefill, one step chord per token, stop."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from celerytp.protocol import ErrorKind
from celerytp.sampling import SamplingParams
from celerytp.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from celerytp.leader import Leader

DEFAULT_MAX_TOKENS = 256
PREFILL_CHUNK = 512


@dataclass
class GenerationResult:
    """A finished completion. `token_ids` excludes the EOS token; `text` excludes stop strings."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    ttft_s: float = 0.0  # request start to the first generated token
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    mode: str = "step"

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


class StopChecker:
    """Decides when a completion ends: EOS, a stop string, max_tokens or the context limit."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], max_tokens: int, room: int):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_tokens = min(max_tokens, room)
        self.text = ""

    def after(self, token_ids: list[int], token: int) -> str | None:
        """Record `token`; return the finish reason if the completion ends here."""
        if token in self.tokenizer.eos_token_ids:
            return "stop"
        token_ids.append(token)
        if self.stop:
            self.text = self.tokenizer.decode(token_ids)
            cut = min((i for s in self.stop if (i := self.text.find(s)) >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                return "stop"
        if len(token_ids) >= self.max_tokens:
            return "length"
        return None

    def final_text(self, token_ids: list[int]) -> str:
        return self.text if self.stop else self.tokenizer.decode(token_ids)


def _error(kind: ErrorKind, message: str) -> Exception:
    from celerytp.leader import CeleryTPError, RankFailure

    return CeleryTPError("generate", [RankFailure(None, kind, message)])


def prompt_ids(tokenizer: Tokenizer, prompt: str | None, messages: list[dict] | None) -> list[int]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    ids = tokenizer.apply_chat_template(messages) if messages is not None else tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return ids


def sampling_params(tokenizer: Tokenizer, **given: Any) -> SamplingParams:
    """The checkpoint's generation_config defaults, overridden by what the caller gave."""
    chosen = {**tokenizer.generation_defaults, **{k: v for k, v in given.items() if v is not None}}
    return SamplingParams.from_dict(chosen)


def generate(
    leader: Leader,
    model_id: str,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop: list[str] | str | None = None,
    mode: str = "step",
    prefill_chunk: int = PREFILL_CHUNK,
) -> GenerationResult:
    """Generate from `prompt` (raw text) or `messages` (chat, template applied) on a loaded model."""
    if mode != "step":
        raise ValueError(f"mode must be 'step', got {mode!r}")
    record = leader.models().get(model_id)
    if record is None:
        raise _error(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded")
    tokenizer = load_tokenizer(record["path"])
    ids = prompt_ids(tokenizer, prompt, messages)
    if len(ids) > record["max_context"]:
        raise _error(ErrorKind.BAD_REQUEST, f"the prompt's {len(ids)} tokens exceed the context limit {record['max_context']}")
    params = sampling_params(
        tokenizer, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, seed=seed
    )
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    checker = StopChecker(tokenizer, stops, max_tokens, room=record["max_context"] - len(ids) + 1)

    start = time.perf_counter()
    offset = 0
    for i in range(0, len(ids) - prefill_chunk, prefill_chunk):  # all chunks but the last: no sample
        leader.step(model_id, ids[i : i + prefill_chunk], offset, sample=False)
        offset += len(ids[i : i + prefill_chunk])
    reply = leader.step(model_id, ids[offset:], offset, params)
    offset = len(ids)
    first = time.perf_counter()
    token_ids: list[int] = []
    while (finish := checker.after(token_ids, reply.token)) is None:
        reply = leader.step(model_id, [reply.token], offset, params)
        offset += 1
    end = time.perf_counter()
    return GenerationResult(
        text=checker.final_text(token_ids), token_ids=token_ids, finish_reason=finish, prompt_tokens=len(ids),
        ttft_s=first - start, prefill_s=first - start, decode_s=end - first, total_s=end - start,
    )
