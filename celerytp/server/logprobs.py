"""Token log-probabilities from the ranks, in OpenAI's two shapes (chat and text completions).

Each shape takes `tokens`: a whole GenerationResult, or one streamed Piece (the tokens whose text
a chunk carries), so a stream's chunks concatenate to the non-streamed list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Decode = Callable[[list[int]], str]


class Tokens(Protocol):
    token_ids: list[int]
    logprobs: list | None  # per token: [logprob, [[id, logprob], ...]]


class EchoedTokens(Tokens, Protocol):
    prompt_token_ids: list[int] | None
    prompt_logprobs: list | None  # per prompt token: None first, then as `logprobs`


def _entry(decode: Decode, token_id: int, logprob: float) -> dict:
    text = decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tokens: Tokens, decode: Decode, top_n: int) -> dict | None:
    """`choices[i].logprobs` of a chat completion: per token its text, logprob and the top `top_n`."""
    if tokens.logprobs is None:
        return None
    content = [
        {**_entry(decode, token_id, logprob), "top_logprobs": [_entry(decode, i, lp) for i, lp in top[:top_n]]}
        for token_id, (logprob, top) in zip(tokens.token_ids, tokens.logprobs, strict=False)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: Tokens, decode: Decode, top_n: int, offset: int = 0) -> dict | None:
    """`choices[i].logprobs` of a text completion (the legacy shape: parallel lists); `offset` is
    where the first token's text begins in the completion (a stream's later chunks)."""
    if tokens.logprobs is None:
        return None
    pairs = list(zip(tokens.token_ids, tokens.logprobs, strict=False))
    return _legacy([token_id for token_id, _ in pairs], [entry for _, entry in pairs], decode, top_n, offset)


def echoed_logprobs(result: EchoedTokens, decode: Decode, top_n: int, prompt_text: str) -> dict | None:
    """`choices[i].logprobs` of a text completion with `echo`: the prompt's tokens first (the first
    one has no log-probability: None), then the completion's, offset past the echoed prompt text."""
    completion = completion_logprobs(result, decode, top_n, len(prompt_text))
    if completion is None or result.prompt_logprobs is None:
        return completion
    prompt = _legacy(result.prompt_token_ids, result.prompt_logprobs, decode, top_n, 0)
    return {key: prompt[key] + completion[key] for key in prompt}


def _legacy(ids: list[int], entries: list, decode: Decode, top_n: int, offset: int) -> dict:
    """The parallel lists of tokens `ids` and their [logprob, top] entries (None: no logprob)."""
    texts = [decode([token_id]) for token_id in ids]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {
        "tokens": texts, "token_logprobs": [None if entry is None else entry[0] for entry in entries],
        "top_logprobs": [None if entry is None else {decode([i]): lp for i, lp in entry[1][:top_n]}
                         for entry in entries],
        "text_offset": offsets,
    }


def text_length(tokens: Tokens, decode: Decode) -> int:
    """How far `completion_logprobs` offsets the tokens after these."""
    return sum(len(decode([token_id])) for token_id in tokens.token_ids)
