"""Shared-memory all-reduce and broadcast for the CPU ranks of one host (small tensors only).

A gloo all-reduce of a decode activation costs ~1 ms between two processes, mostly sockets and
wake-ups; through one shared segment it costs a few tens of microseconds. Design:

- Segment: one file under /dev/shm per (group, comm_id), created by rank 0 at init, opened by the
  others, and unlinked as soon as every rank has mapped it, so no name is left behind even when a
  worker is SIGKILLed; the memory goes away with the last mapping (`close` or process exit).
- Data: two sets of one slot per rank; op k uses set k % 2. A rank writes only its own slot and
  everyone reads every slot, so an all-reduce sums slot 0, 1, ... in rank order on every rank and
  all ranks get the same bits.
- Synchronisation: an N x N matrix of process-shared POSIX semaphores (sem_init(pshared=1) in the
  segment, called through ctypes). Each op is an all-to-all barrier: rank r posts inbox[p][r] for
  every peer p after writing its slot, then waits on inbox[r][p] for every peer. POSIX lists
  sem_post and sem_wait among the functions that synchronise memory (XBD 4.12), and glibc
  implements them with release/acquire atomics, so slot writes before a post are visible after
  the matching wait on x86 and ARM alike; no hand-written fences, no compiled extension to build.
  Per-pair semaphores count, so a rank one op ahead cannot be mistaken for the current op, and the
  barrier of op k+1 proves every peer finished reading set k % 2 before it is written again at k+2.
- Waiting: sem_trywait with sched_yield for a short spin (ranks arrive together during decode),
  then a futex sleep in sem_clockwait until the group's deadline, which raises the same kind of
  error as gloo's timeout ("Timed out waiting ...", a DistBackendError), so a dead peer is reported,
  never waited on forever. Sooner than that, a rank that learns its peer is gone (the deadman,
  worker/watchdog.py) aborts the segment: it marks the header and posts every semaphore, so each
  rank's waits, in progress or later, fail at once, a rank stopped meanwhile when it wakes.

The switch: CELERYTP_SHM=0 keeps every collective on gloo; CELERYTP_SHM_MAX_BYTES sets the
largest tensor that goes through the segment (default 1 MiB; larger ones, e.g. prefill, use gloo).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import threading
import time

import torch
import torch.distributed as dist

from celerytp.core.switches import SHM_ENV, switch

log = logging.getLogger(__name__)

ENV_MAX_BYTES = "CELERYTP_SHM_MAX_BYTES"
DEFAULT_MAX_BYTES = 1 << 20
SHM_DIR = "/dev/shm"
SPIN_S = 200e-6  # busy-wait budget before sleeping in the kernel
_LINE = 64  # one semaphore per cache line: no false sharing between inboxes
_MAGIC = 0x43_54_50_53_48_4D_30_31  # "CTPSHM01"
_CLOCK_MONOTONIC = 1
_MAX_VIEWS = 256
_FOLDS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def fold_in_rank_order(parts: list[torch.Tensor] | torch.Tensor, out: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`out` = ((parts[0] op parts[1]) op parts[2]) ...: one order for every element, so every
    rank, and every way of moving the parts (this segment, distributed/tp.py's gloo or NCCL path),
    gets the same bits."""
    fold = _FOLDS[op]
    fold(parts[0], parts[1], out=out)
    for r in range(2, len(parts)):
        fold(out, parts[r], out=out)
    return out


class ShmFailure(dist.DistBackendError):
    """The segment's synchronisation failed (a semaphore, or the group closed under the call): the
    only failures of a shared-memory collective that say something about the group. Anything else
    raised inside one (a tensor op on a bad argument) is the caller's own error and stays as it is."""


class ShmTimeout(ShmFailure):
    """A peer did not reach a shared-memory collective before the group's timeout."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
for _name in ("sem_init", "sem_post", "sem_trywait", "sem_destroy"):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p] + ([ctypes.c_int, ctypes.c_uint] if _name == "sem_init" else [])
# sem_clockwait (glibc >= 2.30) takes a monotonic deadline; sem_timedwait is the portable fallback.
_clockwait = getattr(_libc, "sem_clockwait", None)
if _clockwait is not None:
    _clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
_libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]


def enabled() -> bool:
    return switch(SHM_ENV) == "1"


def segment_name(group: str, comm_id: str) -> str:
    """The /dev/shm file name of a group epoch: only safe characters, bounded length."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"celerytp-{group}-{comm_id}")[:200]


def _layout(world_size: int, slot_bytes: int) -> tuple[int, int]:
    """(offset of the data region, total bytes): header line, N*N semaphores, 2*N slots."""
    data = _LINE * (1 + world_size * world_size)
    return data, data + 2 * world_size * slot_bytes


def _deadline(seconds_from_now: float) -> _Timespec:
    if _clockwait is not None:
        t = time.monotonic() + seconds_from_now
    else:
        t = time.time() + seconds_from_now
    return _Timespec(int(t), int((t % 1) * 1e9))


