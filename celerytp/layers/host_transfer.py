"""Host data onto the model's device, and device results back, without making the host wait more
than once a step (worker/host_syncs.py counts it)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from celerytp.core.switches import DEVICE_PATH_ENV, switch
from celerytp.distributed.late_failures import raise_if_aborted, wait_for_device


def takes_device_path(device: torch.device) -> bool:
    """Whether a model on `device` takes the decisions made for GPUs (shape buckets, no host reads
    in its layers): on CUDA, and on a CPU with CELERYTP_DEVICE_PATH_ON_CPU=1, so that CI runs that path."""
    return device.type == "cuda" or switch(DEVICE_PATH_ENV) == "1"


def to_device(values: list | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (Python data or a host tensor) on `device`: built on the host, pinned where the
    device is a GPU, and copied non_blocking, so the host goes on queueing the step's kernels
    (the caching host allocator keeps a pinned block until its copy is done)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` on the host in one device-to-host copy: flattened into one float32 vector on the
    device, copied, and split again in their shapes. Integer tensors come back as int64 (exact
    below 2**24, as token ids are: the vocabulary-parallel head sends them so too)."""
    if not tensors:
        return []
    wait_for_device()  # the copy waits for every collective queued before it
    joined = torch.cat([t.reshape(-1).float() for t in tensors]).cpu()
    raise_if_aborted()  # a copy that the model group's abort freed holds undefined values
    parts = joined.split([t.numel() for t in tensors])
    return [part.view(t.shape).to(t.dtype if t.is_floating_point() else torch.long) for part, t in zip(parts, tensors)]


_EXPECTED: contextvars.ContextVar[str | None] = contextvars.ContextVar("expected_host_wait", default=None)


@contextlib.contextmanager
def expected_wait(reason: str) -> Iterator[None]:
    """A host wait the code means to make (named `reason`): worker/host_syncs.py counts it under
    that name, outside the step's budget."""
    token = _EXPECTED.set(reason)
    try:
        yield
    finally:
        _EXPECTED.reset(token)


def expected_reason() -> str | None:
    return _EXPECTED.get()
