"""What in a serving step makes a GPU wait for the host, counted and held to a budget.

On a GPU, a step runs fast only while the host queues its kernels ahead of the device: every read
of a device value (`.cpu()`, `.tolist()`, `.item()`, `int(t)`), every op whose output size depends on
the data (`nonzero`, a boolean mask) and every blocking copy in waits for the device to finish.
`HostSyncs` counts them as the step's Python code calls torch, so it counts the same on a CPU,
where none of them costs anything: CI holds the CUDA path to its budget (`CELERYTP_SYNC_CHECK=1`).

It tells host tensors from the model's by where they came from: a tensor made on the host (a
factory without `device`, `.cpu()`) is a host tensor, and so is anything computed from host
tensors alone; everything else (weights, caches, what they compute, what was sent to the device)
is the model's, whatever its device is.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from celerytp.layers.host_transfer import expected_reason

HOST_READ = "host_read"  # a device value read on the host: waits for the device
DATA_DEPENDENT = "data_dependent"  # an output sized by the data: waits for the device
PYTHON_INPUT = "python_input"  # torch.tensor(python data, device=...): a blocking copy from pageable memory
BLOCKING_INPUT = "blocking_input"  # a host tensor copied in without non_blocking, or mixed into a device op
KINDS = (HOST_READ, DATA_DEPENDENT, PYTHON_INPUT, BLOCKING_INPUT)

_READS = {"cpu", "tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__", "__complex__"}
_SIZED_BY_DATA = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "frombuffer", "from_numpy", "linspace", "eye"}
_HERE = str(Path(__file__))
_PACKAGE = str(Path(__file__).parents[1])


class HostSyncs(TorchFunctionMode):
    """Count, under `with HostSyncs() as syncs:`, what would make a GPU step wait for the host.

    `counts` holds each kind's count (an expected wait under its reason) and `where` the file:line
    in celerytp of each event."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.where: list[tuple[str, str]] = []
        self._host: dict[int, weakref.ref] = {}

    def over(self, budget: dict[str, int]) -> list[str]:
        """One line per kind over its budget (kinds the budget does not name may not happen),
        with where each event came from."""
        return [f"{kind}: {self.counts[kind]} over a budget of {budget.get(kind, 0)} "
                f"({', '.join(at for k, at in self.where if k == kind)})"
                for kind in KINDS if self.counts[kind] > budget.get(kind, 0)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self._classify(name, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if name == "cpu" and out is args[0] and not self._is_host(out):
            out = out.clone()  # what `.cpu()` of a CUDA tensor gives: a host copy, not the same tensor
        if name in _FACTORIES:
            on_host = kwargs.get("device") is None
        elif name in ("to", "cuda"):
            on_host = self._is_host(args[0]) and not _names_a_device(args[1:], kwargs)
        else:
            on_host = name in ("cpu", "pin_memory") or bool(tensors) and all(self._is_host(t) for t in tensors)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._mark(t, on_host)
        return out

    def _classify(self, name: str, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        device = [t for t in tensors if not self._is_host(t)]
        host = [t for t in tensors if self._is_host(t) and t.dim() > 0]  # 0-d host tensors go as scalars
        if name in _READS and device and device[0] is args[0]:
            self._count(HOST_READ)
        elif device and (name in _SIZED_BY_DATA or name == "where" and len(args) == 1
                         or name == "repeat_interleave" and _repeats_by_tensor(args, kwargs)):
            self._count(DATA_DEPENDENT)
        elif name in _INDEXING and any(t.dtype == torch.bool and not self._is_host(t) for t in tensors[1:]):
            self._count(DATA_DEPENDENT)
        elif name in _INDEXING and device and args[0] is device[0] and _has_list(args[1]):
            self._count(BLOCKING_INPUT)  # a Python list index goes to the device as a tensor
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self._count(PYTHON_INPUT)
        elif name in ("to", "cuda") and host and host[0] is args[0] and _names_a_device(args[1:], kwargs):
            if not kwargs.get("non_blocking"):
                self._count(BLOCKING_INPUT)
        elif name in ("copy_", "__setitem__") and tensors and device and host:
            self._count(HOST_READ if self._is_host(args[0]) else BLOCKING_INPUT)
        elif device and host and name not in ("to", "cuda"):
            self._count(BLOCKING_INPUT)  # the op copies its host operands in first

    def _count(self, kind: str) -> None:
        kind = expected_reason() or kind  # a wait the code means (host_transfer.expected_wait): outside the budget
        self.counts[kind] += 1
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(_PACKAGE) and f.filename != _HERE]
        self.where.append((kind, f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"))

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor, on_host: bool) -> None:
        if on_host:
            self._host[id(t)] = weakref.ref(t, lambda _, key=id(t): self._host.pop(key, None))
        else:
            self._host.pop(id(t), None)


def _repeats_by_tensor(args: tuple, kwargs: dict) -> bool:
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and repeats.dim() > 0 and kwargs.get("output_size") is None


def _has_list(index) -> bool:
    return isinstance(index, list) or isinstance(index, tuple) and any(isinstance(i, list) for i in index)


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` call names a device (not only a dtype)."""
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args)
