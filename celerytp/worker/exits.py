"""Exit codes of a rank worker (docs/reliability.md). Only a `shutdown` op ends it with 0, so a
supervisor's restart-on-failure policy (systemd, compose, LocalCluster) restarts every other stop."""

import logging
import os

SHUTDOWN = 0  # told to stop (`shutdown` op, or SIGTERM from its supervisor)
UNEXPECTED = 1  # the Celery worker stopped for any other reason
REFUSED = 2  # could not start: bad settings, Redis unreachable past the retry window, rank taken
LEASE_LOST = 3  # another live worker claimed this rank: stop consuming at once
PEER_LOST = 4  # stuck in a collective whose peer died: leave so the supervisor restarts it clean

log = logging.getLogger(__name__)


def exit_now(code: int, why: str) -> None:
    """Leave the process at once from any thread (a thread blocked in a collective cannot be interrupted)."""
    log.critical("exiting with code %d: %s", code, why)
    logging.shutdown()
    os._exit(code)
