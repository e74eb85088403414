"""How a rank's host learns that a model collective failed, and how the model group is aborted.

An NCCL collective is queued on the device and returns at once. A peer lost under it shows only
when the host next waits for the device (the step's one copy to the host), and a copy behind a
collective that never ends waits for good, until the communicator is aborted (ncclCommAbort).
The abort ends the collective with its output undefined, and the copy it frees would hand that
output on. So the abort is marked before it is made, and every host sync after it raises
(`host_sync`): an aborted step never reaches a sampler. gloo's collectives fail in the call; the
shared-memory segment's waits are ended by its own abort (distributed/shm.py).

Tests make a CPU group's model collectives fail NCCL's way (CELERYTP_ASYNC_FAILURES): the call
returns, its output left as it is, and the failure is seen at the next host sync. It is raised
there ("raise"), or that sync waits until the model group is aborted ("block", as a copy behind
a collective that never ends, until ncclCommAbort ends it), or waits for good ("hang": a device
that even the abort does not free, until the deadman ends the process, worker/watchdog.py).
Control collectives are gloo on every device: not deferred.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from celerytp.core.step_clock import timed
from celerytp.core.switches import ASYNC_FAILURES_ENV, switch
from celerytp.distributed import shm
from celerytp.distributed.control import CollectiveFailed

log = logging.getLogger(__name__)
ABORT_GRACE_S = 3.0  # an op an abort did not end by then is blocked where nothing aborts it


class _Unseen(threading.local):
    error: CollectiveFailed | None = None


class _Abort:
    """The model group's abort, process-wide: made from the deadman's thread, seen by the op's."""

    def __init__(self) -> None:
        self.done = threading.Event()  # set before the backend's abort: a copy it frees finds it set
        self.why = ""
        self.nccl: threading.Thread | None = None  # the NCCL abort, in a thread: it can take a while
        self.nccl_aborted = False


_UNSEEN = _Unseen()
_ABORT = _Abort()


def issue(call: Callable[[], Any]) -> Any:
    """Run one model collective; with late failures emulated, keep its failure for `host_sync`
    and return None."""
    try:
        return timed("collectives", call)
    except CollectiveFailed as exc:
        if _late_failures() == "0":
            raise
        _UNSEEN.error = _UNSEEN.error or exc
        return None


@functools.cache
def _late_failures() -> str:
    return switch(ASYNC_FAILURES_ENV)


def host_sync() -> None:
    """The host waits for the model's device here (the end of a collective op): raises if a model
    collective failed unseen since the last sync, or the model group was aborted."""
    wait_for_device()
    raise_if_aborted()


def wait_for_device() -> None:
    """Where the host would wait for the device, a model collective that failed unseen since the
    last sync (emulated, above) is raised ("raise"), or the wait lasts until the model group is
    aborted and then returns, as a copy the abort frees does ("block"), or lasts for good ("hang")."""
    error, _UNSEEN.error = _UNSEEN.error, None
    if error is None:
        return
    log.warning("a model collective failed unseen, seen at this host sync: %s", error)
    if _late_failures() == "block":
        _ABORT.done.wait()
    elif _late_failures() == "hang":
        threading.Event().wait()
    else:
        raise error


def raise_if_aborted() -> None:
    """After a copy from the device: if the model group was aborted, the copy may hold the
    undefined output of a collective the abort ended."""
    if _ABORT.done.is_set():
        raise CollectiveFailed(f"the model group was aborted ({_ABORT.why})", timed_out=False)


def asynchronous() -> bool:
    """Whether this rank's model collectives fail late (NCCL, or emulated): a rank whose group
    broke may then still have device work queued behind a collective that never ends."""
    return _nccl_backend() is not None or _late_failures() != "0"


def abort_model_group(why: str, wait_s: float) -> bool:
    """End the model group's collectives, in progress and to come, where the backend allows it: the
    shared-memory segment's waits, the NCCL communicator, the emulation's blocked sync. Every host
    sync after this raises, until the group is re-formed. False when nothing here could be
    aborted, or an NCCL abort did not return within `wait_s`: the caller then leaves the process."""
    if not _ABORT.done.is_set():
        _ABORT.why = why
        _ABORT.done.set()
    fast = shm.active()
    if fast is not None:
        fast.abort(why)
    backend = _nccl_backend()
    if backend is None:
        return fast is not None or _late_failures() != "0"
    if _ABORT.nccl is None:
        _ABORT.nccl = threading.Thread(target=_abort_nccl, args=(backend, why), name="celerytp-nccl-abort", daemon=True)
        _ABORT.nccl.start()
    _ABORT.nccl.join(wait_s)
    return _ABORT.nccl_aborted


def forget_abort() -> None:
    """A new group: what failed in the old one is not this one's."""
    _UNSEEN.error = None
    _ABORT.why, _ABORT.nccl, _ABORT.nccl_aborted = "", None, False
    _ABORT.done.clear()


def _nccl_backend() -> Any:
    """The model group's NCCL backend, or None (gloo, or no group)."""
    try:
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return None
        return dist.group.WORLD._get_backend(torch.device("cuda"))
    except (AttributeError, RuntimeError, ValueError):  # destroyed meanwhile
        return None


def _abort_nccl(backend: Any, why: str) -> None:
    """ncclCommAbort on every communicator of the model group: queued and running collectives end
    (their outputs undefined) and the copies behind them return. ProcessGroupNCCL.abort first
    stops NCCL's own watchdog, so its TORCH_NCCL_ASYNC_ERROR_HANDLING teardown does not follow."""
    try:
        backend.abort()
        _ABORT.nccl_aborted = True
        log.warning("aborted the model group's NCCL communicator (%s)", why)
    except Exception as exc:  # noqa: BLE001 - the caller's deadline decides what happens next
        log.warning("aborting the model group's NCCL communicator failed: %s: %s", type(exc).__name__, exc)
