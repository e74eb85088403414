"""Request checks shared by the leader (before sending) and the ranks (before any collective).

Each raises CeleryTPError(bad_request) naming the field, so a request refused on the leader
and one refused on a rank read the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.sampling import SamplingParams

PREFILL_CHUNK = 512  # prompt tokens per forward: bounds a prefill's activation memory


def bad_request(field: str, problem: str) -> CeleryTPError:
    return CeleryTPError(ErrorKind.BAD_REQUEST, f"field '{field}': {problem}")


def check_tokens(ids: Sequence[int], *, max_context: int, vocab_size: int, field: str, offset: int = 0) -> None:
    """Token ids at positions offset.. must fit the context and the vocabulary."""
    if not ids:
        raise bad_request(field, "no tokens")
    end = offset + len(ids)
    if end > max_context:
        raise bad_request(field, f"{end} tokens exceed the context limit {max_context}")
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise bad_request(field, f"ids {outside[:5]} are outside the vocabulary of {vocab_size}")


def sampling_params(fields: Mapping[str, Any] | None, field: str = "sampling") -> SamplingParams:
    """SamplingParams from a JSON object, a bad field named as bad_request."""
    try:
        return SamplingParams.from_dict(fields or {})
    except (TypeError, ValueError) as exc:
        raise bad_request(field, str(exc)) from None


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias may only name tokens of the vocabulary (checked where the prompt's ids are)."""
    outside = [t for t in params.logit_bias or {} if t >= vocab_size]
    if outside:
        raise bad_request("logit_bias", f"token ids {outside[:5]} are outside the vocabulary of {vocab_size}")


def refuse_step_penalties(params: SamplingParams) -> None:
    """Step mode feeds prompt and generated tokens alike, so it cannot count what a completion
    generated: the presence and frequency penalties are the serving loop's (fused mode) only."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name) != 0:
            raise bad_request(name, "not available in step mode (it cannot tell generated tokens from the "
                                    "prompt's); use fused mode")


def prefill_chunks(length: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """(start, end) of each prefill chunk of a `length`-token prompt."""
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]
