"""When a completion ends: EOS, a stop string, max_tokens. Shared by step mode and fused mode."""

from __future__ import annotations

from collections.abc import Callable


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """`text` cut before the earliest stop string, and that stop string (or None)."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    index, stop = min(hits)
    return text[:index], stop


class StopChecker:
    """Records a completion's tokens and says when it ends.

    Args:
        eos_ids: tokens that end it (not recorded).
        max_tokens: most tokens to record; capped by the context's room after the prompt.
        prompt_tokens: the prompt's length.
        max_context: positions the model's cache holds.
        stops: stop strings; need `decode`.
        decode: token ids -> text.
    """

    def __init__(
        self,
        eos_ids: set[int],
        max_tokens: int,
        prompt_tokens: int,
        max_context: int,
        stops: list[str] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.eos_ids = eos_ids
        room = max_context - prompt_tokens + 1  # the last sampled token is never fed back
        self.max_tokens = min(max_tokens, room)
        self.stops = [s for s in stops or [] if s]
        if self.stops and decode is None:
            raise ValueError("stop strings need a decode function")
        self.decode = decode
        self.token_ids: list[int] = []
        self.matched: str | None = None

    def after(self, token: int) -> str | None:
        """Record `token`; return the finish reason if the completion ends here."""
        if token in self.eos_ids:
            return "stop"
        self.token_ids.append(token)
        if self.stops:
            _, self.matched = cut_at_stop(self.decode(self.token_ids), self.stops)
            if self.matched is not None:
                return "stop"
        if len(self.token_ids) >= self.max_tokens:
            return "length"
        return None
