"""The deadman: a rank inside a collective op whose peer's worker is gone fails the op, or
leaves the process.

A gloo or NCCL collective whose peer was SIGKILLed usually fails at once (its connection
closes), but a peer that is stuck (SIGSTOP, a hung driver) leaves every other rank blocked
until the process group's timeout, and a blocked gloo collective cannot be interrupted from
Python. Nor does a killed peer close anything under the shared-memory path: its waits sleep
until their deadline; and an NCCL collective blocks the device work queued behind it, so the
host's next copy from the device waits for good. So while this rank runs a collective op, a
thread watches the peers' heartbeat keys. When one is gone or replaced, it aborts the model
group where the backend allows it (distributed/late_failures.py `abort_model_group`: the
shared-memory segment's waits, the NCCL communicator): the op fails, the group is marked broken,
and the worker keeps its process and its weights (a heal keeps them: worker/model_ops.py). An op
still running ABORT_GRACE_S later is blocked where nothing aborts it (gloo, a device that the
abort did not free): this worker exits with exits.PEER_LOST and its supervisor starts it clean.
The leader meanwhile names the lost rank (client/leader.py) and re-forms the group once every
rank is live again.
"""

from __future__ import annotations

import logging
import threading
import time

from celerytp.core.liveness import HeartbeatTiming, RankWatch
from celerytp.distributed.late_failures import ABORT_GRACE_S, abort_model_group
from celerytp.worker import exits
from celerytp.worker.state import RankState

log = logging.getLogger(__name__)


class PeerWatchdog:
    def __init__(self, state: RankState, timing: HeartbeatTiming, on_exit: callable):
        self._state = state
        self._timing = timing
        self._on_exit = on_exit  # release this worker's lease first, so its replacement starts at once
        self._watch: RankWatch | None = None

    def start(self) -> None:
        threading.Thread(target=self._run, name="celerytp-watchdog", daemon=True).start()

    def _run(self) -> None:
        state = self._state
        while True:
            threading.Event().wait(self._timing.refresh_s / 2)
            if not (state.in_collective_op and state.members and state.world_size > 1):
                self._watch = None
                continue
            if self._watch is None or self._watch.expected != state.members:
                self._watch = RankWatch(state.redis, state.config.group, state.members, self._timing)
            peers = [r for r in range(state.world_size) if r != state.rank]
            lost = self._watch.lost(peers)
            if lost and state.in_collective_op:
                why = "; ".join(f"rank {r}: {reason}" for r, reason in sorted(lost.items()))
                if self._abort_op(why):
                    continue
                self._on_exit()
                exits.exit_now(exits.PEER_LOST, f"a peer of this collective op is gone ({why})")

    def _abort_op(self, why: str) -> bool:
        """Fail the op in progress by aborting the model group; whether it ended in time."""
        state = self._state
        op, deadline = state.ops_started, time.monotonic() + ABORT_GRACE_S
        if not abort_model_group(why, ABORT_GRACE_S):
            return False
        while state.in_collective_op and state.ops_started == op:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        log.warning("a peer of this collective op is gone (%s): the op failed, this worker goes on", why)
        return True
