"""`celerytp_status`: a Celery remote-control command, so `celery -A celerytp.app inspect
celerytp_status` and Flower show what each rank holds (group, comm_id, models, RSS).

Registered on import (Celery's command registry is per process); the rank worker provides the
figures, so the client side that imports this module only learns the command's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.worker.control import inspect_command

_provider: list[Callable[[], dict[str, Any]]] = []


def provide_status(status: Callable[[], dict[str, Any]]) -> None:
    """Set what this worker process answers to `celerytp_status`."""
    _provider[:] = [status]


@inspect_command()
def celerytp_status(state: Any) -> dict[str, Any]:
    """This worker's celerytp status (a worker that is not a rank says so)."""
    return _provider[0]() if _provider else {"role": "not a rank worker"}
