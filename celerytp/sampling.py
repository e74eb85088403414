"""Next-token sampling as small pure functions (gpt-fast style) with a seeded generator."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

MAX_LOGPROBS = 20
_MAX_SEED = 2**63 - 1


def _is_number(value: object) -> bool:
    # bool is an int subclass; a JSON `true` is never a valid temperature.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Args:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep only the k most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1 = all).
        repetition_penalty: CTRL-style penalty on tokens already in the history (1 = none).
        seed: seeds the generator so a request's samples are reproducible; None = unseeded.
        logprobs: how many top log-probabilities to report per token (0 = none).

    Raises ValueError naming the field for a wrong type or an out-of-range value.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        t, p, rp = self.temperature, self.top_p, self.repetition_penalty
        check(_is_number(t) and math.isfinite(t) and t >= 0, "temperature", "a finite number >= 0")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0")
        check(_is_number(p) and 0 < p <= 1, "top_p", "a number in (0, 1]")
        check(_is_number(rp) and math.isfinite(rp) and rp > 0, "repetition_penalty", "a finite number > 0")
        check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= _MAX_SEED),
            "seed",
            f"null or an integer in 0..{_MAX_SEED}",
        )
        check(
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"an integer in 0..{MAX_LOGPROBS}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON object, rejecting unknown keys and wrong types."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling params: {', '.join(map(str, unknown))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
