"""Next-token sampling as small pure functions (gpt-fast style) with a seeded generator."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from celerytp.core.sampling import SamplingParams


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator seeded with `seed`, or None (use the global RNG) when seed is None."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def apply_repetition_penalty(logits: torch.Tensor, history: Iterable[int], penalty: float) -> torch.Tensor:
    """Make tokens in `history` less likely: positive logits / penalty, negative * penalty."""
    ids = sorted(set(history))
    if penalty == 1.0 or not ids:
        return logits
    out = logits.clone()
    index = torch.tensor(ids, dtype=torch.long, device=logits.device)
    seen = out[..., index]
    out[..., index] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(V,) logits -> (V,) probabilities after temperature, top-k and top-p filtering."""
    logits = logits.float() / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]  # (1,)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (V,) probability ranked above each
        drop_sorted = mass_before >= top_p  # never drops the most likely token (mass 0 above it)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: Iterable[int] = (),
) -> int:
    """Pick the next token from (V,) logits; temperature 0 is argmax."""
    logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)  # a CPU generator cannot draw for CUDA tensors
    return int(torch.multinomial(probs, num_samples=1, generator=generator))


def top_logprobs(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens under the model (raw logits) with their log-probabilities."""
    if k <= 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """Log-probability of `token` under the model (raw logits)."""
    return float(torch.log_softmax(logits.float(), dim=-1)[token])
