"""The two places that use a library's private internals, because no public API does the job;
each test fails when the library changes under them, so an upgrade looks at them first."""

from __future__ import annotations

import hashlib
import inspect

import torch.distributed as dist
from kombu.transport import redis as kombu_redis

from celerytp.core.safe_transport import KOMBU_BRPOP_READ_SHA256


def test_kombus_brpop_read_is_the_one_the_gate_copied():
    source = inspect.getsource(kombu_redis.Channel._brpop_read)
    assert hashlib.sha256(source.encode()).hexdigest() == KOMBU_BRPOP_READ_SHA256, (
        "kombu's Channel._brpop_read changed: compare it with core/safe_transport.py's copy, then update the hash"
    )


def test_torchs_group_counter_is_where_init_resets_it():
    assert isinstance(dist.distributed_c10d._world.group_count, int)  # worker/state.py form_group
