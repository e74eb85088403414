"""Static batching on the leader: requests that wait at the same time go out as one chord."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from celerytp.core.protocol import RowResult

RunBatch = Callable[[str, list[dict[str, Any]]], list[RowResult]]


class Batcher:
    """Collects fused-generation requests from any number of threads.

    One daemon thread sends every request waiting for the same model (up to that model's
    batch rows) as one `generate` chord, resolves their futures, and repeats; requests that
    arrive meanwhile wait for the next batch. After the first request of a batch arrives it
    waits `window_s` for others, so requests sent together are not split into a batch of one
    and a batch of the rest.

    Args:
        run: sends one batch and returns its rows.
        capacity: the most requests one batch of a model may hold.
        window_s: how long a batch stays open after its first request.
    """

    def __init__(self, run: RunBatch, capacity: Callable[[str], int], window_s: float = 0.01):
        self._run = run
        self._capacity = capacity
        self._window_s = window_s
        self._pending: list[tuple[str, dict[str, Any], Future]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, model_id: str, spec: dict[str, Any]) -> Future:
        future: Future = Future()
        with self._wake:
            self._pending.append((model_id, spec, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="celerytp-batcher", daemon=True)
                self._thread.start()
            self._wake.notify()
        return future

    def _next_batch(self) -> tuple[str, list[tuple[str, dict[str, Any], Future]]]:
        with self._wake:
            while not self._pending:
                self._wake.wait()
        time.sleep(self._window_s)  # let requests sent at the same moment join
        with self._wake:
            model_id = self._pending[0][0]
            same = [item for item in self._pending if item[0] == model_id]
        try:
            limit = max(1, self._capacity(model_id))
        except Exception:  # an unknown model: let the op report it
            limit = 1
        batch = same[:limit]
        with self._wake:
            for item in batch:
                self._pending.remove(item)
        return model_id, batch

    def _loop(self) -> None:
        while True:
            model_id, batch = self._next_batch()
            try:
                rows = {row.request_id: row for row in self._run(model_id, [spec for _, spec, _ in batch])}
            except BaseException as exc:  # every caller of the batch hears of it
                for _, _, future in batch:
                    future.set_exception(exc)
                continue
            for _, spec, future in batch:
                future.set_result(rows[spec["request_id"]])
