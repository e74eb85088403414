"""The sampling surface of the OpenAI API through a real `celerytp serve` (TP=2: the vocabulary is
split over the ranks) driven by the real openai client: vLLM's `top_k` and `repetition_penalty`
take effect, a max_tokens past the context is refused rather than cut, and every field the server
does not implement, or sent with the wrong type, is a 400 naming it, with nothing queued and the
server healthy afterwards (no silent ignoring)."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fixtures import MODEL, start_served

from celerytp.core.keys import queue_key

PROMPT = "one two one two one two one two"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with start_served(tmp_path_factory, "--max-batch", "4", tp=2) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def tokens(client, extra: dict | None = None, **options) -> tuple[list[str], list[float], list[dict[str, float]]]:
    """12 tokens of a completion of PROMPT, their log-probabilities and each one's top 5 (vLLM's
    fields go in `extra`, as the openai client sends them)."""
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, logprobs=5,
                                      extra_body={"ignore_eos": True, **(extra or {})}, **options)
    logprobs = reply.choices[0].logprobs
    return logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs


def argmax_taken(chosen: list[str], logprobs: list[float], top: list[dict[str, float]]) -> list[bool]:
    """Whether each token was a most likely one (the model's logits tie now and then)."""
    return [logprob >= max(alternatives.values()) - 1e-6 for logprob, alternatives in zip(logprobs, top)]


def test_top_k_one_takes_the_argmax_whatever_the_temperature(client):
    # (compared within a request: greedy answers of two requests may differ on a near tie, as
    # prefix reuse computes the prompt in another order)
    wandered = [argmax_taken(*tokens(client, temperature=2, seed=seed)) for seed in range(3)]
    assert not all(all(taken) for taken in wandered)  # precondition: at temperature 2 the draw wanders
    for seed in range(3):  # top_k=1 leaves one token to draw: the argmax (ignored, it would wander too)
        assert all(argmax_taken(*tokens(client, temperature=2, seed=seed, extra={"top_k": 1})))


def test_repetition_penalty_changes_the_output(client):
    greedy, _, _ = tokens(client, temperature=0, extra={"repetition_penalty": 1.0})  # neutral
    assert len(set(greedy)) < len(greedy)  # precondition: the model repeats itself
    penalised, _, _ = tokens(client, temperature=0, extra={"repetition_penalty": 50.0})
    assert len(set(penalised)) == len(penalised) and not {" one", " two"} & set(penalised), penalised


def test_unused_values_of_unsupported_fields_are_accepted(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           presence_penalty=0, frequency_penalty=0, logit_bias={}, n=1)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("extra", "field", "says"), [
    ({"suffix": "!"}, "suffix", "not supported"),
    ({"best_of": 2}, "best_of", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"frequency_penalty": 1}, "frequency_penalty", "not supported"),
    ({"logit_bias": {"5": 100}}, "logit_bias", "not supported"),
    ({"min_p": 0.1}, "min_p", "not supported"),
    ({"made_up_option": 1}, "made_up_option", "not a field"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"max_tokens": "5"}, "max_tokens", "integer"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"repetition_penalty": -1}, "repetition_penalty", "greater than 0"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
    ({"stream": True, "logprobs": 2}, "logprobs", "not returned in a stream"),
    ({"echo": True}, "echo", "not supported"),
])
def test_unsupported_or_mistyped_fields_are_refused_by_name(client, served, extra, field, says):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
    error = caught.value.body
    assert error["param"] == field and says in error["message"], error
    assert served.leader.redis.llen(queue_key(MODEL)) == 0  # nothing queued
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_max_tokens_past_the_context_is_refused_not_cut(client, served):
    context = client.models.retrieve(MODEL).max_model_len
    for ask in ({"max_tokens": context}, {"max_completion_tokens": context + 1}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **ask)
        error = caught.value.body
        assert error["param"] == "max_tokens" and f"context limit {context}" in error["message"], error
    assert served.leader.redis.llen(queue_key(MODEL)) == 0
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)  # unset or within: served
    assert reply.usage.completion_tokens <= 2


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_a_temperature_must_be_a_finite_number(served, number):
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "temperature": {number}}}'
    reply = httpx.post(f"{served.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "temperature" and "finite number" in error["message"], error
    assert httpx.get(f"{served.url}/health").status_code == 200
