"""`celerytp worker`: claim the rank, then run one Celery worker that consumes only its queue."""

from __future__ import annotations

import logging
import sys
import time

import redis
from celery.signals import worker_shutting_down

from celerytp.core.app import make_app, queue_name
from celerytp.core.redact import redact_url
from celerytp.worker import exits
from celerytp.worker.config import RankConfig
from celerytp.worker.lease import RankLease, RankTaken

log = logging.getLogger(__name__)


def _claim(lease: RankLease) -> None:
    """Claim the rank, waiting out the claim of a worker that just died (its heartbeat's TTL)."""
    deadline = time.monotonic() + 2 * lease.timing.ttl_s
    while True:
        try:
            return lease.acquire()
        except RankTaken:
            if time.monotonic() > deadline:
                raise
            time.sleep(lease.timing.refresh_s / 2)


def run_worker(config: RankConfig, loglevel: str = "INFO") -> int:
    """Run the rank worker until it is told to stop; returns the exit code."""
    logging.basicConfig(level=loglevel, format=f"[rank {config.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    client = redis.Redis.from_url(config.broker_url)
    lease = RankLease(client, config.group, config.rank, config.device)
    try:
        _claim(lease)
    except RankTaken as exc:
        print(f"celerytp worker: refusing to start: {exc}", file=sys.stderr)
        return exits.REFUSED
    except redis.RedisError as exc:
        print(f"celerytp worker: cannot reach Redis at {redact_url(config.broker_url)}: {exc}", file=sys.stderr)
        return exits.REFUSED
    # Imports torch and the models: only rank workers pay for them.
    from celerytp.worker.state import RankState
    from celerytp.worker.tasks import register_tasks
    from celerytp.worker.watchdog import PeerWatchdog

    app = make_app(config.broker_url, config.group, config.world_size)
    state = RankState(config)
    register_tasks(app, state)

    @worker_shutting_down.connect(weak=False)
    def _told_to_stop(sig: str, **_) -> None:  # SIGTERM/SIGINT from a supervisor, or the shutdown op
        state.stop_requested = True
    PeerWatchdog(state, lease.timing, on_exit=lease.release).start()
    argv = [
        "worker",
        "--queues", queue_name(config.group, config.rank),
        "--hostname", f"celerytp.{config.group}.rank{config.rank}@%h",
        "--pool", "threads",  # ops run in the pool thread; the main thread stays responsive
        "--concurrency", "1",
        "--loglevel", loglevel,
        "--without-gossip",
        "--without-mingle",
    ]
    try:
        app.worker_main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else exits.UNEXPECTED
    else:
        code = exits.SHUTDOWN
    finally:
        lease.release()
    if code == exits.SHUTDOWN and not state.stop_requested:
        log.error("the Celery worker stopped without being told to")
        code = exits.UNEXPECTED
    return code
