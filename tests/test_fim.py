"""Fill-in-the-middle completions (core/fim.py): the form found from the tokenizer's vocabulary, its
prompt tokenized with the markers as their special ids, and `/v1/completions` with `suffix` running
that prompt (a leader that records what it is asked, no cluster). The served default model, which
has no FIM tokens, is tried in tests/test_openai_sampling.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from celerytp.client.generation import GenerationResult
from celerytp.core.errors import CeleryTPError
from celerytp.core.fim import FORMS, fim_form
from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import Tokenizer, load_tokenizer
from celerytp.server.http import create_app
from celerytp.server.schemas import ChatRequest, CompletionRequest, parse
from celerytp.server.service import Service

STARCODER, QWEN = FORMS
PREFIX, SUFFIX = "def area(r):\n    return ", "\n\nprint(area(2.0))\n"


def smollm2() -> Tokenizer:
    return load_tokenizer(default_model_path())


def with_tokens(tokens: tuple[str, ...]) -> Tokenizer:
    """SmolLM2's byte-level BPE with `tokens` added as special tokens, as StarCoder's and
    Qwen2.5-Coder's tokenizer.json hold their FIM tokens."""
    backend = Backend.from_str(smollm2().backend.to_str())
    backend.add_special_tokens(list(tokens))
    return Tokenizer(backend, {0})


def test_smollm2_has_no_fim_tokens():
    tokenizer = smollm2()
    vocabulary = tokenizer.backend.get_vocab()
    assert not [token for token in vocabulary if "fim" in token.lower()]  # its special tokens stop at <empty_output>
    assert fim_form(tokenizer) is None


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.name)
def test_the_fim_prompt_tokenizes_to_the_special_ids_around_the_texts(form):
    tokenizer = with_tokens(form.tokens)
    assert fim_form(tokenizer) == form
    prefix_id, suffix_id, middle_id = (tokenizer.backend.token_to_id(token) for token in form.tokens)
    text = tokenizer.backend  # the reference: each text encoded alone
    expected = [prefix_id, *text.encode(PREFIX).ids, suffix_id, *text.encode(SUFFIX).ids, middle_id]
    assert tokenizer.encode(form.prompt(PREFIX, SUFFIX)) == expected
    assert len({prefix_id, suffix_id, middle_id}) == 3 and min(prefix_id, suffix_id, middle_id) >= 49152


def test_qwen_names_are_not_taken_for_starcoders():
    assert fim_form(with_tokens(QWEN.tokens)) is QWEN
    assert fim_form(with_tokens(STARCODER.tokens[:2])) is None  # all three or none


def test_tokens_that_do_not_encode_whole_are_no_form():
    vocabulary = {"[UNK]": 0, "<": 1, ">": 2, "x": 3, **{token: 4 + i for i, token in enumerate(STARCODER.tokens)}}
    backend = Backend(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # splits "<fim_prefix>" into "<", "fim_prefix", ">"
    plain = Tokenizer(backend, set())
    assert plain.backend.token_to_id("<fim_prefix>") == 4 and plain.encode_rendered("<fim_prefix>") != [4]
    assert fim_form(plain) is None
    backend.add_special_tokens(list(STARCODER.tokens))  # now matched whole in text
    assert fim_form(plain) is STARCODER
    assert fim_form(Tokenizer(Backend(models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]")), set())) is None


def refused(model, body) -> str:
    with pytest.raises(CeleryTPError) as caught:
        parse(model, body)
    return caught.value.message


def test_suffix_needs_text_prompts_and_no_echo():
    body = {"model": "m", "prompt": "a", "suffix": "b"}
    assert parse(CompletionRequest, body).suffix == "b"
    assert parse(CompletionRequest, {**body, "prompt": ["a", "c"]}).prompts == ["a", "c"]
    for prompt in ([5, 6], [[5, 6], [7]]):
        assert refused(CompletionRequest, {**body, "prompt": prompt}).startswith("field 'suffix': needs a text prompt")
    assert refused(CompletionRequest, {**body, "echo": True}) == "field 'suffix': not with \"echo\": true"
    assert parse(CompletionRequest, {**body, "prompt": [5], "echo": True, "suffix": ""}).suffix == ""  # "" is none
    assert refused(CompletionRequest, {**body, "suffix": 5}).startswith("field 'suffix'")
    hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert refused(ChatRequest, {**hi, "suffix": "b"}).startswith("field 'suffix': not supported")  # chat has none
    assert parse(ChatRequest, {**hi, "suffix": None}).messages  # an SDK's default: accepted


class RecordingLeader:
    """A leader with a FIM model and SmolLM2, no cluster: it records each prompt it is asked to
    run and answers MIDDLE, counting the prompt's tokens with the model's tokenizer."""

    group, world_size = "g", 1
    MIDDLE = "3.14159 * r * r"

    def __init__(self, fim_directory: str):
        self.records = {"coder": {"path": fim_directory, "max_context": 2048, "vocab_size": 49155, "replicas": {}},
                        "smol": {"path": str(default_model_path()), "max_context": 2048, "vocab_size": 49152,
                                 "replicas": {}}}
        self.prompts: list[str] = []

    def models(self) -> dict:
        return self.records

    def rebuild_registry(self) -> None:
        pass

    def generate(self, model_id: str, prompt=None, **options) -> GenerationResult:
        self.prompts.append(prompt)
        prompt_tokens = len(load_tokenizer(self.records[model_id]["path"]).encode(prompt))
        return GenerationResult(self.MIDDLE, [1, 2, 3], "stop", prompt_tokens, request_id=options["request_id"])


class LocalService(Service):
    """The real service over RecordingLeader, with no Redis to check ranks in or count in."""

    def require_ranks(self, model_id: str) -> None:
        pass

    def count(self, model_id: str, result: GenerationResult) -> None:
        pass


@pytest.fixture
def api(tmp_path):
    with_tokens(STARCODER.tokens).save(tmp_path / "coder")
    leader = RecordingLeader(str(tmp_path / "coder"))
    return TestClient(create_app(LocalService(leader)), raise_server_exceptions=False), leader


def test_a_completion_with_suffix_runs_the_fim_prompt_and_answers_the_middle(api):
    client, leader = api
    answer = client.post("/v1/completions", json={"model": "coder", "prompt": [PREFIX, "x = "], "suffix": SUFFIX})
    assert answer.status_code == 200, answer.text
    assert sorted(leader.prompts) == sorted([f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>",  # run side by side
                                             f"<fim_prefix>x = <fim_suffix>{SUFFIX}<fim_middle>"])
    reply = answer.json()
    assert [choice["text"] for choice in reply["choices"]] == [RecordingLeader.MIDDLE] * 2  # the middle only
    coder = with_tokens(STARCODER.tokens)
    fim_ids = [coder.encode(STARCODER.prompt(prefix, SUFFIX)) for prefix in (PREFIX, "x = ")]
    assert reply["usage"]["prompt_tokens"] == sum(map(len, fim_ids))  # each prompt's, as the leader counted them


def test_a_model_without_fim_tokens_refuses_a_suffix_by_name(api):
    client, leader = api
    answer = client.post("/v1/completions", json={"model": "smol", "prompt": PREFIX, "suffix": SUFFIX})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "suffix" and "no fill-in-the-middle tokens" in error["message"], error
    assert leader.prompts == []  # nothing asked of the ranks
    plain = client.post("/v1/completions", json={"model": "smol", "prompt": PREFIX, "suffix": ""})
    assert plain.status_code == 200 and leader.prompts == [PREFIX]  # an empty suffix: a plain completion
