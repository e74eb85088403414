"""Names of the coordination keys in Redis, in one place."""


def owner_key(group: str, rank: int) -> str:
    return f"celerytp:{group}:rank:{rank}:owner"


def seq_key(group: str) -> str:
    return f"celerytp:{group}:seq"


def dispatch_lock_key(group: str) -> str:
    return f"celerytp:{group}:dispatch"


def rendezvous_prefix(group: str, comm_id: str) -> str:
    return f"celerytp:{group}:rdzv:{comm_id}:"
