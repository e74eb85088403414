"""The sampling surface of the OpenAI API through a real `celerytp serve` (TP=2: the vocabulary is
split over the ranks) driven by the real openai client: vLLM's `top_k` and `repetition_penalty`
take effect, a max_tokens past the context is refused rather than cut, and every field the server
does not implement, or sent with the wrong type, is a 400 naming it, with nothing queued and the
server healthy afterwards (no silent ignoring)."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import openai
import pytest
from celery import Celery
from server_fixtures import MODEL, start_served

from celerytp.core.keys import queue_key
from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import load_tokenizer
from celerytp.server.http import SEEDS, choice_options

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
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, suffix="")  # no suffix: no FIM
    assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("extra", "field", "says"), [
    ({"suffix": "!"}, "suffix", "no fill-in-the-middle tokens"),  # SmolLM2 has none (tests/test_fim.py)
    ({"suffix": "!", "prompt": [5, 6]}, "suffix", "needs a text prompt"),
    ({"suffix": "!", "echo": True}, "suffix", "not with \"echo\""),
    ({"best_of": 2}, "best_of", "not supported"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "number"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias", "outside the vocabulary"),  # the model's: checked on the leader
    ({"made_up_option": 1}, "made_up_option", "not a field"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"max_tokens": "5"}, "max_tokens", "integer"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"repetition_penalty": -1}, "repetition_penalty", "greater than 0"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"n": "2"}, "n", "integer"),
    ({"echo": True, "logprobs": 2, "stream": True}, "echo", "in a stream"),
    ({"echo": True, "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"max_tokens": 0}, "max_tokens", "0 only with \"echo\""),
    ({"max_tokens": 0, "echo": True, "stream": True}, "max_tokens", "not streamed"),
    ({"prompt": [5, 10000000]}, "prompt", "outside the vocabulary"),
    ({"prompt": []}, "prompt", "1 to 64 prompts"),
    ({"prompt": [[1, 2], []]}, "prompt", "a non-empty string or a non-empty list of token ids"),
    ({"prompt": ["a"] * 65}, "prompt", "1 to 64 prompts"),
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


# ---- streamed logprobs, n choices, echo --------------------------------------------------
# Answers compared across requests must compute alike: a prompt reused from a cache row computes
# in another order than a fresh one, and this model's logits tie often enough to tell. So each
# test first runs its request for one token (`warm`): the compared requests then take the same
# rows (the longest reuse, then the lowest), each holding the prompt from that first run.

CHAT = [{"role": "user", "content": "Write the words one two one two one two"}]


def warm(create, **ask) -> None:
    create(**{**ask, "max_tokens": 1})


def spelled(tokens: list[str], text: str) -> bool:
    """Whether a chunk's tokens spell its text (a token that ends inside a character does not)."""
    return "\ufffd" in "".join(tokens) or "".join(tokens) == text


def test_streamed_chat_logprobs_are_the_whole_answers_split_by_chunk(client):
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    warm(client.chat.completions.create, **ask)
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**ask, stream=True) if chunk.choices]
    entries = []
    for choice in chunks:
        got = choice.logprobs.content if choice.logprobs else []
        assert spelled([e.token for e in got], choice.delta.content or ""), choice
        entries += got
    assert "".join(choice.delta.content or "" for choice in chunks) == whole.message.content
    expected = whole.logprobs.content
    assert [e.token for e in entries] == [e.token for e in expected]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert [sorted(t.logprob for t in e.top_logprobs) for e in entries] == [
        pytest.approx(sorted(t.logprob for t in e.top_logprobs), abs=1e-5) for e in expected]


def test_streamed_completion_logprobs_are_the_whole_answers_split_by_chunk(client):
    # " two" may begin the stop string, so its text (and its logprob) waits for the next token's
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3, "stop": [" two three"]}
    warm(client.completions.create, **ask)
    whole = client.completions.create(**ask).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**ask, stream=True) if chunk.choices]
    tokens, values, offsets = [], [], []
    for choice in chunks:
        if choice.logprobs:
            assert spelled(choice.logprobs.tokens, choice.text), choice
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs
            offsets += choice.logprobs.text_offset
    assert any(choice.logprobs and len(choice.logprobs.tokens) > 1 for choice in chunks)  # held back, then sent
    assert "".join(choice.text for choice in chunks) == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)


