"""A deadline on every read of a model file while a load runs: a file on a stalled file system
(a network mount that stopped answering) fails the load, typed, on its rank, and the group rolls
the load back and stays up, instead of the rank's op thread hanging in a read it cannot leave.

A read blocked in the kernel (a page fault of a memory map, a read(2)) cannot be interrupted from
Python, so each read runs in a helper thread that the load waits for: past the deadline the load
gives up on it, and the helper, still blocked, ends whenever the file system answers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from celerytp.core.errors import CeleryTPError, ErrorKind

DEFAULT_READ_DEADLINE_S = 60.0  # one read: a tensor's slice of this rank, a header, a small file
T = TypeVar("T")
_current = threading.local()  # the deadline of the load this thread runs, if any


@contextlib.contextmanager
def read_deadline(seconds: float) -> Iterator[None]:
    """Reads in this thread (`within`) take at most `seconds` each until the block ends."""
    saved = getattr(_current, "seconds", None)
    _current.seconds = seconds
    try:
        yield
    finally:
        _current.seconds = saved


def within(what: str, read: Callable[[], T]) -> T:
    """`read()`, under the running load's deadline (at once where none runs). Past it:
    CeleryTPError(load_failed) naming `what`."""
    seconds = getattr(_current, "seconds", None)
    if seconds is None:
        return read()
    outcome: list = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, read()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting load
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="celerytp-model-read", daemon=True).start()
    if not done.wait(seconds):
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"reading {what} took over {seconds:g} s (a stalled file system?): "
                                                   "load abandoned")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
