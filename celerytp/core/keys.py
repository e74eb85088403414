"""Names of the coordination keys in Redis, in one place."""


def owner_key(group: str, rank: int) -> str:
    return f"celerytp:{group}:rank:{rank}:owner"


def seq_key(group: str) -> str:
    return f"celerytp:{group}:seq"


def epoch_key(group: str) -> str:
    """The sequence numbers' epoch: a new one when Redis lost the counter or a rank refused an op."""
    return f"celerytp:{group}:epoch"


def members_key(group: str) -> str:
    """JSON list: each rank's heartbeat value when the group last formed (who the group is)."""
    return f"celerytp:{group}:members"


def heal_lock_key(group: str) -> str:
    """Held by the one leader that re-forms the group and reloads its models."""
    return f"celerytp:{group}:heal"


def dispatch_lock_key(group: str) -> str:
    return f"celerytp:{group}:dispatch"


def rendezvous_prefix(group: str, comm_id: str) -> str:
    return f"celerytp:{group}:rdzv:{comm_id}:"


def models_key(group: str) -> str:
    """Hash: model_id -> JSON record of a model loaded on every rank (path, dtype, ...)."""
    return f"celerytp:{group}:models"


def load_progress_key(group: str, model_id: str) -> str:
    """Hash: rank -> JSON {done, total, name} of that rank's load in progress."""
    return f"celerytp:{group}:progress:{model_id}"


def stream_key(group: str, request_id: str) -> str:
    """Redis Stream of one request: its tokens (when streamed) and its `done` record (always)."""
    return f"celerytp:{group}:stream:{request_id}"


def cancel_key(group: str, request_id: str) -> str:
    """Set to cancel a request; rank 0 checks it while decoding."""
    return f"celerytp:{group}:cancel:{request_id}"


def queue_key(group: str, model_id: str) -> str:
    """List of a model's queued generation requests (GenSpec JSON); every leader pushes here."""
    return f"celerytp:{group}:queue:{model_id}"


def loop_key(group: str, model_id: str) -> str:
    """Set while a model's serving loop runs or is being started (value: its loop id)."""
    return f"celerytp:{group}:loop:{model_id}"


def loop_stats_key(group: str, model_id: str) -> str:
    """Hash: the serving loop's figures (running rows, peak rows, steps, reused tokens)."""
    return f"celerytp:{group}:loopstats:{model_id}"


def comm_key(group: str) -> str:
    """The comm_id of the group's current process-group epoch (set by the leader at init)."""
    return f"celerytp:{group}:comm"


def broken_key(group: str) -> str:
    """Set by a rank whose process group broke while its process lives (value: that comm_id);
    a leader that sees it equal to comm_key's value re-forms the group (client/healer)."""
    return f"celerytp:{group}:broken"


def control_queue_key(group: str, rank: int) -> str:
    """List: control requests (ping, status) for one rank's control thread, beside its op queue."""
    return f"celerytp:{group}:rank:{rank}:control"


def control_reply_key(group: str, call_id: str) -> str:
    """List: the ranks' replies to one control call."""
    return f"celerytp:{group}:control:reply:{call_id}"
