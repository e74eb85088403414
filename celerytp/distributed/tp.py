"""The tensor-parallel context a rank hands to its model: rank, world size and the collectives."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from celerytp.core.switches import INVARIANT_ENV, switch
from celerytp.distributed import shm
from celerytp.distributed.control import CollectiveFailed, checked, checked_shm
from celerytp.distributed.late_failures import issue

# Tests set this on every rank to prove that the model's group carries model tensors only (the
# two-channel rule, docs/design.md): any other tensor handed to it is refused loudly.
STRICT_ENV = "CELERYTP_STRICT_MODEL_GROUP"
_STRICT = os.environ.get(STRICT_ENV, "").strip() in ("1", "true", "yes")
RANK_ORDER_GATHER_BYTES = 1 << 20  # `_all_reduce_in_rank_order`: gathered whole up to this


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact division that names both numbers when it is not exact."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


@dataclass(frozen=True)
class TPContext:
    """Rank, world size and process group of one tensor-parallel rank.

    Args:
        rank: this rank's index in the group.
        world_size: number of ranks.
        group: the torch.distributed group; None means the default group (or no group at
            world size 1, where every collective is the identity).
    """

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        _CONTEXTS[self.key] = self  # now: a compiled graph's custom ops only look it up

    @property
    def key(self) -> int:
        """The number a compiled graph's collective ops carry to find this context (`_CONTEXTS`).
        The same in every process for the default group (rank and world size say all of it), so a
        graph compiled by another process, or before a restart, is the same graph: inductor's
        on-disk cache then serves it instead of compiling again (an id() there missed every time)."""
        if self.group is None:
            return self.world_size * _GROUP_KEYS_START + self.rank
        return _GROUP_KEYS.setdefault(id(self.group), len(_GROUP_KEYS) + 1) * _GROUP_KEYS_START ** 2 + self.rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over all ranks and return it (inside a compiled graph: a new
        tensor holding the sum, through the celerytp::all_reduce custom op)."""
        if self.world_size > 1 and torch.compiler.is_compiling():
            return torch.ops.celerytp.all_reduce(tensor, self.key)
        if self.world_size > 1:
            self._check(tensor)
            fast = self._shm(tensor)
            if fast is not None:
                issue(lambda: checked_shm(lambda: fast.all_reduce(tensor)))
            elif self.world_size > 2 and switch(INVARIANT_ENV) == "1":
                self._all_reduce_in_rank_order(tensor)
            else:
                issue(lambda: checked(lambda: dist.all_reduce(tensor, group=self.group)))
        return tensor

    def _all_reduce_in_rank_order(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place folding every element 0 + 1, + 2, ... as the shared-memory path
        does, so a row's sum is the same bits whatever travels beside it, a prefill's as a decode's
        (docs/models.md, "Batch invariance"). A backend's own all-reduce (gloo's ring, NCCL's ring
        or tree) folds each chunk starting from a rank chosen by the tensor's size: at two ranks
        that is a + b either way, from three on a row's sum changes with the batch.

        Up to 1 MiB every rank gathers every rank's tensor and folds it all (one collective: the
        least waiting). Above, rank r takes every rank's r-th chunk (all-to-all), folds those, and
        the ranks gather the folded chunks: the bytes a ring moves, in two collectives
        (benchmarks/collectives.py). Both fold alike, so both give the same bits."""
        flat, world = tensor.view(-1), self.world_size
        if tensor.nbytes <= RANK_ORDER_GATHER_BYTES:
            parts = flat.new_empty(world, flat.numel())
            issue(lambda: checked(lambda: dist.all_gather_into_tensor(parts.view(-1), flat, group=self.group)))
            shm.fold_in_rank_order(parts, flat)
            return
        chunk = -(-flat.numel() // world)
        sent = F.pad(flat, (0, chunk * world - flat.numel()))
        taken = sent.new_empty(world, chunk)  # every rank's chunk `rank`
        issue(lambda: checked(lambda: dist.all_to_all_single(taken.view(-1), sent, group=self.group)))
        mine = shm.fold_in_rank_order(taken, taken.new_empty(chunk))
        issue(lambda: checked(lambda: dist.all_gather_into_tensor(sent, mine, group=self.group)))
        flat.copy_(sent[: flat.numel()])

    def gather_last_dim(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dim in rank order (rank r's is
        sizes[r] wide; uneven widths travel padded to the widest), on every rank."""
        if self.world_size == 1:
            return tensor
        if torch.compiler.is_compiling():
            return torch.ops.celerytp.gather_last_dim(tensor, self.key, sizes)
        if tensor.shape[-1] != sizes[self.rank]:
            raise ValueError(f"rank {self.rank}: last dim {tensor.shape[-1]} != its size {sizes[self.rank]}")
        padded = F.pad(tensor, (0, max(sizes) - tensor.shape[-1])).contiguous()
        self._check(padded)
        fast = self._shm(padded)
        if fast is not None:  # (a failure left unseen: any output will do, as NCCL's is undefined)
            parts = issue(lambda: list(checked_shm(lambda: fast.all_gather(padded)))) or [padded] * self.world_size
        else:
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            issue(lambda: checked(lambda: dist.all_gather(parts, padded, group=self.group)))
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)

    def _check(self, tensor: torch.Tensor) -> None:
        """Strict mode: the model's group takes floating-point activations on the model's device
        (a CUDA tensor on an NCCL group) and nothing else."""
        if not _STRICT:
            return
        on_device = tensor.is_cuda if dist.get_backend(self.group) == "nccl" else True
        if not tensor.is_floating_point() or not on_device:
            raise AssertionError(
                f"control data on the model's group: a {tensor.dtype} tensor on {tensor.device} "
                "(control data goes through the control group, distributed/control.py)"
            )

    def _shm(self, tensor: torch.Tensor) -> shm.ShmGroup | None:
        """The default group's shared-memory path when it is set up and the tensor is small.

        Every rank takes the same path for the same call: the choice depends only on the
        tensor's size, device and layout, which the ranks share.
        """
        fast = shm.active() if self.group is None else None
        if fast is not None and fast.world_size == self.world_size and fast.fits(tensor):
            return fast
        return None


