"""`celerytp worker`: claim the rank, then run one Celery worker that consumes only its queue."""

from __future__ import annotations

import logging
import sys

import redis

from celerytp.core.app import make_app, queue_name
from celerytp.worker.config import RankConfig
from celerytp.worker.lease import RankLease, RankTaken

log = logging.getLogger(__name__)


def run_worker(config: RankConfig, loglevel: str = "INFO") -> int:
    """Run the rank worker until it is told to stop; returns the exit code."""
    logging.basicConfig(level=loglevel, format=f"[rank {config.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    client = redis.Redis.from_url(config.broker_url)
    lease = RankLease(client, config.group, config.rank, config.device)
    try:
        lease.acquire()
    except RankTaken as exc:
        print(f"celerytp worker: refusing to start: {exc}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"celerytp worker: cannot reach Redis at {config.broker_url}: {exc}", file=sys.stderr)
        return 2
    # Imports torch and the models: only rank workers pay for them.
    from celerytp.worker.state import RankState
    from celerytp.worker.tasks import register_tasks

    app = make_app(config.broker_url, config.group, config.world_size)
    register_tasks(app, RankState(config))
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
        return int(exc.code or 0)
    finally:
        lease.release()
    return 0