class ShmGroup:
    """The shared-memory collectives of one group epoch; every rank calls ops in the same order.

    Args:
        mm: the mapped segment (semaphores already initialised by rank 0).
        rank: this rank.
        world_size: ranks in the group.
        slot_bytes: the largest tensor (bytes) an op accepts.
        timeout_s: the deadline of every wait.
    """

    def __init__(self, mm: mmap.mmap, rank: int, world_size: int, slot_bytes: int, timeout_s: float):
        self.rank, self.world_size, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        self._mm = mm
        self._raw = (ctypes.c_char * len(mm)).from_buffer(mm)
        base = ctypes.addressof(self._raw)
        self._inbox = [[base + _LINE * (1 + r * world_size + p) for p in range(world_size)] for r in range(world_size)]
        data, _ = _layout(world_size, slot_bytes)
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self._slots = [
            [self._bytes[data + (s * world_size + r) * slot_bytes :][:slot_bytes] for r in range(world_size)]
            for s in range(2)
        ]
        self._peers = [p for p in range(world_size) if p != rank]
        self._step = 0
        # `abort`: the rank that aborted the group, plus one (0: none), in the header after the nonce
        self._aborted_by = ctypes.c_int64.from_address(base + 16)
        self._why = "it lost a peer"
        self._closing = threading.Lock()  # `abort` runs on another thread: never on an unmapped segment
        self._views: dict[tuple[int, int, torch.dtype, bool], list[torch.Tensor]] = {}  # see `_slots_like`

    # ---- setup and teardown -------------------------------------------------------------

    @classmethod
    def setup(
        cls, name: str, rank: int, world_size: int, timeout_s: float, slot_bytes: int,
        control_group: dist.ProcessGroup | None = None,
    ) -> ShmGroup | None:
        """Collective over `control_group` (a gloo group; None: the default group, which must be
        gloo): every rank maps the segment or nobody uses it.

        Returns None on every rank when any rank cannot map it (another host, no /dev/shm).
        """
        path = os.path.join(SHM_DIR, name)
        _, size = _layout(world_size, slot_bytes)
        mm, ok, nonce = None, 1, 0
        if rank == 0:
            try:
                mm, nonce = _create(path, size, world_size)
            except OSError as exc:
                log.warning("shared-memory collectives off: cannot create %s: %s", path, exc)
                ok = 0
        try:
            token = torch.tensor([nonce], dtype=torch.int64)
            dist.broadcast(token, src=0, group=control_group)  # also orders rank 0's create before the others' open
            if rank != 0:
                try:
                    mm, ok = _open(path, size, int(token.item()))
                except OSError as exc:
                    log.warning("shared-memory collectives off: cannot map %s: %s", path, exc)
                    ok = 0
            flag = torch.tensor([ok], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control_group)
        finally:
            if rank == 0 and mm is not None:
                os.unlink(path)  # every rank that could map it has: the name is never left behind
        if not int(flag.item()):
            if mm is not None:
                mm.close()
            return None
        return cls(mm, rank, world_size, slot_bytes, timeout_s)

    def close(self) -> None:
        """Unmap the segment (the file itself was unlinked at setup)."""
        with self._closing:
            self._slots, self._views, self._bytes, self._raw, self._inbox = [], {}, None, None, []
            self._aborted_by = ctypes.c_int64(0)  # its address dies with the mapping
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the last reference
            log.warning("shared-memory segment still referenced; left to the garbage collector")

    def abort(self, why: str) -> None:
        """Fail every rank's waits in this segment from now on, those in progress included,
        instead of waiting out their deadline: a peer is gone (worker/watchdog.py, from its own
        thread). A rank that was stopped meets the mark when it wakes. The group is broken on
        every rank after this, and re-forms with a new segment."""
        with self._closing:
            if not self._inbox:
                return  # closed: this epoch is over already
            self._why = why
            self._aborted_by.value = self.rank + 1  # written before the posts that make it visible
            for inbox in self._inbox:  # every rank's every wait wakes; later ones fail before they wait
                for sem in inbox:
                    _libc.sem_post(sem)

    # ---- collectives ----------------------------------------------------------------------

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.nbytes <= self.slot_bytes

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` in place (sum, max or min) over the ranks, folding in rank order."""
        flat = tensor.view(-1)
        slots = self._slots_like(self._begin(), flat)
        slots[self.rank].copy_(flat)
        self._barrier()
        fold_in_rank_order(slots, flat, op)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` in place with rank `src`'s value."""
        flat = tensor.view(-1)
        slots = self._slots_like(self._begin(), flat)
        if self.rank == src:
            slots[src].copy_(flat)
        self._barrier()
        if self.rank != src:
            flat.copy_(slots[src])
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` stacked in rank order: (world_size, *tensor.shape)."""
        flat = tensor.view(-1)
        slots = self._slots_like(self._begin(), flat)
        slots[self.rank].copy_(flat)
        self._barrier()
        out = torch.empty((self.world_size, flat.numel()), dtype=tensor.dtype)
        for r in range(self.world_size):
            out[r].copy_(slots[r])
        return out.view(self.world_size, *tensor.shape)

    def _begin(self) -> int:
        if not self._slots:
            raise ShmFailure("shared-memory group is closed")
        self._check_aborted()
        s = self._step & 1
        self._step += 1
        return s

    def _slots_like(self, s: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of set `s` as a flat tensor of `like`'s dtype and size. Kept per
        (set, bytes, dtype): slicing and viewing them anew cost a decode all-reduce ~8 of its
        ~25 µs. Decode reuses a handful of sizes; the bound only stops odd prefill sizes piling up."""
        # Kept apart in and out of inference mode: a view made under it (a forward's, or a compiled
        # decode's warm-up at load) is an inference tensor, which cannot be written outside it (the
        # serving loop's whole-logits gather), and a normal one costs a forward more to write.
        key = (s, like.nbytes, like.dtype, torch.is_inference_mode_enabled())
        slots = self._views.get(key)
        if slots is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            slots = self._views[key] = [slot[: like.nbytes].view(like.dtype) for slot in self._slots[s]]
        return slots

    def _barrier(self) -> None:
        for p in self._peers:
            if _libc.sem_post(self._inbox[p][self.rank]) != 0:
                raise ShmFailure(f"sem_post failed: {os.strerror(ctypes.get_errno())}")
        for p in self._peers:
            self._wait(self._inbox[self.rank][p], p)
        self._check_aborted()  # woken by `abort`, not by the peer: its slot means nothing

    def _check_aborted(self) -> None:
        if by := self._aborted_by.value:
            raise ShmFailure(f"shared-memory collective aborted by rank {by - 1}: {self._why}")

    def _wait(self, sem: int, peer: int) -> None:
        if _libc.sem_trywait(sem) == 0:
            return
        start = time.monotonic()
        while time.monotonic() - start < SPIN_S:
            if _libc.sem_trywait(sem) == 0:
                return
            os.sched_yield()  # lets the peer run when both ranks share a core
        deadline = _deadline(self.timeout_s - (time.monotonic() - start))
        while True:
            rc = _clockwait(sem, _CLOCK_MONOTONIC, deadline) if _clockwait else _libc.sem_timedwait(sem, deadline)
            if rc == 0:
                return
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.ETIMEDOUT:
                raise ShmTimeout(
                    f"shared-memory collective: Timed out waiting {self.timeout_s * 1000:.0f}ms for rank {peer} "
                    f"(op {self._step - 1})"
                )
            raise ShmFailure(f"sem wait failed: {os.strerror(err)}")


def _create(path: str, size: int, world_size: int) -> tuple[mmap.mmap, int]:
    """Create and map the segment, initialise its semaphores, stamp magic and a fresh nonce."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    raw = (ctypes.c_char * size).from_buffer(mm)
    base = ctypes.addressof(raw)
    for i in range(world_size * world_size):
        if _libc.sem_init(base + _LINE * (1 + i), 1, 0) != 0:
            del raw
            mm.close()
            os.unlink(path)
            raise OSError(ctypes.get_errno(), "sem_init failed")
    del raw
    nonce = secrets.randbits(62) + 1
    mm[0:16] = _MAGIC.to_bytes(8, "little") + nonce.to_bytes(8, "little")
    return mm, nonce


def _open(path: str, size: int, nonce: int) -> tuple[mmap.mmap | None, int]:
    """Map rank 0's segment; (None, 0) when it is not there or not the one rank 0 stamped."""
    if nonce == 0:
        return None, 0
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        log.warning("shared-memory collectives off: cannot open %s (another host?): %s", path, exc)
        return None, 0
    try:
        if os.fstat(fd).st_size != size:
            return None, 0
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mm[0:16] != _MAGIC.to_bytes(8, "little") + nonce.to_bytes(8, "little"):
        mm.close()
        return None, 0
    return mm, 1


# ---- the default group's segment (one per process, like torch's default group) ----------

_active: ShmGroup | None = None


def attach(
    group: str, comm_id: str, rank: int, world_size: int, timeout_s: float,
    control_group: dist.ProcessGroup | None = None,
) -> ShmGroup | None:
    """Set up the segment of a group epoch just formed (a collective over `control_group`, a gloo
    group; every rank calls it). It serves the control channel and, for CPU ranks, the model
    group's small collectives: both run in one order on every rank.

    Off (returns None on every rank) when the switch says so or the group is a single rank; every
    rank must see the same switch, since the setup is itself a collective.
    """
    detach()
    if world_size < 2 or not enabled():
        return None
    slot_bytes = int(os.environ.get(ENV_MAX_BYTES, DEFAULT_MAX_BYTES))
    global _active
    _active = ShmGroup.setup(segment_name(group, comm_id), rank, world_size, timeout_s, slot_bytes, control_group)
    return _active


def active() -> ShmGroup | None:
    """The default group's shared-memory collectives, or None (gloo only)."""
    return _active


def detach() -> None:
    """Unmap the default group's segment (the group is being destroyed or re-formed)."""
    global _active
    if _active is not None:
        _active.close()
        _active = None
