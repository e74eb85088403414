"""Error kinds and the one exception type every celerytp failure is raised as."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ErrorKind(StrEnum):
    BAD_REQUEST = "bad_request"
    NOT_INITIALISED = "not_initialised"
    INIT_FAILED = "init_failed"
    SANITY_FAILED = "sanity_failed"
    DEVICE_UNAVAILABLE = "device_unavailable"
    OUT_OF_ORDER = "out_of_order"
    TIMEOUT = "timeout"
    RANK_LOST = "rank_lost"
    GROUP_BROKEN = "group_broken"  # the process group failed while every process lives: re-form it
    ALREADY_LOADED = "already_loaded"
    LOAD_FAILED = "load_failed"
    UNSUPPORTED_ARCH = "unsupported_arch"
    MODEL_NOT_LOADED = "model_not_loaded"
    FORWARD_FAILED = "forward_failed"
    OVERLOADED = "overloaded"
    BROKER_UNAVAILABLE = "broker_unavailable"  # Redis stayed unreachable past the retry window
    BROKER_AUTH_FAILED = "broker_auth_failed"  # Redis refused the password (or user) of the broker URL
    RETRIES_EXHAUSTED = "retries_exhausted"  # a request's group failed under it on every attempt
    INTERNAL = "internal"


@dataclass(frozen=True)
class RankFailure:
    """One failing party of an op: a rank, or the leader itself (`rank` None)."""

    rank: int | None
    kind: ErrorKind
    message: str

    def __str__(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "leader"
        return f"{who} [{self.kind}]: {self.message}"


class CeleryTPError(Exception):
    """A failure with a kind and a message, raised on the leader and the ranks alike.

    An op that failed on several ranks lists each in `failures`; a failure found in one
    place (a bad argument on the leader, a rank's own check) has one failure with no rank.

    Args:
        kind: what kind of failure (an ErrorKind or its string).
        message: what went wrong, naming the field or numbers involved.
        op: the op that failed, when there is one.
    """

    def __init__(self, kind: ErrorKind | str, message: str, *, op: str | None = None):
        self.kind = ErrorKind(kind)
        self.message = message
        self.op = op
        self.failures = [RankFailure(None, self.kind, message)]
        super().__init__(f"{op} failed: {self.failures[0]}" if op else f"[{self.kind}] {message}")

    @classmethod
    def from_failures(cls, op: str, failures: list[RankFailure]) -> CeleryTPError:
        """The error of an op that failed on these ranks; its kind is the first failure's."""
        error = cls(failures[0].kind, "; ".join(str(f) for f in failures), op=op)
        error.failures = list(failures)
        error.args = (f"{op} failed: {error.message}",)
        return error

    @property
    def kinds(self) -> set[ErrorKind]:
        return {f.kind for f in self.failures}
