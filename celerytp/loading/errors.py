"""The typed error every loading step raises, so a rank can report it as a reply value."""

from __future__ import annotations

from typing import Literal

LoadErrorKind = Literal["bad_request", "load_failed", "unsupported_arch"]


class LoadError(Exception):
    """A model could not be loaded.

    Args:
        kind: "unsupported_arch" when the checkpoint is not a model we can run (bad path,
            unknown model_type or GGUF architecture); "load_failed" when it is one but its
            weights or shapes are wrong, or it cannot be split over this many ranks;
            "bad_request" when the request itself is wrong (an unknown or unexecutable quant).
        message: what went wrong, naming the numbers or names involved.
    """

    def __init__(self, kind: LoadErrorKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: LoadErrorKind = kind
        self.message = message
