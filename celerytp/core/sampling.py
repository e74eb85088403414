"""Sampling parameters as plain data, checked field by field (no torch: the leader builds them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
_MAX_SEED = 2**63 - 1


def _is_number(value: object) -> bool:
    # bool is an int subclass; a JSON `true` is never a valid temperature.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def logit_bias_entries(bias: object) -> dict[int, float] | None:
    """A logit_bias object as {token id: bias}, sorted by id, or None when empty. Its keys are
    token ids, as ints or as the strings of ints (JSON, as OpenAI sends them); its values numbers in
    [-100, 100]. Raises ValueError saying what is wrong (the caller names the field)."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"an object of token id -> bias is required, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    entries = {}
    for key, value in bias.items():
        token = key if _is_int(key) else int(key) if isinstance(key, str) and key.isdecimal() else None
        if token is None or token < 0:
            raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
        if not (_is_number(value) and math.isfinite(value) and -100 <= value <= 100):
            raise ValueError(f"the bias of token {token} must be a number in [-100, 100], got {value!r}")
        entries[token] = float(value)
    return dict(sorted(entries.items())) or None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Args:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep only the k most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1 = all).
        repetition_penalty: CTRL-style penalty on tokens already in the history (1 = none).
        presence_penalty: subtracted from the logit of every token this completion generated
            already (OpenAI's; 0 = none), in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time this completion
            generated it (OpenAI's; 0 = none), in [-2, 2].
        logit_bias: token id -> number in [-100, 100] added to its raw logit (None = none).
        min_p: after temperature, drop tokens less likely than min_p times the most likely one
            (vLLM's; 0 = off), in [0, 1].
        seed: seeds the generator so a request's samples are reproducible; None = unseeded.
        logprobs: how many top log-probabilities to report per token (0 = none).

    Raises ValueError naming the field for a wrong type or an out-of-range value.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_number(value) and -2 <= value <= 2, name, "a number in [-2, 2]")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        try:
            object.__setattr__(self, "logit_bias", logit_bias_entries(self.logit_bias))
        except ValueError as exc:
            raise ValueError(f"logit_bias: {exc}") from None
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

    @property
    def penalizes_generated(self) -> bool:
        """Whether the presence or frequency penalty is on (they count this completion's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def reshapes_logits(self) -> bool:
        """Whether a penalty, a bias or min_p changes the logits before the draw: the row needs its
        whole logits (worker/sampling.py `slice_mode`), greedy or not, as the argmax may move."""
        return (self.repetition_penalty != 1.0 or self.penalizes_generated or self.logit_bias is not None
                or (self.min_p > 0 and not self.greedy))  # min_p never drops the argmax

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