def test_each_choice_has_its_own_request_id_and_seed():
    rows = choice_options({"request_id": "abc", "seed": SEEDS - 2, "max_tokens": 5}, 3)
    assert [row["request_id"] for row in rows] == ["abc-0", "abc-1", "abc-2"]
    assert [row["seed"] for row in rows] == [SEEDS - 2, SEEDS - 1, 0]  # choice 0 draws as the n=1 request
    assert choice_options({"request_id": "abc", "seed": None}, 2)[1]["seed"] is None  # unseeded stays unseeded
    assert choice_options({"request_id": "abc", "seed": 4}, 1) == [{"request_id": "abc", "seed": 4}]


def test_n_choices_draw_apart_and_count_the_prompt_once(client):
    # (the same choice of two requests may differ: a row's logits round differently with the rows
    # around it, see docs/serving.md, so choices are compared with their own logprobs)
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 1.0, "seed": 7, "logprobs": True}
    one = client.chat.completions.create(**ask)
    three = client.chat.completions.create(**ask, n=3)
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    assert len({choice.message.content for choice in three.choices}) > 1  # each choice draws its own
    for choice in three.choices:
        assert spelled([e.token for e in choice.logprobs.content], choice.message.content)
        assert choice.finish_reason == ("length" if len(choice.logprobs.content) == 12 else "stop")
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == sum(len(choice.logprobs.content) for choice in three.choices)


def test_n_choices_compute_their_prompt_once(client, served):
    """The choices' rows copy the prompt's cache from the first one's row (worker/serving.py
    `_shares_prefill`, or a running row's prefix when a choice is queued a step later), whichever
    step each is admitted in: the loop computes at most one prompt's worth (a free row holding an
    earlier chat's system prompt saves some more). The loop's figures are its own: a loop that
    started meanwhile counts only this request."""
    before = served.leader.serving_stats(MODEL)
    fresh = [{"role": "user", "content": "A prompt no row holds yet: name three rivers of Europe."}]
    reply = client.chat.completions.create(model=MODEL, messages=fresh, max_tokens=12, temperature=1.0, n=3)
    after = served.leader.serving_stats(MODEL)
    same_loop = after["requests"] >= before.get("requests", 0) + 3
    not_computed = after["reused_tokens"] - (before.get("reused_tokens", 0) if same_loop else 0)
    assert not_computed >= 2 * (reply.usage.prompt_tokens - 1)


def test_streamed_n_choices_interleave_and_end_one_by_one(client):
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "n": 3, "logprobs": 2,
           "stream": True, "stream_options": {"include_usage": True}}
    texts, tokens, ends, usages, order = {}, {}, {}, [], []
    for chunk in client.completions.create(**ask):
        if chunk.usage:
            usages.append(chunk.usage)
            continue
        choice = chunk.choices[0]
        order.append(choice.index)
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
        if choice.finish_reason:
            ends.setdefault(choice.index, []).append(choice.finish_reason)
    assert order != sorted(order)  # the choices' chunks interleave, as their rows decode side by side
    assert sorted(ends) == [0, 1, 2] and all(len(reasons) == 1 for reasons in ends.values())  # one end each
    assert all(spelled(tokens[i], texts[i]) for i in range(3))
    assert len(usages) == 1 and usages[0].completion_tokens == sum(map(len, tokens.values()))


