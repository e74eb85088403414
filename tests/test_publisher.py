"""Rank 0's publisher thread (worker/publisher.py): steps hand over their events and go on; a slow
writer gets the waiting batches merged into one write; a failed write is raised in the loop's
thread; nothing handed over is lost by drain or close. Real threads, a fake writer (the Redis side
is covered by the serving and reliability tests through real clusters)."""

from __future__ import annotations

import threading
import time

import pytest

from celerytp.worker import publisher as publisher_module
from celerytp.worker.publisher import Publisher


class SlowWriter:
    def __init__(self, delay: float = 0.0, fail_on: int | None = None):
        self.delay, self.fail_on = delay, fail_on
        self.writes: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, batches: list[int]) -> set[str]:
        self.gate.wait(10)
        time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in batches:
            raise ConnectionError("redis went away")
        self.writes.append(batches)
        return {f"cancelled-after-{batches[-1]}"}


def test_steps_do_not_wait_for_a_slow_writer_and_waiting_batches_merge():
    writer = SlowWriter(delay=0.05)
    publisher = Publisher(writer)
    started = time.perf_counter()
    for step in range(40):
        publisher.submit(step)
    handed_over = time.perf_counter() - started
    publisher.drain()
    assert handed_over < 0.05  # 40 steps took less than one write
    assert [b for write in writer.writes for b in write] == list(range(40))  # all, in order
    assert len(writer.writes) < 10  # merged
    assert publisher.submit(40) == {"cancelled-after-39"}  # what the last write saw
    assert publisher.close() is None


def test_a_full_buffer_makes_the_step_wait(monkeypatch):
    writer = SlowWriter()
    writer.gate.clear()  # the writer is stuck until released
    publisher = Publisher(writer, max_pending=3)
    publisher.submit(0)  # taken by the writer
    time.sleep(0.05)
    for step in range(1, 4):
        publisher.submit(step)
    blocked = threading.Thread(target=publisher.submit, args=(4,))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # a fourth waiting batch waits for room
    writer.gate.set()
    blocked.join(5)
    assert not blocked.is_alive()
    publisher.drain()
    assert [b for write in writer.writes for b in write] == [0, 1, 2, 3, 4]


def test_a_failed_write_is_raised_at_the_next_step_and_by_close():
    publisher = Publisher(SlowWriter(fail_on=2))
    for step in range(3):
        publisher.submit(step)
    with pytest.raises(ConnectionError, match="redis went away"):
        publisher.drain()
    with pytest.raises(ConnectionError):
        publisher.submit(3)
    assert isinstance(publisher.close(), ConnectionError)


def test_a_writer_stuck_past_the_deadline_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(publisher_module, "DRAIN_S", 0.2)
    writer = SlowWriter()
    writer.gate.clear()
    publisher = Publisher(writer)
    publisher.submit(0)
    with pytest.raises(Exception, match="Redis took over 0 s to write what the loop made") as info:
        publisher.drain()
    assert info.value.kind == "broker_unavailable"
    writer.gate.set()
    assert publisher.close() is None
