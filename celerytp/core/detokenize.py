"""Text of a growing token sequence, for the cost of decoding a few tokens per token.

Stop strings (rank 0's serving loop) and streamed deltas (the leader) need the completion's text
after every token; decoding the whole completion each time costs O(length) per token. Decoding
only a window of the last tokens is not enough on its own: a decoder may treat the window's first
token differently (sentencepiece's leading space) and a byte-level BPE token may end inside a
UTF-8 sequence. So, as vLLM's `detokenize_incrementally` and TGI's `decode_token` do, decode the
window from `prefix_offset` twice, with and without the tokens after `read_offset`, and keep the
difference; text ending in U+FFFD (an incomplete UTF-8 sequence) stays open until it completes.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


class IncrementalText:
    """The text of the tokens fed so far: `text` equals `decode(ids)` less any trailing U+FFFD.

    Args:
        decode: token ids -> text (`Tokenizer.decode`).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # the window decoded starts here: context for the tokens after read_offset
        self._read_offset = 0  # the text of the tokens before it is final
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._open = 0  # characters of the text after read_offset already in `text`

    def feed(self, token_id: int) -> str:
        """Append a token; return the text it completes (may be "")."""
        self.ids.append(token_id)
        new = self.decode(self.ids[self._prefix_offset :])[len(self._prefix_text) :]
        complete = new.rstrip(REPLACEMENT)
        delta = complete[self._open :]
        self.text += delta
        if complete and len(complete) == len(new):  # ends on a whole character: close the window
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._prefix_text = self.decode(self.ids[self._prefix_offset : self._read_offset])
            self._open = 0
        else:
            self._open += len(delta)
        return delta

    @property
    def settled(self) -> int:
        """How many of the ids have their text final in `text` (the rest end in an open sequence)."""
        return self._read_offset
