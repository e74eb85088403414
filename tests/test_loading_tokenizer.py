"""Tokenizers from the SmolLM2 GGUF metadata and from a Hugging Face directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from celerytp.loading import default_model_path
from celerytp.models import LoadError
from celerytp.sampling import SamplingParams
from celerytp.tokenizer import clear_tokenizer_cache, load_tokenizer, tokenizer_cache_dir

CHAT = [{"role": "user", "content": "What is 2+2?"}]
EXPECTED_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CELERYTP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "celerytp_cache"))
    clear_tokenizer_cache()  # other test modules may have loaded the same path
    yield
    clear_tokenizer_cache()


def test_gguf_tokenizer_and_chat_template() -> None:
    tok = load_tokenizer(default_model_path())
    assert load_tokenizer(default_model_path()) is tok  # cached per path
    ids = tok.apply_chat_template(CHAT)
    assert ids[:2] == [1, 9690] and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>system ... assistant\n
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED_CHAT
    assert tok.decode(tok.encode("Hello, world! Paris")) == "Hello, world! Paris"
    assert 2 in tok.eos_token_ids  # <|im_end|>
    assert tok.generation_defaults == {}


def test_gguf_conversion_is_kept_on_disk() -> None:
    first = load_tokenizer(default_model_path())
    assert list(tokenizer_cache_dir().glob("*/tokenizer.json"))
    clear_tokenizer_cache()
    again = load_tokenizer(default_model_path())  # now from the saved conversion
    assert again is not first
    assert again.apply_chat_template(CHAT) == first.apply_chat_template(CHAT)
    assert again.eos_token_ids == first.eos_token_ids
    text = "Tokenizers: ünïcödé, numbers 12345, code `x = f(y)`."
    assert again.encode(text) == first.encode(text)


def test_hf_directory_tokenizer_and_generation_defaults(tmp_path: Path) -> None:
    gguf_tok = load_tokenizer(default_model_path())
    gguf_tok.backend.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    generation = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "eos_token_id": [2, 0],
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template(CHAT) == gguf_tok.apply_chat_template(CHAT)
    assert tok.eos_token_ids == {0, 2}
    assert tok.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    SamplingParams.from_dict(tok.generation_defaults)  # the defaults are valid sampling params
    # Without do_sample transformers decodes greedily, so temperature/top_p are not defaults.
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "do_sample": False}))
    clear_tokenizer_cache()
    assert load_tokenizer(tmp_path).generation_defaults == {"repetition_penalty": 1.1}


def test_bad_tokenizer_path(tmp_path: Path) -> None:
    with pytest.raises(LoadError) as err:
        load_tokenizer(tmp_path / "missing")
    assert err.value.kind == "unsupported_arch"
    with pytest.raises(LoadError) as err:
        load_tokenizer(tmp_path)  # a directory with no tokenizer
    assert err.value.kind == "load_failed"
