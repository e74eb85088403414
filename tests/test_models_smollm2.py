"""The real SmolLM2-135M-Instruct Q4_1 GGUF (llama, 9 heads, 3 KV heads, tied embeddings).

Greedy decoding at TP=2 (KV groups split 2 + 1) equals TP=1, and both equal transformers
running the same GGUF weights (read by transformers' own GGUF loader). Logits atol 1e-3:
30 layers of float32 sums in a different order drift more than the tiny models' 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_fixtures import Greedy, Job, assert_matches, gguf_name, hf_greedy, run_job, run_ranks

from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import Tokenizer, load_tokenizer
from celerytp.distributed.tp import TPContext

ATOL = 1e-3
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The file's own metadata (checked against the file in the reference fixture).
SMOLLM2_GGUF_KEYS = {
    "block_count": 30,
    "embedding_length": 576,
    "feed_forward_length": 1536,
    "attention.head_count": 9,
    "attention.head_count_kv": 3,
    "rope.freq_base": 100000.0,
    "context_length": 8192,
    "vocab_size": 49152,
}
SMOLLM2_CONFIG = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(QUESTION)


@pytest.fixture(scope="module")
def reference(prompt: list[int]) -> Greedy:
    """transformers' LlamaForCausalLM on the file's weights, dequantized by the gguf package and
    un-permuted by transformers' own GGUF tensor processor (what from_pretrained(gguf_file=)
    does, minus its slow parses of the tokenizer metadata and name maps)."""
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    reader = gguf.GGUFReader(default_model_path())
    meta = {k: reader.fields[f"llama.{k}"].contents() for k in SMOLLM2_GGUF_KEYS}
    assert meta == SMOLLM2_GGUF_KEYS, meta
    config = LlamaConfig(**SMOLLM2_CONFIG)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    processor = TENSOR_PROCESSORS["llama"](config=config.to_dict())
    names = {gguf_name(n): n for n in model.state_dict() if n != "lm_head.weight"}
    state = {}
    for t in reader.tensors:
        weights = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name).weights
        state[names[t.name]] = torch.from_numpy(weights.copy())
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: the file has no output.weight
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers off the meta device
    return hf_greedy(model.eval(), prompt, use_cache=True)


def test_default_model_path_is_the_packaged_gguf() -> None:
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_tp1_and_tp2_match_transformers(
    tokenizer: Tokenizer, prompt: list[int], reference: Greedy, tmp_path: Path
) -> None:
    job = Job("smollm2", default_model_path(), prompt)
    tp1 = run_job(job, TPContext())
    assert_matches(tp1.greedy, reference, "smollm2 tp=1", atol=ATOL)
    assert "Paris" in tokenizer.decode(tp1.greedy.tokens)
    ranks = run_ranks(2, [job], tmp_path)
    for rank, results in enumerate(ranks):
        tp2 = results["smollm2"]
        assert tp2.greedy.tokens == tp1.greedy.tokens, f"rank {rank}"
        assert_matches(tp2.greedy, reference, f"smollm2 tp=2 rank {rank}", atol=ATOL)
        # 3 KV groups over 2 ranks: 2 + 1 groups of 3 query heads, head_dim 64.
        q_heads, kv_heads = (6, 2) if rank == 0 else (3, 1)
        assert tp2.shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((q_heads + 2 * kv_heads) * 64, 576)
        assert tp2.shapes["model.layers.0.mlp.down_proj.weight"] == (576, 768)
        assert tp2.memory["sharded_bytes"] < tp1.memory["sharded_bytes"]