def test_continuous_usage_stats_count_every_chunk_as_vllm_does(client):
    """vLLM's `stream_options.continuous_usage_stats` (guidellm sends it): with include_usage,
    every chunk carries its usage so far, ending at the final usage."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    *content, final = chunks
    counts = [chunk.usage.completion_tokens for chunk in content[1:]]  # past the role chunk
    assert all(chunk.usage.prompt_tokens == final.usage.prompt_tokens for chunk in content)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == final.usage.completion_tokens == 10
    assert not final.choices and content[-1].choices[0].finish_reason == "length"


def test_a_client_leaving_a_stream_of_n_choices_cancels_them_all(client, served):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, n=3, stream=True,
                                       extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.add(chunk.choices[0].index)
        if len(seen) == 3:
            break
    stream.close()
    deadline = time.monotonic() + 3
    while served.leader.serving_stats(MODEL).get("running_rows", 0):
        assert time.monotonic() < deadline, served.leader.serving_stats(MODEL)
        time.sleep(0.05)


def test_echo_starts_the_text_with_the_prompt(client):
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    warm(client.completions.create, **ask)
    plain = client.completions.create(**ask).choices[0].text
    assert client.completions.create(**ask, echo=True).choices[0].text == PROMPT + plain
    chunks = [chunk.choices[0].text for chunk in client.completions.create(**ask, echo=True, stream=True)]
    assert chunks[0] == PROMPT and "".join(chunks) == PROMPT + plain


def test_n_choices_with_tools_are_refused_by_name(client, served):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, tools=[tool])
    assert caught.value.body["param"] == "n", caught.value.body
    assert served.leader.redis.llen(queue_key(MODEL)) == 0


# ---- presence and frequency penalties, logit_bias, min_p, seed -----------------------------


def token_id(text: str) -> int:
    """The one token id that spells `text` (the served model's tokenizer)."""
    ids = load_tokenizer(default_model_path()).encode(text)
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias_bans_or_forces_a_token_of_a_greedy_completion(client, served):
    chosen, logprobs, top = tokens(client, temperature=0)
    banned, banned_logprobs, banned_top = tokens(client, temperature=0, logit_bias={str(token_id(chosen[0])): -100})
    assert chosen[0] not in banned  # -100 bans it everywhere: the second most likely token comes first
    assert banned_top[0][banned[0]] >= max(v for t, v in banned_top[0].items() if t != chosen[0]) - 1e-6
    assert banned_top[0][chosen[0]] == pytest.approx(top[0][chosen[0]], abs=0.2)  # log-probabilities stay the model's
    forced, _, _ = tokens(client, temperature=0, logit_bias={str(token_id(" banana")): 100})
    assert forced == [" banana"] * 12
    producer = Celery("plain-producer", broker=served.broker_url, backend=served.broker_url)
    try:  # the Celery front door takes them too, with a penalty, sampling
        reply = producer.send_task("celerytp.generate", queue="celerytp.srv.requests", kwargs={
            "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 1, "presence_penalty": 1.0,
            "logit_bias": {str(token_id(" banana")): 100}}).get(timeout=60)
    finally:
        producer.close()
    assert reply["token_ids"] == [token_id(" banana")] * 4


def test_presence_and_frequency_penalties_follow_openais_formula(client):
    # seeded: prefilled alike every time, so the greedy answers compare across requests (the
    # prompt's next token is a near tie of " one" and " two")
    greedy, _, _ = tokens(client, temperature=0, seed=0)
    for presence, frequency in ((2.0, 0.0), (0.0, 1.0)):
        chosen, logprobs, top = tokens(client, temperature=0, seed=0, presence_penalty=presence,
                                       frequency_penalty=frequency)
        assert chosen != greedy, (presence, frequency, chosen, top)  # the penalty took effect
        assert chosen[0] == greedy[0]  # on the generated tokens only, not on the prompt's " one two"
        for i, (token, alternatives) in enumerate(zip(chosen, top)):  # the greedy pick under the penalty
            count = Counter(chosen[:i])

            def penalized(t: str, logprob: float, count=count) -> float:
                return logprob - frequency * count[t] - presence * (count[t] > 0)

            best = max(penalized(t, v) for t, v in alternatives.items())
            assert penalized(token, logprobs[i]) >= best - 1e-4, (i, chosen, alternatives)


def test_min_p_one_keeps_only_the_most_likely_token(client):
    wandered = [all(argmax_taken(*tokens(client, temperature=2, seed=seed))) for seed in range(2)]
    assert not all(wandered)  # precondition: at temperature 2 the draw wanders
    for seed in range(2):
        assert all(argmax_taken(*tokens(client, temperature=2, seed=seed, extra={"min_p": 1.0})))


def test_a_seeded_request_gives_the_same_answer_whether_or_not_its_prompt_is_cached(client):
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a short story about a red kite."}],
           "max_tokens": 24, "temperature": 1.0, "seed": 1234, "logprobs": True}
    replies = [client.chat.completions.create(**ask).choices[0] for _ in range(3)]  # cold, then cached
    assert len({reply.message.content for reply in replies}) == 1, [reply.message.content for reply in replies]
    logprobs = [[entry.logprob for entry in reply.logprobs.content] for reply in replies]
    assert logprobs[1] == logprobs[0] and logprobs[2] == logprobs[0]


