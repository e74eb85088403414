"""Per-process rank state: device, process group, the op order check, loaded models."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
import redis
import torch
import torch.distributed as dist

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.keys import broken_key, rendezvous_prefix
from celerytp.core.liveness import read_owners
from celerytp.core.redis_client import connect
from celerytp.distributed import control, shm
from celerytp.distributed.control import CollectiveFailed, ControlGroup
from celerytp.distributed.late_failures import ABORT_GRACE_S, abort_model_group, asynchronous, forget_abort, host_sync
from celerytp.distributed.store import RedisStore
from celerytp.distributed.tp import TPContext
from celerytp.worker import exits
from celerytp.worker.config import RankConfig
from celerytp.worker.loaded_model import LoadedModel

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def resolve_device(spec: str, rank: int) -> torch.device:
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CeleryTPError(ErrorKind.DEVICE_UNAVAILABLE, f"{spec} requested but CUDA is not available")
        if (device.index or 0) >= torch.cuda.device_count():
            raise CeleryTPError(ErrorKind.DEVICE_UNAVAILABLE, f"{spec} requested but {torch.cuda.device_count()} GPU(s) exist")
    elif device.type != "cpu":
        raise CeleryTPError(ErrorKind.DEVICE_UNAVAILABLE, f"unsupported device {spec!r}")
    return device


BROKEN_TTL_S = 3600  # a broken-group report outlives any heal that could act on it


class RankState:
    """Everything one rank keeps between tasks: device, process group, loaded models."""

    def __init__(self, config: RankConfig):
        self.config = config
        self.rank = config.rank
        self.world_size = config.world_size
        self.redis = connect(config.broker_url)  # rank 0 rides out a Redis restart mid-loop
        self.comm_id: str | None = None
        self.group_broken: str | None = None
        self.epoch = ""
        self.last_seq = 0
        self.members: list[bytes | None] = []  # each rank's heartbeat value when the group formed
        self.in_collective_op = False  # the watchdog's cue (worker/watchdog.py)
        self.ops_started = 0  # tells the watchdog one op from the next
        self.stop_requested = False  # set on SIGTERM/SIGINT: the worker's stop is not a failure
        self.tp = TPContext(config.rank, config.world_size)  # the model's group: model tensors only
        self.control = ControlGroup(config.rank, config.world_size, None, None)  # everything else
        self.models: dict[str, LoadedModel] = {}
        try:
            self.device = resolve_device(config.device, config.rank)
        except CeleryTPError as exc:
            log.error("%s", exc)
            self.device = None
        if self.device is not None and self.device.type == "cuda":
            # this rank's GPU for everything that names none: NCCL's communicator, streams, the
            # caching allocator (without it all ranks of a host would start on GPU 0)
            torch.cuda.set_device(self.device)
        threads = config.threads or max(1, (os.cpu_count() or 1) // config.world_size)
        torch.set_num_threads(threads)

    # ---- ordering ---------------------------------------------------------------------

    def check_order(self, request: Any, collective: bool) -> None:
        """Refuse a stale or repeated op; for a collective op, first agree with every rank on it.

        A new epoch (the leaders' counter was lost, or reset after a refusal) starts the count again.
        """
        if request.epoch != self.epoch:
            log.info("op epoch %r replaces %r: sequence numbers start again", request.epoch, self.epoch)
            self.epoch, self.last_seq = request.epoch, 0
        if request.seq <= self.last_seq:
            raise CeleryTPError(
                ErrorKind.OUT_OF_ORDER, f"op seq {request.seq} arrived after seq {self.last_seq} (stale or repeated)"
            )
        self.last_seq = request.seq
        if collective:
            self.require_group()
            # a heal's `keep` load is sent to ranks that hold the model and to ranks that lost it
            held = None if getattr(request, "keep", False) else getattr(request, "model_id", None)
            self.agree_on_op(request.seq, held)

    def agree_on_op(self, seq: int, model_id: str | None) -> None:
        """Every rank's k-th collective op must be the same op on the same models; check before its work.

        One all-reduce of (seq, holds model_id) per rank, so that ranks that disagree (a restarted
        rank that lost its models) all refuse the op instead of one of them waiting alone.
        """
        n = self.world_size
        mine = torch.zeros(2 * n, dtype=torch.int64)
        mine[self.rank] = seq
        mine[n + self.rank] = int(model_id in self.models) if model_id is not None else 0
        self.collective(lambda: self.control.all_reduce(mine))
        seqs, holds = mine[:n].tolist(), mine[n:].tolist()
        if len(set(seqs)) != 1:
            raise CeleryTPError(
                ErrorKind.OUT_OF_ORDER,
                f"ranks disagree on the op: this rank runs seq {seq}, the group's ranks run {seqs}",
            )
        if model_id is not None and len(set(holds)) != 1:
            having = [r for r, h in enumerate(holds) if h]
            missing = [r for r, h in enumerate(holds) if not h]
            raise CeleryTPError(
                ErrorKind.MODEL_NOT_LOADED,
                f"ranks disagree about model {model_id!r}: loaded on ranks {having}, not on {missing} "
                "(a rank restarted; unload and load it again, or let the leader heal the group)",
            )

    # ---- process group ----------------------------------------------------------------

    def require_group(self) -> None:
        if self.group_broken:
            raise CeleryTPError(
                ErrorKind.GROUP_BROKEN, f"process group {self.comm_id} is broken ({self.group_broken}); init with a new comm_id"
            )
        if self.comm_id is None or not dist.is_initialized():
            raise CeleryTPError(ErrorKind.NOT_INITIALISED, "no process group: send init first")

    def collective(self, fn: Callable[[], Any]) -> Any:
        """Run code that enters collectives; a timeout or a lost peer (a CollectiveFailed, raised by
        either channel's wrappers) marks the group broken and tells the leaders to re-form it."""
        try:
            result = fn()
            host_sync()  # an op ends with its device work done: a collective that failed unseen is seen here
            return result
        except CollectiveFailed as exc:
            self.mark_broken(str(exc))
            kind = ErrorKind.TIMEOUT if exc.timed_out else ErrorKind.RANK_LOST
            raise CeleryTPError(kind, f"collective failed: {self.group_broken}") from exc

    def mark_broken(self, why: str) -> None:
        """The group cannot be trusted any more (a peer may sit in a collective this rank left):
        refuse collective ops and tell the leaders (core/keys.broken_key), whose healer re-forms it."""
        self.group_broken = why or "collective failed"
        if asynchronous() and not abort_model_group(self.group_broken, ABORT_GRACE_S):
            # NCCL: device work may be queued behind a collective that never ends; unaborted, it
            # would hold up every later step, so a clean process is the way back
            exits.exit_now(exits.PEER_LOST, f"the broken model group could not be aborted ({self.group_broken})")
        if self.comm_id is None:
            return
        try:
            self.redis.set(broken_key(self.config.group), self.comm_id, ex=BROKEN_TTL_S)
        except redis.RedisError as exc:  # the leaders also see the op's error itself
            log.warning("could not report the broken group: %s", exc)

    def run_model(self, fn: Callable[[], Any]) -> Any:
        """Run model code (forwards and their collectives); any failure of it is forward_failed."""
        try:
            return self.collective(fn)
        except CeleryTPError:
            raise
        except Exception as exc:
            log.exception("forward failed")
            raise CeleryTPError(ErrorKind.FORWARD_FAILED, f"{type(exc).__name__}: {exc}") from exc

    def form_group(self, comm_id: str, timeout_s: float) -> str:
        if self.device is None:
            resolve_device(self.config.device, self.rank)  # raises device_unavailable
        self.destroy_group()
        # torch names the group by a process-wide counter that a failed init advances without
        # making a group: a rank that failed one would wait under other store keys than a fresh
        # peer. Every rank starts the count at 0 (the model and control groups then take 0 and 1).
        # A private attribute with no public reset: a pinned boundary (torch==2.13.0 in setup,
        # tests/test_boundaries.py checks it is there).
        dist.distributed_c10d._world.group_count = 0
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            # Past the group's timeout NCCL's watchdog tears the process down (3), never leaves it
            # running on a communicator whose aborted collectives left their outputs undefined. A
            # lost peer is met sooner by worker/watchdog.py, whose abort (distributed/late_failures.py)
            # stops that watchdog first and fails the steps it touched (docs/reliability.md).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        store = RedisStore(self.redis, rendezvous_prefix(self.config.group, comm_id), timedelta(seconds=timeout_s))
        kwargs = {"device_id": self.device} if backend == "nccl" else {}
        try:
            dist.init_process_group(
                backend, store=store, rank=self.rank, world_size=self.world_size,
                timeout=timedelta(seconds=timeout_s), **kwargs,
            )
            # The control channel: a CPU gloo group beside the model's, with shared memory on one host.
            self.control = control.form(self.rank, self.world_size, self.config.group, comm_id, timeout_s)
        except Exception as exc:
            raise CeleryTPError(ErrorKind.INIT_FAILED, f"{backend} rendezvous {comm_id} failed: {exc}") from exc
        self.comm_id = comm_id
        self.group_broken = None
        forget_abort()
        self.members = read_owners(self.redis, self.config.group, self.world_size)
        return backend

    def destroy_group(self) -> None:
        shm.detach()
        self.control = ControlGroup(self.rank, self.world_size, None, None)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                log.warning("destroying the old process group: %s", exc)
        self.comm_id = None
        self.members = []
