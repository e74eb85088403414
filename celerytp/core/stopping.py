"""When a completion ends: EOS, a stop string, max_tokens. Shared by step mode and fused mode."""

from __future__ import annotations

from collections.abc import Callable

from celerytp.core.detokenize import IncrementalText


def cut_at_stop(text: str, stops: list[str], start: int = 0) -> tuple[str, str | None]:
    """`text` cut before the earliest stop string, and that stop string (or None).

    The search begins at `start`: the caller knows the text before it holds none.
    """
    hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
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
        self.token_ids: list[int] = []
        self.matched: str | None = None
        # Only the text new since the last search, and the stops' reach back into the old, is searched.
        self._text = IncrementalText(decode) if self.stops else None
        self._searched = 0  # characters of the text searched so far
        self._reach = max(map(len, self.stops), default=1) - 1

    def resume(self, token_ids: list[int]) -> None:
        """Record the tokens an earlier attempt decoded; the next token's search covers their text too."""
        self.token_ids = list(token_ids)
        if self._text is not None:
            for token in token_ids:
                self._text.feed(token)

    def after(self, token: int) -> str | None:
        """Record `token`; return the finish reason if the completion ends here."""
        if token in self.eos_ids:
            return "stop"
        self.token_ids.append(token)
        if self._text is not None:
            self._text.feed(token)
            text = self._text.text
            if len(text) > self._searched:
                _, self.matched = cut_at_stop(text, self.stops, max(0, self._searched - self._reach))
                self._searched = len(text)
                if self.matched is not None:
                    return "stop"
        if len(self.token_ids) >= self.max_tokens:
            return "length"
        return None
