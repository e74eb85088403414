"""Every architecture loads and answers at TP=2 through a real cluster, as transformers would.

Run: python benchmarks/architectures.py [--tokens 24] [--only mistral,gemma3_text]
For each architecture a random checkpoint (float32, 4 layers, hidden 256, vocab 2048; sliding
windows of 16 so prompt + decode cross them) is saved with transformers' save_pretrained. One
LocalCluster (private Redis, two rank workers on a gloo group) loads each in turn and serves one
greedy request through the serving loop; its tokens are compared with transformers' greedy
decoding of the same weights. Prints one line per architecture and JSON: load seconds, decode
tokens/s and whether the tokens match.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

COMMON = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=512, max_position_embeddings=512, head_dim=32)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
# model_type -> (transformers config class, causal LM class, config kwargs beyond COMMON)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 16, "query_pre_attn_scalar": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
}


def make_checkpoint(model_type: str, directory: Path) -> Any:
    import transformers

    config_cls, model_cls, extra = ARCHITECTURES[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # wide weights: greedy without near-ties
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@torch.inference_mode()
def transformers_greedy(model: Any, prompt: list[int], tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return out[0, len(prompt) :].tolist()


def serve_one(leader: Any, name: str, path: Path, prompt: list[int], tokens: int, reference: list[int]) -> dict:
    """Load at TP=2, serve one greedy request, unload; a refusal is reported, not raised."""
    from celerytp.core.errors import CeleryTPError

    started = time.perf_counter()
    try:
        leader.load(name, path, max_batch=2, idle_s=30)
    except CeleryTPError as exc:
        return {"model_type": name, "tp": 2, "error": str(exc), "line": f"{name:12s} TP=2 refused: {exc}"}
    loaded = time.perf_counter() - started
    try:
        row = leader.submit(name, {"request_id": f"bench-{name}", "prompt": prompt, "max_tokens": tokens}).result(300)
    finally:
        leader.unload(name)
    speed = round((len(row.token_ids) - 1) / row.decode_s, 1) if row.decode_s else None
    match = row.token_ids == reference
    line = f"{name:12s} TP=2 loaded in {loaded:5.2f} s, {speed} tok/s, tokens match transformers: {match}"
    return {"model_type": name, "tp": 2, "load_s": round(loaded, 2), "decode_tok_s": speed,
            "tokens_match_transformers": match, "line": line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ARCHITECTURES)
    from celerytp.cluster import LocalCluster

    prompt = torch.randint(0, COMMON["vocab_size"], (12,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        references = {}
        for name in names:
            model = make_checkpoint(name, Path(tmp) / name)
            references[name] = transformers_greedy(model, prompt, args.tokens)
        with LocalCluster(world_size=2, group="arch", model_roots=[tmp]) as cluster:
            leader = cluster.leader
            for name in names:
                results.append(serve_one(leader, name, Path(tmp) / name, prompt, args.tokens, references[name]))
                print(results[-1]["line"], flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
