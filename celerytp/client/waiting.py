"""Waiting for an op's combined reply: with a deadline, watching the ranks' heartbeats, and
naming every rank that failed, died or did not answer."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import allow_join_result

from celerytp.client.dispatch import ChordPublisher, PublishedChord
from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.liveness import HeartbeatTiming, RankWatch, read_owners

LIVENESS_CHECK_S = 0.25  # how often a waiting op looks at the ranks' heartbeats


def no_worker(op: str, ranks: list[int], why: str) -> CeleryTPError:
    return CeleryTPError.from_failures(op, [RankFailure(r, ErrorKind.RANK_LOST, why) for r in ranks])


class _RanksLost(Exception):
    def __init__(self, lost: dict[int, str]):
        self.lost = lost


class ChordWaiter:
    """Waits for chords of one group (thread-safe: Celery's result backend is per thread)."""

    def __init__(
        self, app: Celery, client: redis.Redis, group: str, world_size: int, publisher: ChordPublisher,
        timing: HeartbeatTiming,
    ):
        self.app = app
        self.redis = client
        self.group = group
        self.world_size = world_size
        self._publisher = publisher
        self._timing = timing

    def wait(
        self, op: str, sent: PublishedChord, timeout: float, on_wait: Callable[[], None] | None, owners: list
    ) -> dict:
        watch = RankWatch(self.redis, self.group, owners, self._timing)
        checked = [time.monotonic()]

        def on_interval() -> None:
            if on_wait is not None:
                on_wait()
            if time.monotonic() - checked[0] >= LIVENESS_CHECK_S:
                checked[0] = time.monotonic()
                lost = watch.lost()
                if lost:
                    finished = self._publisher.finished_parts(sent)
                    lost = {r: why for r, why in lost.items() if r not in finished}
                if lost:
                    raise _RanksLost(lost)

        try:
            # Allowed inside a task (the celerytp.generate front door): the chord runs on the rank
            # workers, never on the pool that waits for it.
            with allow_join_result():
                return self.app.AsyncResult(sent.body_id).get(timeout=timeout, interval=0.005, on_interval=on_interval)
        except _RanksLost as exc:
            failures = [RankFailure(r, ErrorKind.RANK_LOST, why) for r, why in sorted(exc.lost.items())]
            raise CeleryTPError.from_failures(op, failures) from None
        except CeleryTimeout:
            raise CeleryTPError.from_failures(op, self._unfinished_ranks(sent, timeout)) from None
        except Exception as exc:  # a header task raised or its worker died
            raise CeleryTPError.from_failures(op, self._failed_ranks(sent, exc)) from None
        finally:
            self.redis.delete(self.app.backend.get_key_for_task(sent.body_id))

    def _unfinished_ranks(self, sent: PublishedChord, timeout: float) -> list[RankFailure]:
        """Name the ranks that did not answer (and whether their worker lives) and those that failed."""
        finished = self._publisher.finished_parts(sent)
        alive = read_owners(self.redis, self.group, self.world_size)
        failures = []
        for rank in range(self.world_size):
            if rank in finished:
                _, reply = finished[rank]
                if isinstance(reply, dict) and reply.get("type") == "error":
                    failures.append(RankFailure(rank, ErrorKind(reply["kind"]), reply.get("message", "")))
            elif alive[rank] is None:
                failures.append(RankFailure(rank, ErrorKind.RANK_LOST, "no live worker holds this rank"))
            else:
                failures.append(RankFailure(rank, ErrorKind.TIMEOUT, f"no reply within {timeout:.1f}s (worker alive: busy or stuck)"))
        return failures or [RankFailure(None, ErrorKind.TIMEOUT, f"no combined reply within {timeout:.1f}s")]

    def _failed_ranks(self, sent: PublishedChord, exc: Exception) -> list[RankFailure]:
        failures = [
            RankFailure(rank, ErrorKind.RANK_LOST, f"task failed: {result}")
            for rank, (state, result) in sorted(self._publisher.finished_parts(sent).items())
            if state != "SUCCESS"
        ]
        return failures or [RankFailure(None, ErrorKind.INTERNAL, f"chord failed: {exc!r}")]