def test_echo_with_logprobs_lists_the_prompt_tokens_first(client):
    """lm-eval-harness's loglikelihood request: the prompt's tokens come first in the legacy shape
    (the first without a log-probability), and a prompt token's log-probability is the one the
    same token gets when generated after the prompt before it (the int4 kernels round a cold
    prompt and a decode step differently: close, not equal)."""
    prompt = "The capital of France is"
    prompt_ids = load_tokenizer(default_model_path()).encode(prompt)
    reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt) and len(logprobs.tokens) == len(prompt_ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:]) and all(logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]

    plain = client.completions.create(model=MODEL, prompt=prompt, logprobs=1, max_tokens=1, temperature=0)
    generated, generated_logprob = plain.choices[0].logprobs.tokens[0], plain.choices[0].logprobs.token_logprobs[0]
    echoed = client.completions.create(model=MODEL, prompt=prompt + generated, echo=True, logprobs=1, max_tokens=1,
                                       temperature=0).choices[0].logprobs
    assert echoed.tokens[len(prompt_ids)] == generated  # precondition: the prompt tokenizes as before
    assert abs(echoed.token_logprobs[len(prompt_ids)] - generated_logprob) < 0.15


def test_lm_eval_harness_scores_a_batch_of_token_id_prompts(client, served):
    """lm-evaluation-harness's `local-completions` log-likelihood request: a list of token-id
    prompts, `echo`, `max_tokens` 0 and `logprobs`. Each prompt's tokens and log-probabilities
    are those of the same prompt sent alone as text (the model is batch-invariant: to the bit),
    nothing is generated, and /tokenize and /detokenize turn text and ids into each other as the
    server feeds them."""
    texts = ["The capital of France is", "one two three four", "Hello"]
    tokenized = [httpx.post(f"{served.url}/tokenize", json={"model": MODEL, "prompt": t}).json() for t in texts]
    ids = [t["tokens"] for t in tokenized]
    assert ids[0] == load_tokenizer(default_model_path()).encode(texts[0]) and tokenized[0]["count"] == len(ids[0])
    assert tokenized[0]["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"]
    for text, prompt in zip(texts, ids):
        assert httpx.post(f"{served.url}/detokenize", json={"model": MODEL, "tokens": prompt}).json() == {"prompt": text}
    chat = httpx.post(f"{served.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"][-3:] != ids[2][-3:] and chat["count"] > 3  # the chat template rendered around it

    scored = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0)
    assert [c.index for c in scored.choices] == [0, 1, 2]
    assert scored.usage.prompt_tokens == sum(map(len, ids)) and scored.usage.completion_tokens == 0
    for choice, text, prompt in zip(scored.choices, texts, ids):
        alone = client.completions.create(model=MODEL, prompt=text, echo=True, max_tokens=1, logprobs=1,
                                          temperature=0).choices[0]
        assert choice.text == text and choice.finish_reason == "length"
        assert choice.logprobs.tokens == alone.logprobs.tokens[: len(prompt)]
        assert choice.logprobs.token_logprobs == alone.logprobs.token_logprobs[: len(prompt)]

    two_each = client.completions.create(model=MODEL, prompt=texts[1:], n=2, max_tokens=3, temperature=0.8, seed=5)
    assert [c.index for c in two_each.choices] == [0, 1, 2, 3]
    assert two_each.usage.prompt_tokens == len(ids[1]) + len(ids[2])  # each prompt once, not once a choice
    for i, text in enumerate(texts[1:]):  # choice j of prompt i is that prompt's choice j alone
        alone = client.completions.create(model=MODEL, prompt=text, n=2, max_tokens=3, temperature=0.8, seed=5)
        assert [c.text for c in two_each.choices[2 * i : 2 * i + 2]] == [c.text for c in alone.choices]
