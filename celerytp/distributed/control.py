"""The control channel: a CPU group beside the model's group, for everything that is not a model tensor.

The model's group (NCCL on CUDA ranks, gloo on CPU ones) carries model tensors on the model's
device and nothing else: NCCL refuses CPU tensors, and a step plan or a vote has no business on a
GPU. Step plans, admissions, sampled tokens, stop and abort flags and agreement votes go through
this group instead: gloo, formed at `init` from the same rendezvous, with the shared-memory fast
path (distributed/shm.py) when the ranks share a host. vLLM keeps the same split (its `cpu_group`
beside the device group).

`agree` is the guarded-step protocol's one agreement: every rank says whether its local work
failed, and a failure anywhere becomes the same typed error on every rank, so no rank goes on
into a collective that a peer will not reach.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from celerytp.core.errors import CeleryTPError
from celerytp.distributed import shm


class CollectiveFailed(RuntimeError):
    """A collective of either channel failed: a peer's connection closed, or it timed out.

    Raised by the channels' own wrappers around every collective call, so a caller tells a
    broken group from a failure of its own code by type. torch's gloo reports both as a plain
    RuntimeError; `timed_out` reads the backend's wording for which of the two it was.
    """

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


def checked(fn: Callable[[], Any]) -> Any:
    """Run one call into the backend (gloo, NCCL); any failure of it is a CollectiveFailed. `fn`
    must be that call alone: whatever else fails inside the wrapper would be taken for the group's."""
    try:
        return fn()
    except CollectiveFailed:
        raise
    except (RuntimeError, dist.DistError) as exc:  # gloo: RuntimeError; NCCL/c10d: DistError subclasses
        raise _failed(exc) from exc


def checked_shm(fn: Callable[[], Any]) -> Any:
    """Run one shared-memory collective: only its synchronisation failing (shm.ShmFailure) is a
    CollectiveFailed; a tensor op inside it that fails (a bug, a bad argument) raises as it is."""
    try:
        return fn()
    except shm.ShmFailure as exc:
        raise _failed(exc) from exc


def _failed(exc: Exception) -> CollectiveFailed:
    first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    timed_out = isinstance(exc, shm.ShmTimeout) or "timed out" in first.lower() or "timeout" in first.lower()
    return CollectiveFailed(first, timed_out)


class ControlGroup:
    """One rank's end of the control channel.

    Args:
        rank: this rank.
        world_size: ranks in the group.
        group: the gloo process group (None at world size 1, where every op is the identity).
        fast: the same-host shared-memory segment, or None.
    """

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None, fast: shm.ShmGroup | None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.fast = fast

    @classmethod
    def on_default_group(cls, rank: int, world_size: int) -> ControlGroup:
        """The default gloo group (and its shared memory, if attached) as the control channel: for
        bare SPMD runs on CPU (benchmarks, tests), where the model shares that group."""
        return cls(rank, world_size, None, shm.active())

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce a small CPU tensor in place (sum, max or min) over the ranks."""
        if self.world_size > 1:
            if self.fast is not None and self.fast.fits(tensor):
                checked_shm(lambda: self.fast.all_reduce(tensor, op))
            else:
                reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
                checked(lambda: dist.all_reduce(tensor, op=reduce_op, group=self.group))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite a CPU tensor in place with rank `src`'s value."""
        if self.world_size > 1:
            if self.fast is not None and self.fast.fits(tensor):
                checked_shm(lambda: self.fast.broadcast(tensor, src))
            else:
                checked(lambda: dist.broadcast(tensor, src=src, group=self.group))
        return tensor

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank `src`'s bytes on every rank (two broadcasts: the length, then the bytes)."""
        size = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.long)
        self.broadcast(size, src)
        n = int(size.item())
        if n == 0:
            return b""
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src else torch.empty(n, dtype=torch.uint8)
        self.broadcast(buffer, src)
        return buffer.numpy().tobytes()

    def wait_for_all(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every rank to arrive here, past the group's own timeout (a
        rank that kept its weights waits out one that reads them). A lost peer fails it at once."""
        if self.world_size > 1:
            checked(lambda: dist.monitored_barrier(self.group, timedelta(seconds=timeout_s), wait_all_ranks=True))

    def agree(self, failure: CeleryTPError | None) -> None:
        """Every rank reports whether its local work failed; when any did, raise on every rank.

        A failing rank raises its own error; the others raise the lowest failing rank's, named
        (`rank 0 [load_failed]: ...`), so every rank leaves the step at once and together.
        """
        flags = torch.zeros(self.world_size, dtype=torch.long)
        flags[self.rank] = int(failure is not None)
        self.all_reduce(flags)
        failed = [r for r, flag in enumerate(flags.tolist()) if flag]
        if not failed:
            return
        first = failed[0]
        mine = json.dumps([str(failure.kind), failure.message]).encode() if failure is not None and self.rank == first else None
        kind, message = json.loads(self.broadcast_bytes(mine, src=first))
        if failure is not None:
            raise failure
        raise CeleryTPError(kind, f"rank {first} [{kind}]: {message}")


def form(rank: int, world_size: int, group_name: str, comm_id: str, timeout_s: float) -> ControlGroup:
    """Form the control channel right after the default (model) group: a gloo group over the same
    ranks and rendezvous, and the shared-memory segment when the ranks share a host. Collective:
    every rank calls it at once."""
    if world_size == 1:
        return ControlGroup(rank, world_size, None, None)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    fast = shm.attach(group_name, comm_id, rank, world_size, timeout_s, control_group=group)
    return ControlGroup(rank, world_size, group, fast)

