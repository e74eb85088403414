"""Serving-loop failures by kind, counted in Redis where every leader, `celerytp status` and
`/metrics` of the same Redis read them.

A serving loop is one `serve` op (worker/serve_op.py) that every rank of a group runs with the
same loop id. It ends well (its queue stayed empty for `idle_s`, or it yielded to another op:
not a failure, nothing is counted) or its op fails with a CeleryTPError on one rank or more. Every
rank whose op failed records it (`record_loop_failure`, from the op's error hook on each rank):
rank 0 may be the lost rank, and a rank that died records nothing, so counting on whichever rank
survives is the only way to see every failure a live rank saw. The first report of a loop wins
(SET NX on the loop id, in the same script as the count), so a loop counts once whichever ranks
saw it, with the kind of the first rank to report it: usually the rank where it started (the
others then fail in a collective that waits on it, later), and for a failure rank 0 tells every
rank in its abort plan, that one kind on every rank.

Not counted: a loop whose every rank died (no one is left to say so; the leaders heal the group
and the loop's lease lapses), and a loop whose ranks could not reach Redis to say so.
"""

from __future__ import annotations

import json
import logging

import redis

from celerytp.core.errors import ErrorKind
from celerytp.core.keys import loop_failure_counts_key, loop_failure_index_key, loop_failure_seen_key

log = logging.getLogger(__name__)

SEEN_TTL_S = 86400  # far longer than the ranks of one loop take to report it (their collective timeout)
# The kinds a loop usually fails with; /metrics shows them at 0 before the first (others appear when counted)
USUAL_KINDS = (ErrorKind.RANK_LOST, ErrorKind.TIMEOUT, ErrorKind.GROUP_BROKEN, ErrorKind.FORWARD_FAILED,
               ErrorKind.INTERNAL)

# KEYS: the loop's seen marker, the group's counts of the model, the index. ARGV: kind, marker TTL,
# index member. 1: counted; 0: another rank counted this loop already.
_RECORD = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""


def record_loop_failure(client: redis.Redis, group: str, model_id: str, loop_id: str, kind: ErrorKind | str) -> bool:
    """Count that the group's serving loop `loop_id` of `model_id` failed with `kind`, once per
    loop whichever ranks report it; True when this call counted it. A Redis failure is logged, not
    raised (the op's error reply matters more than the count)."""
    try:
        keys = [loop_failure_seen_key(group, loop_id), loop_failure_counts_key(group, model_id),
                loop_failure_index_key()]
        return bool(client.eval(_RECORD, 3, *keys, str(ErrorKind(kind)), SEEN_TTL_S, json.dumps([group, model_id])))
    except redis.RedisError as exc:
        log.warning("could not count the failed serving loop %s of %s: %s", loop_id, model_id, exc)
        return False


def counted_loops(client: redis.Redis) -> set[tuple[str, str]]:
    """Every (group, model_id) with failures counted."""
    pairs = set()
    for member in client.smembers(loop_failure_index_key()):
        try:
            group, model_id = json.loads(member)
        except (ValueError, TypeError):
            continue
        pairs.add((group, model_id))
    return pairs


def loop_failures(client: redis.Redis, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, int]]:
    """(group, model_id) -> {kind: failed loops} (counted kinds only; {} when none)."""
    pipe = client.pipeline(transaction=False)
    for group, model_id in pairs:
        pipe.hgetall(loop_failure_counts_key(group, model_id))
    return {pair: {k.decode(): int(v) for k, v in sorted(counts.items())}
            for pair, counts in zip(pairs, pipe.execute(), strict=True)}
