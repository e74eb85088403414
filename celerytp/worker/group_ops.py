"""Group ops on a rank: ping, init (form the process group), the all-reduce sanity check, shutdown."""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from celerytp.core import protocol as p
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.worker.memory import memory_report
from celerytp.worker.state import RankState, rss_bytes


def ping(state: RankState, request: p.PingRequest) -> p.Pong:
    device = str(state.device) if state.device is not None else f"unavailable:{state.config.device}"
    return p.Pong(
        rank=state.rank, world_size=state.world_size, device=device, comm_id=state.comm_id,
        rss_bytes=rss_bytes(), models={model_id: entry.record for model_id, entry in dict(state.models).items()},
        group_broken=state.group_broken, memory=memory_report(state.device, dict(state.models)),
    )


def init(state: RankState, request: p.InitRequest) -> p.InitOk:
    if state.comm_id == request.comm_id and not state.group_broken and dist.is_initialized():
        return p.InitOk(rank=state.rank, comm_id=request.comm_id, backend=dist.get_backend())
    backend = state.form_group(request.comm_id, request.timeout_s)
    return p.InitOk(rank=state.rank, comm_id=request.comm_id, backend=backend)


def sanity_check(state: RankState, request: p.SanityCheckRequest) -> p.SanityResult:
    """Both channels: a float all-reduce of 1 on the model's group (on the model's device) and an
    integer one on the control group."""
    one = torch.ones(1, dtype=torch.float32, device=state.device)
    state.collective(lambda: state.tp.all_reduce(one))
    votes = torch.ones(1, dtype=torch.int64)
    state.collective(lambda: state.control.all_reduce(votes))
    observed, control = int(one.item()), int(votes.item())
    if observed != state.world_size or control != state.world_size:
        raise CeleryTPError(
            ErrorKind.SANITY_FAILED,
            f"all-reduce of 1 gave {observed} on the model group and {control} on the control group, "
            f"expected {state.world_size}",
        )
    return p.SanityResult(rank=state.rank, observed_sum=observed)


def shutdown(state: RankState, request: p.ShutdownRequest) -> p.Bye:
    # Give the reply time to reach the result backend, then ask the worker for a warm stop.
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return p.Bye(rank=state.rank)
