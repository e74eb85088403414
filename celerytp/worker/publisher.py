"""Rank 0's publisher thread: a serving step hands over what it has to tell Redis and goes on.

Writing a step's tokens, results, stats, lease renewal and cancellation check is one Redis round
trip: a few hundred microseconds on a quiet host, far more on a slow or remote one, and the whole
group waits for rank 0 at the next plan. Here a thread does the writing: `submit` queues a step's
batch and returns at once with the cancellations the last write saw. The thread writes at most
every 10 ms, every batch waiting merged into one write (fewer round trips, and less time holding
the GIL the loop needs: at 2 ms a TP=1 step was slower than writing in the step), so tokens reach
Redis up to 10 ms later, so a slow Redis delays tokens, not steps; only when `max_pending`
batches wait does `submit` block (bounded memory, and back-pressure).

A write's failure (Redis down past its retry window, a lost lease) is kept and raised by the next
`submit` or `drain`, in the loop's thread, where it ends the loop as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from celerytp.core.errors import CeleryTPError, ErrorKind

B = TypeVar("B")
MAX_PENDING = 256  # steps' batches waiting before a step waits for the writer
WRITE_EVERY_S = 0.01  # at most one write per this: fewer, larger writes, less of the GIL taken from the loop
DRAIN_S = 60.0  # longer than the Redis client's own retry window (core/redis_client.py)


class Publisher(Generic[B]):
    """A writer thread over `write(batches) -> cancelled ids`, which gets every waiting batch at once."""

    def __init__(
        self,
        write: Callable[[list[B]], set[str]],
        max_pending: int = MAX_PENDING,
        name: str = "publisher",
        write_every_s: float = WRITE_EVERY_S,
    ):
        self._write = write
        self._max_pending = max_pending
        self._write_every_s = write_every_s
        self._pending: list[B] = []
        self._writing = False
        self._closed = False
        self._error: BaseException | None = None
        self._cancelled: set[str] = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"celerytp-{name}", daemon=True)
        self._thread.start()

    def submit(self, batch: B) -> set[str]:
        """Queue `batch`; the request ids the last write found cancelled."""
        with self._cond:
            self._wait(lambda: len(self._pending) < self._max_pending, "to take a step's events")
            self._pending.append(batch)
            self._cond.notify_all()
            return self._cancelled

    def drain(self) -> None:
        """Wait until every batch is written; raise a write's failure."""
        with self._cond:
            self._wait(lambda: not self._pending and not self._writing, "to write what the loop made")

    def close(self) -> BaseException | None:
        """Write what waits, stop the thread; the failure that stopped the writing, if any."""
        try:
            self.drain()
        except BaseException as exc:
            return exc
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
        return None

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DRAIN_S
        while not ready() and self._error is None and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        if self._error is not None:
            raise self._error
        if not ready():
            raise CeleryTPError(ErrorKind.BROKER_UNAVAILABLE, f"Redis took over {DRAIN_S:.0f} s {what}")

    def _run(self) -> None:
        next_write = 0.0
        while True:
            with self._cond:
                while not self._closed and (not self._pending or (wait := next_write - time.monotonic()) > 0):
                    self._cond.wait(None if not self._pending else wait)
                if not self._pending:
                    return
                next_write = time.monotonic() + self._write_every_s
                batches, self._pending, self._writing = self._pending, [], True
                self._cond.notify_all()
            try:
                cancelled = self._write(batches)
            except BaseException as exc:  # kept for the loop's thread; nothing more is written
                with self._cond:
                    self._error, self._writing = exc, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._cancelled, self._writing = cancelled, False
                self._cond.notify_all()
