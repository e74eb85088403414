"""The deadman: a rank inside a collective op whose peer's worker is gone leaves the process.

A gloo or NCCL collective whose peer was SIGKILLed usually fails at once (its connection
closes), but a peer that is stuck (SIGSTOP, a hung driver) leaves every other rank blocked
until the process group's timeout, and a blocked collective cannot be interrupted from Python.
So while this rank runs a collective op, a thread watches the peers' heartbeat keys; when one
is gone or replaced, this worker exits with exits.PEER_LOST and its supervisor starts it
clean. The leader meanwhile names the lost rank (client/leader.py) and re-forms the group once
every rank is live again.
"""

from __future__ import annotations

import logging
import threading

from celerytp.core.liveness import HeartbeatTiming, RankWatch
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
                self._on_exit()
                exits.exit_now(exits.PEER_LOST, f"a peer of this collective op is gone ({why})")
