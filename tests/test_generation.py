"""Generation through step chords on the real default model (SmolLM2-135M-Instruct, GGUF Q4_1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from celerytp import CeleryTPError
from celerytp.cluster import LocalCluster
from celerytp.core.errors import ErrorKind
from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_tp2():
    with LocalCluster(world_size=2, group="smol2") as cluster:
        cluster.leader.load("smol", None, quant="f32")  # None: the default model; f32: exact float
        yield cluster.leader


@pytest.fixture(scope="module")
def smol_tp1():
    with LocalCluster(world_size=1, group="smol1") as cluster:
        cluster.leader.load("smol", default_model_path(), quant="f32")
        yield cluster.leader


def test_greedy_tp2_uneven_equals_tp1(smol_tp1, smol_tp2):
    # 9 heads / 3 KV groups over 2 ranks: an uneven split (2 groups + 1 group).
    one = smol_tp1.generate("smol", prompt=PROMPT, max_tokens=24, temperature=0)
    two = smol_tp2.generate("smol", prompt=PROMPT, max_tokens=24, temperature=0)
    assert one.token_ids == two.token_ids
    assert one.text == two.text and len(one.token_ids) == 24 and one.finish_reason == "length"
    assert one.prompt_tokens == len(load_tokenizer(default_model_path()).encode(PROMPT))


def test_chat_answer_is_real_and_stops_on_end_of_turn(smol_tp2):
    result = smol_tp2.generate("smol", messages=CHAT, max_tokens=64, temperature=0)
    assert "Paris" in result.text
    assert result.finish_reason == "stop" and len(result.token_ids) < 64
    assert result.ttft_s > 0 and result.decode_s > 0 and result.tokens_per_s > 0


def test_seeded_sampling_is_reproducible(smol_tp1, smol_tp2):
    options = dict(prompt=PROMPT, max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)
    a = smol_tp2.generate("smol", seed=11, **options)
    b = smol_tp2.generate("smol", seed=11, **options)
    c = smol_tp1.generate("smol", seed=11, **options)
    d = smol_tp2.generate("smol", seed=12, **options)
    assert a.token_ids == b.token_ids == c.token_ids
    assert d.token_ids != a.token_ids


def test_logit_bias_and_min_p_sample_alike_in_step_and_fused_mode(smol_tp2):
    options = dict(prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3, min_p=0.05, logit_bias={"284": 3.0})
    fused = smol_tp2.generate("smol", **options)
    assert fused.token_ids == smol_tp2.generate("smol", mode="step", **options).token_ids
    assert fused.token_ids != smol_tp2.generate("smol", **{**options, "logit_bias": None}).token_ids


def test_stop_strings_truncate(smol_tp2):
    full = smol_tp2.generate("smol", prompt=PROMPT, max_tokens=24, temperature=0)
    word = full.text.split()[2]
    cut = smol_tp2.generate("smol", prompt=PROMPT, max_tokens=24, temperature=0, stop=[word])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(word)]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_generate_bad_input(smol_tp2):
    # Checked on the leader, typed like the ranks' own checks.
    for options, field in [
        (dict(prompt=PROMPT, messages=CHAT), "prompt"),
        (dict(prompt=PROMPT, temperature=-1), "temperature"),
        (dict(prompt=PROMPT, max_tokens=0), "max_tokens"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=PROMPT, stop=[1]), "stop"),
        (dict(prompt=PROMPT, logit_bias={10**7: 1}), "logit_bias"),  # outside the vocabulary
        (dict(prompt=PROMPT, mode="step", presence_penalty=0.5), "presence_penalty"),  # fused mode only
    ]:
        with pytest.raises(CeleryTPError) as info:
            smol_tp2.generate("smol", **options)
        assert info.value.kinds == {ErrorKind.BAD_REQUEST} and field in str(info.value), options
    with pytest.raises(CeleryTPError) as info:
        smol_tp2.generate("missing", prompt=PROMPT)
    assert info.value.kinds == {ErrorKind.MODEL_NOT_LOADED}
    with pytest.raises(CeleryTPError) as info:
        smol_tp2.generate("smol", prompt="word " * 9000, max_tokens=1)
    assert info.value.kinds == {ErrorKind.BAD_REQUEST} and "context limit" in str(info.value)
    assert smol_tp2.generate("smol", prompt=PROMPT, max_tokens=2).completion_tokens == 2


def test_cli_generate_json_on_the_default_model():
    proc = subprocess.run(
        [sys.executable, "-m", "celerytp", "generate", "--prompt", "What is the capital of France?",
         "--tp", "2", "--max-tokens", "16", "--temperature", "0", "--quant", "f32", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert "Paris" in result["text"]
    assert {"text", "token_ids", "finish_reason", "tokens_per_s"} <= set(result)


CLIENT_WITHOUT_TORCH = """
import importlib.abc, json, sys

class Refuse(importlib.abc.MetaPathFinder):  # as if only the base install (no [worker] extra) were present
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "safetensors"}:
            raise ImportError(f"{name} is not installed in a client-only install")

sys.meta_path.insert(0, Refuse())
from celerytp import Leader

leader = Leader(sys.argv[1], sys.argv[2], 2)
result = leader.generate("smol", prompt=sys.argv[3], max_tokens=8, temperature=0)
stream = leader.stream("smol", prompt=sys.argv[3], max_tokens=8, temperature=0)
print(json.dumps({"ids": result.token_ids, "streamed": "".join(stream), "text": result.text}))
"""


def test_a_client_without_torch_submits_to_running_workers(smol_tp2):
    out = subprocess.run(
        [sys.executable, "-c", CLIENT_WITHOUT_TORCH, smol_tp2.broker_url, smol_tp2.group, PROMPT],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout)
    here = smol_tp2.generate("smol", prompt=PROMPT, max_tokens=8, temperature=0)
    assert seen["ids"] == here.token_ids and seen["streamed"] == seen["text"] == here.text
