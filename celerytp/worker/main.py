"""`celerytp worker`: claim the rank, then run one Celery worker that consumes only its queue."""

from __future__ import annotations

import logging
import sys
import time

import redis
from celery.signals import worker_shutting_down

from celerytp.core.app import make_app, queue_name
from celerytp.core.redis_client import connect
from celerytp.core.remote_status import provide_status
from celerytp.core.secrets import mask_logged_secrets, mask_secrets
from celerytp.worker import exits
from celerytp.worker.config import RankConfig
from celerytp.worker.lease import RankLease, RankTaken

log = logging.getLogger(__name__)


def run_worker(config: RankConfig, loglevel: str = "INFO") -> int:
    """Run the rank worker until it is told to stop; returns the exit code (worker/exits.py)."""
    logging.basicConfig(level=loglevel, format=f"[rank {config.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    mask_logged_secrets()
    client = connect(config.broker_url, window_s=0)  # claim_rank and the heartbeat retry (and log) themselves
    lease = RankLease(client, config.group, config.rank, config.device)
    try:
        claim_rank(lease, config)
    except RankTaken as exc:
        print(f"error: bad_request: refusing to start: {exc}", file=sys.stderr)
        return exits.REFUSED
    except redis.RedisError as exc:
        print(f"error: timeout: cannot reach Redis at {mask_secrets(config.broker_url)}: {mask_secrets(str(exc))}",
              file=sys.stderr)
        return exits.REFUSED
    # Imports torch and the models: only rank workers pay for them.
    from celerytp.worker.control_thread import ControlThread
    from celerytp.worker.memory import memory_report
    from celerytp.worker.state import RankState, rss_bytes
    from celerytp.worker.tasks import register_tasks
    from celerytp.worker.watchdog import PeerWatchdog

    app = make_app(config.broker_url, config.group, config.world_size)
    state = RankState(config)
    if state.device is not None:
        lease.show_device(str(state.device))
    register_tasks(app, state)
    provide_status(lambda: {
        "group": config.group, "rank": config.rank, "world_size": config.world_size, "comm_id": state.comm_id,
        "device": str(state.device), "models": sorted(state.models), "rss_bytes": rss_bytes(),
        "memory": memory_report(state.device, dict(state.models)),
    })

    @worker_shutting_down.connect(weak=False)
    def _told_to_stop(sig: str, **_) -> None:  # SIGTERM/SIGINT from a supervisor, or the shutdown op
        state.stop_requested = True

    PeerWatchdog(state, lease.timing, on_exit=lease.release).start()
    ControlThread(state).start()  # ping and status beside the op thread: never behind a load
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
    app.log.setup = _masked(app.log.setup)  # Celery installs its own handlers when the worker starts
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


def claim_rank(lease: RankLease, config: RankConfig) -> None:
    """Take the rank. While Redis is not reachable yet (a whole deployment starting at once), wait
    up to `redis_wait_s` with a log line per try; while the rank's previous worker, just died,
    still holds it, wait out its heartbeat TTL. A refused password fails at once."""
    deadline = time.monotonic() + config.redis_wait_s
    taken_until = time.monotonic() + 2 * lease.timing.ttl_s
    delay = 0.5
    while True:
        try:
            lease.acquire()
            return
        except RankTaken:
            if time.monotonic() > taken_until:
                raise
            time.sleep(lease.timing.refresh_s / 2)
        except (redis.AuthenticationError, redis.ResponseError):
            raise
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("Redis at %s is not reachable (%s); retrying in %.1f s",
                        mask_secrets(config.broker_url), mask_secrets(str(exc)), delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _masked(setup):
    def wrapped(*args, **kwargs):
        result = setup(*args, **kwargs)
        mask_logged_secrets()
        return result

    return wrapped
