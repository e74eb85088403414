"""Sampling parameters as plain data, checked field by field (no torch: the leader builds them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

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