# ---- the collectives as custom ops, so a compiled decode step is one graph ---------------------
# torch.compile cannot trace into gloo or the shared-memory segment; as opaque custom ops the
# collectives stay in the graph (no graph break per layer) and run eagerly when it executes.
# The ops take only tensors and numbers, so they carry a context's `key`; every TPContext is
# entered here when it is made (held weakly). Equal contexts share a key: they are
# interchangeable (same rank, world size and group).
_CONTEXTS: weakref.WeakValueDictionary[int, TPContext] = weakref.WeakValueDictionary()
_GROUP_KEYS: dict[int, int] = {}  # id(process group) -> its number, for contexts off the default group
_GROUP_KEYS_START = 1 << 16  # above any rank


# Defined through torch.library.Library rather than the `custom_op` decorator: a decode step
# calls the all-reduce 61 times, and the decorator's Python wrapper cost ~10 µs a call more.
_LIB = torch.library.Library("celerytp", "DEF")
_LIB.define("all_reduce(Tensor tensor, int key) -> Tensor")
_LIB.define("gather_last_dim(Tensor tensor, int key, int[] sizes) -> Tensor")


class _OpFailure(threading.local):
    """The CollectiveFailed an op last raised on this thread. A compiled graph whose wrapper is C++
    (inductor's cpp_wrapper) reports an op's exception as a plain RuntimeError naming the op, so
    its caller looks the collectives' own error up here (`collective_failure`)."""

    error: CollectiveFailed | None = None


_OP_FAILURE = _OpFailure()


def _recording_failure(collective: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    try:
        return collective(*args)
    except CollectiveFailed as exc:
        _OP_FAILURE.error = exc
        raise


def _all_reduce_op(tensor: torch.Tensor, key: int) -> torch.Tensor:
    return _recording_failure(_CONTEXTS[key].all_reduce, tensor.clone())


def _gather_last_dim_op(tensor: torch.Tensor, key: int, sizes: list[int]) -> torch.Tensor:
    return _recording_failure(_CONTEXTS[key].gather_last_dim, tensor.contiguous(), sizes)


def forget_collective_failure() -> None:
    """Drop a failure recorded by an op, before code whose failures `collective_failure` reads."""
    _OP_FAILURE.error = None


def collective_failure() -> CollectiveFailed | None:
    """The CollectiveFailed a collective op raised on this thread since `forget_collective_failure`."""
    return _OP_FAILURE.error


_LIB.impl("all_reduce", _all_reduce_op, "CompositeExplicitAutograd")
_LIB.impl("gather_last_dim", _gather_last_dim_op, "CompositeExplicitAutograd")


@torch.library.register_fake("celerytp::all_reduce", lib=_LIB)
def _(tensor: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(tensor)


@torch.library.register_fake("celerytp::gather_last_dim", lib=_LIB)
def _(tensor: torch.Tensor, key: int, sizes: list[int]) -> torch.Tensor:
    return tensor.new_empty(*tensor.shape[:-1], sum(sizes))
