"""The Celery app: JSON-only wire, one declared queue per rank, tuned for latency."""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

from celerytp.core.redis_client import retry_window_s

DEFAULT_BROKER = "redis://127.0.0.1:6379/0"
DEFAULT_GROUP = "default"
GATHER_TASK = "celerytp.gather"  # the chord body: orders the rank replies
UNREAD_PREFIX = "unread-"  # a chord body id nobody waits on (a serving loop's): its reply is not stored


def op_task_name(op: str) -> str:
    """The rank task of one op (stable names, for Flower and `celery inspect`)."""
    return f"celerytp.rank.{op}"


def queue_name(group: str, rank: int) -> str:
    return f"celerytp.{group}.rank.{rank}"


def celery_config(broker_url: str, group: str, ranks: range) -> dict:
    """Settings shared by the leader and the rank workers of one group."""
    return {
        "broker_url": broker_url,
        "result_backend": broker_url,
        # JSON only: a pickle on a shared broker is remote code execution.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        # Every rank consumes exactly its own declared queue; no queue appears by accident.
        "task_queues": [Queue(queue_name(group, r), routing_key=queue_name(group, r)) for r in ranks],
        "task_create_missing_queues": False,
        "task_default_queue": queue_name(group, 0),
        # A collective re-run on one rank alone deadlocks: ack on receipt, take one at a time.
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
        "task_track_started": False,
        "result_expires": 3600,
        "result_extended": False,
        "broker_connection_retry_on_startup": True,
        # A Redis restart delays a publish instead of failing it (core/redis_client.py's window).
        "task_publish_retry": True,
        "task_publish_retry_policy": {
            "max_retries": int(retry_window_s() / 0.5) + 1, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.5,
        },
        # kombu's Redis transport behind a gate: malformed messages are dead-lettered, never delivered.
        "broker_transport": "celerytp.core.safe_transport:Transport",
        "broker_transport_options": {"visibility_timeout": 3600},
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        # Task events cost 8-15% of a 2-rank chord's latency (docs/benchmarks.md), so they are off
        # unless CELERYTP_EVENTS=1; Flower turns them on itself (its default `enable_events`).
        "worker_send_task_events": os.environ.get("CELERYTP_EVENTS") == "1",
        "task_send_sent_event": os.environ.get("CELERYTP_EVENTS") == "1",
    }


SIGNING_ENV = ("CELERYTP_SIGNING_KEY", "CELERYTP_SIGNING_CERT", "CELERYTP_SIGNING_CERT_STORE")


def make_app(broker_url: str, group: str = DEFAULT_GROUP, world_size: int = 1, main: str = "celerytp") -> Celery:
    """A Celery app for one group; `world_size` decides which rank queues are declared.

    With CELERYTP_SIGNING_KEY, _CERT and _CERT_STORE set (a private key, its certificate, and a
    directory or glob of the certificates whose holders may drive the ranks), every task message
    is signed and only messages signed by a trusted certificate run (Celery's `auth` serializer).
    Signing is process-wide: one process holds one signing identity.
    The app is not made Celery's current or default app: several live in one process (leaders,
    tests). celerytp/app.py, the app of `celery -A celerytp.app` (Flower included), makes its own so.
    """
    app = Celery(main, set_as_current=False)
    app.conf.update(celery_config(broker_url, group, range(world_size)))
    key, cert, store = (os.environ.get(name) for name in SIGNING_ENV)
    if key or cert or store:
        if not (key and cert and store):
            raise ValueError(f"message signing needs all of {', '.join(SIGNING_ENV)}")
        app.conf.update(
            task_serializer="auth", accept_content=["auth"], security_key=key, security_certificate=cert,
            security_cert_store=store, security_digest="sha256",
        )
        app.setup_security(allowed_serializers=["json"], serializer="json")
    return app
