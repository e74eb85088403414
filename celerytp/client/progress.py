"""A progress bar for model loads, fed by the per-rank progress the workers put in Redis."""

from __future__ import annotations

import json
import sys
import threading
import time

import redis
from tqdm import tqdm

from celerytp.core.keys import load_progress_key


class LoadProgress:
    """Shows the slowest rank's tensors-loaded count while a load op runs (no-op if disabled):
    a bar on a terminal, a line per 10% when stderr is a file or a pipe (logs)."""

    def __init__(self, client: redis.Redis, group: str, model_id: str, world_size: int, enabled: bool = True):
        self._redis = client
        self._key = load_progress_key(group, model_id)
        self._world_size = world_size
        self._enabled = enabled
        self._bar: tqdm | None = None
        self._last = 0.0
        self._tenth = -1  # the last 10% step printed (no terminal)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="celerytp-load-progress", daemon=True)

    def __enter__(self) -> LoadProgress:
        # Polled from its own thread: the result backend's wait calls `on_interval` only rarely.
        if self._enabled:
            self._poller.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join()
        if self._bar is not None:
            self._bar.close()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.update()
            except redis.RedisError:
                return

    def update(self) -> None:
        with self._lock:
            self._update()

    def _update(self) -> None:
        now = time.monotonic()
        if not self._enabled or now - self._last < 0.2:
            return
        self._last = now
        ranks = [json.loads(v) for v in self._redis.hvals(self._key)]
        if not ranks:
            return
        slowest = min(ranks, key=lambda r: r["done"] / max(r["total"], 1))
        if not sys.stderr.isatty():
            tenth = 10 * slowest["done"] // max(slowest["total"], 1)
            if tenth > self._tenth:
                self._tenth = tenth
                print(f"loading: {10 * tenth}% ({slowest['done']}/{slowest['total']} tensors, "
                      f"{len(ranks)}/{self._world_size} ranks reporting)", file=sys.stderr, flush=True)
            return
        if self._bar is None:
            self._bar = tqdm(total=slowest["total"], desc="loading", unit="tensor", file=sys.stderr, leave=False)
        self._bar.n = slowest["done"]
        self._bar.set_postfix_str(f"{len(ranks)}/{self._world_size} ranks reporting", refresh=True)
