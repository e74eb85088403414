"""The module-level Celery app, for Celery's own tools: `celery -A celerytp.app inspect ping`,
`celery -A celerytp.app status`, `celery -A celerytp.app inspect celerytp_status` (each rank's
group, comm_id, models and RSS), `celery -A celerytp.app flower`, and a front-door worker
(`celery -A celerytp.app worker -Q celerytp.<group>.requests -P threads`).

Configured from the environment: CELERYTP_BROKER (Redis URL), CELERYTP_GROUP, CELERYTP_WORLD_SIZE, and
the front door's request limits, CELERYTP_MAX_SCHEMA_BYTES and CELERYTP_MAX_STOP_CHARS (server/limits.py).
It is the process's current and default app, as the app of a Celery project is.
"""

from __future__ import annotations

import os
import sys

from celerytp.core import remote_status  # noqa: F401 - registers `inspect celerytp_status`
from celerytp.core.app import DEFAULT_BROKER, DEFAULT_GROUP
from celerytp.server.frontend import make_frontend_app
from celerytp.server.limits import RequestLimits

app = make_frontend_app(
    os.environ.get("CELERYTP_BROKER", DEFAULT_BROKER),
    os.environ.get("CELERYTP_GROUP", DEFAULT_GROUP),
    int(os.environ.get("CELERYTP_WORLD_SIZE", "1")),
    RequestLimits.from_env(os.environ),
)
# `make_app` keeps the apps it makes out of Celery's current and default app (several live in one
# process: leaders, tests), so this one must be made so here. Celery's tools read the current app
# where they take none: Flower's /api/task/result/<id> builds `AsyncResult(id)` and, without this,
# gets Celery's fallback app, which has no result backend (an empty 503). Current for the importing
# thread (`celery -A` imports it in its main thread) and default for every other.
app.set_current()
app.set_default()

if "flower" in sys.modules:  # `celery -A celerytp.app flower`: Celery loaded its command plugins first
    from celerytp.core.safe_transport import teach_flower

    teach_flower()  # its Broker page and /api/queues/length read the queues' lengths
