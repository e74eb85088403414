"""Token log-probabilities from the ranks, in OpenAI's two shapes (chat and text completions)."""

from __future__ import annotations

from collections.abc import Callable

from celerytp.client.generation import GenerationResult

Decode = Callable[[list[int]], str]


def _entry(decode: Decode, token_id: int, logprob: float) -> dict:
    text = decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(result: GenerationResult, decode: Decode, top_n: int) -> dict | None:
    """`choices[0].logprobs` of a chat completion: per token its text, logprob and the top `top_n`."""
    if result.logprobs is None:
        return None
    content = [
        {**_entry(decode, token_id, logprob), "top_logprobs": [_entry(decode, i, lp) for i, lp in top[:top_n]]}
        for token_id, (logprob, top) in zip(result.token_ids, result.logprobs, strict=False)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(result: GenerationResult, decode: Decode, top_n: int) -> dict | None:
    """`choices[0].logprobs` of a text completion (the legacy shape: parallel lists)."""
    if result.logprobs is None:
        return None
    pairs = list(zip(result.token_ids, result.logprobs, strict=False))
    tokens = [decode([token_id]) for token_id, _ in pairs]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens, "token_logprobs": [logprob for _, (logprob, _) in pairs],
        "top_logprobs": [{decode([i]): lp for i, lp in top[:top_n]} for _, (_, top) in pairs], "text_offset": offsets,
    }
