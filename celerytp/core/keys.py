"""Names of the coordination keys in Redis, in one place."""

# Groups a request may be taken by before it is given up, and serving loops a group may fail in a
# row before it starts none for a while (both are counted in keys below).
MAX_ATTEMPTS = 3


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


def owner_pattern() -> str:
    """SCAN pattern of every rank's owner key (finds the groups from their heartbeats)."""
    return "celerytp:*:rank:*:owner"


def rendezvous_prefix(group: str, comm_id: str) -> str:
    return f"celerytp:{group}:rdzv:{comm_id}:"


def models_key(group: str) -> str:
    """Hash: model_id -> JSON record of a model loaded on every rank (path, dtype, ...)."""
    return f"celerytp:{group}:models"


def load_progress_key(group: str, model_id: str) -> str:
    """Hash: rank -> JSON {done, total, name} of that rank's load in progress."""
    return f"celerytp:{group}:progress:{model_id}"


def stream_key(request_id: str) -> str:
    """Redis Stream of one request: its tokens (when streamed) and its `done` record (always).
    Keyed by request alone: the request's client does not know which replica group serves it."""
    return f"celerytp:stream:{request_id}"


def wake_key(follower_id: str) -> str:
    """Redis Stream a leader process's stream follower reads beside the request streams: an entry
    added there makes its blocking XREAD return, to read a stream that it did not read yet."""
    return f"celerytp:wake:{follower_id}"


def cancel_key(request_id: str) -> str:
    """Set to cancel a request; the rank 0 that holds it checks it while decoding."""
    return f"celerytp:cancel:{request_id}"


def request_key(request_id: str) -> str:
    """The queued JSON of a request that is queued or running (a second submit of the same id
    follows the first instead of running it twice)."""
    return f"celerytp:request:{request_id}"


def queue_key(model_id: str) -> str:
    """List of a model's queued generation requests (GenSpec JSON), shared by every group that
    serves the model (its replicas); every leader pushes here."""
    return f"celerytp:model:{model_id}:queue"


def replicas_key(model_id: str) -> str:
    """Hash: group -> JSON {world_size} of each group that holds the model and serves its queue."""
    return f"celerytp:model:{model_id}:replicas"


def attempts_key(model_id: str) -> str:
    """Hash: request id -> JSON list of the groups that took it so far (a request is given up after
    MAX_ATTEMPTS)."""
    return f"celerytp:model:{model_id}:attempts"


def loop_failures_key(model_id: str) -> str:
    """Hash: group -> JSON {count, error} of the group's serving loops of the model that failed in a
    row (cleared by a loop that ends well); a group at MAX_ATTEMPTS starts no loop for a while."""
    return f"celerytp:model:{model_id}:failures"


def loop_failure_counts_key(group: str, model_id: str) -> str:
    """Hash: error kind -> how many of the group's serving loops of the model failed with it, ever
    (a counter: never cleared; core/loop_failures.py)."""
    return f"celerytp:{group}:loopfailures:{model_id}"


def loop_failure_seen_key(group: str, loop_id: str) -> str:
    """Set by the first rank of the group to record that its serving loop `loop_id` failed (the
    other ranks' reports of the same loop then count nothing)."""
    return f"celerytp:{group}:loopfailed:{loop_id}"


def loop_failure_index_key() -> str:
    """Set of JSON [group, model_id] pairs that have a loop_failure_counts_key hash."""
    return "celerytp:loopfailures"


def served_models_key() -> str:
    """Set of the model ids that some group serves (keys of replicas_key)."""
    return "celerytp:models"


def inflight_key(group: str, model_id: str) -> str:
    """List: the requests a group's serving loop took off the model's queue and has not answered
    yet (given back to the queue when the loop fails or its lease, the loop flag, lapses)."""
    return f"celerytp:{group}:inflight:{model_id}"


def loop_key(group: str, model_id: str) -> str:
    """Set while a group's serving loop of a model runs or is being started (value: its loop id);
    refreshed every step, it is also the loop's lease on its in-flight requests."""
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
