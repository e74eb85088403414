"""Tokenizers from GGUF metadata and Hugging Face directories, checked against transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.gguf_metadata import read_gguf_metadata
from celerytp.core.model_files import default_model_path
from celerytp.core.sampling import SamplingParams
from celerytp.core.tokenizer import clear_tokenizer_cache, load_tokenizer

CHAT = [{"role": "user", "content": "What is 2+2?"}]
EXPECTED_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)
TEXTS = [
    "Hello, world! Paris",
    "Tokenizers: ünïcödé, numbers 12345, code `x = f(y)`.",
    "  leading spaces\n\ttabs and\r\nnewlines   ",
    "Emojis 😀🎉 and CJK 漢字かな, Ελληνικά, العربية",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
    "it's we'll they'd I'M 3.14159 1e-10 $100,000",
    "",
]
CHATS = [
    CHAT,
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2, 3"},
        {"role": "user", "content": "Again, in French — s'il vous plaît."},
    ],
]


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    clear_tokenizer_cache()  # other test modules may have loaded the same path
    yield
    clear_tokenizer_cache()


@pytest.fixture(scope="module")
def reference():
    """transformers' own tokenizer of the SmolLM2 GGUF: the independent reference."""
    from transformers import AutoTokenizer

    path = Path(default_model_path())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def test_gguf_metadata_matches_the_gguf_package() -> None:
    ours = read_gguf_metadata(default_model_path())
    fields = gguf.GGUFReader(default_model_path()).fields
    theirs = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value, key


def test_corrupt_gguf_metadata_is_load_failed(tmp_path: Path) -> None:
    data = Path(default_model_path()).read_bytes()[:4096]
    for name, content in [("short.gguf", data[:100]), ("cut.gguf", data), ("magic.gguf", b"GGUF" + b"\xff" * 64)]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CeleryTPError) as err:
            read_gguf_metadata(tmp_path / name)
        assert err.value.kind is ErrorKind.LOAD_FAILED and name in str(err.value)


def test_gguf_tokenizer_matches_transformers(reference) -> None:
    tok = load_tokenizer(default_model_path())
    assert load_tokenizer(default_model_path()) is tok  # cached per path
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
    for chat in CHATS:
        expected = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert tok.apply_chat_template(chat) == list(expected)
    assert tok.decode(tok.apply_chat_template(CHAT), skip_special_tokens=False) == EXPECTED_CHAT
    assert tok.eos_token_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert tok.generation_defaults == {}


def test_hf_directory_tokenizer_and_generation_defaults(tmp_path: Path, reference) -> None:
    reference.save_pretrained(tmp_path)  # transformers writes the directory
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
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == load_tokenizer(default_model_path()).apply_chat_template(chat)
    assert [tok.encode(t) for t in TEXTS] == [reference.encode(t) for t in TEXTS]
    assert tok.eos_token_ids == {0, 2}
    assert tok.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    SamplingParams.from_dict(tok.generation_defaults)  # the defaults are valid sampling params
    # Without do_sample transformers decodes greedily, so temperature/top_p are not defaults.
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "do_sample": False}))
    clear_tokenizer_cache()
    assert load_tokenizer(tmp_path).generation_defaults == {"repetition_penalty": 1.1}


def test_template_errors_and_missing_templates_are_bad_request(tmp_path: Path) -> None:
    tok = load_tokenizer(default_model_path())
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('only user turns') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CeleryTPError) as err:
        load_tokenizer(tmp_path).apply_chat_template(CHAT)
    assert err.value.kind is ErrorKind.BAD_REQUEST and "only user turns" in str(err.value)
    clear_tokenizer_cache()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(CeleryTPError) as err:
        load_tokenizer(tmp_path).apply_chat_template(CHAT)
    assert err.value.kind is ErrorKind.BAD_REQUEST and "no chat template" in str(err.value)


def test_tokenizer_loads_without_torch() -> None:
    code = (
        "import sys\n"
        "from celerytp.core.model_files import default_model_path\n"
        "from celerytp.core.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer(default_model_path())\n"
        "assert tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_bad_tokenizer_path(tmp_path: Path) -> None:
    with pytest.raises(CeleryTPError) as err:
        load_tokenizer(tmp_path / "missing")
    assert err.value.kind == "unsupported_arch"
    with pytest.raises(CeleryTPError) as err:
        load_tokenizer(tmp_path)  # a directory with no tokenizer
    assert err.value.kind == "load_failed"
