"""The model group's abort in one process on this device (a row of benchmarks/gpu_check.py).

Run: python benchmarks/group_abort.py [--device cuda|cpu]

A rank whose peer is lost aborts its model group and keeps its process (worker/watchdog.py,
distributed/late_failures.py); on CUDA that is ncclCommAbort. The lent GPU machines have one GPU,
and NCCL takes one device per rank, so no two-rank NCCL group can lose a peer there. What one
process can check is every step around the abort: a 1-rank group (NCCL on CUDA, gloo on a CPU)
formed as a worker forms it and used; aborted as the deadman aborts it; the next copy from the
device refused; the process still alive after NCCL's own watchdog had time to act
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3, as the worker sets it); the group destroyed and formed again,
and used again. Prints one line; exit 0 when every step held, 1 when one did not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WATCHDOG_WAIT_S = 5.0  # NCCL's watchdog polls every second or so: time for it to act on the abort


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # as worker/state.py sets it
    import torch
    import torch.distributed as dist

    from celerytp.distributed.control import CollectiveFailed
    from celerytp.distributed.late_failures import ABORT_GRACE_S, abort_model_group, forget_abort
    from celerytp.layers.host_transfer import to_host

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    steps: list[str] = []

    def form(name: str) -> float:
        started = time.monotonic()
        store = dist.FileStore(str(Path(tempfile.mkdtemp()) / name), 1)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60), **kwargs)
        tensor = torch.ones(4, device=device)
        dist.all_reduce(tensor)
        assert to_host([tensor])[0].tolist() == [1.0] * 4, "the all-reduce gave a wrong sum"
        return time.monotonic() - started

    try:
        steps.append(f"{backend} group formed and used in {form('first'):.2f} s")
        started = time.monotonic()
        aborted = abort_model_group("group_abort check", ABORT_GRACE_S)
        if backend == "nccl" and not aborted:
            raise AssertionError(f"the NCCL communicator's abort did not return within {ABORT_GRACE_S} s")
        steps.append(f"abort {'returned' if aborted else 'had nothing to abort (gloo)'} in {time.monotonic() - started:.2f} s")
        try:
            to_host([torch.ones(1, device=device)])
            raise AssertionError("a copy from the device after the abort was not refused")
        except CollectiveFailed as exc:
            steps.append(f"next copy refused ({exc})")
        if backend == "nccl":
            time.sleep(WATCHDOG_WAIT_S)
            steps.append(f"alive {WATCHDOG_WAIT_S:.0f} s later")
        started = time.monotonic()
        dist.destroy_process_group()
        forget_abort()
        steps.append(f"destroyed in {time.monotonic() - started:.2f} s")
        steps.append(f"formed again and used in {form('second'):.2f} s")
        if device.type == "cuda":
            product = torch.randn(64, 64, device=device) @ torch.eye(64, device=device)
            torch.cuda.synchronize()
            steps.append(f"device work after it: ok ({tuple(product.shape)})")
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - report the step that failed, and what held before it
        print("group_abort: FAIL: " + "; ".join(steps + [f"{type(exc).__name__}: {exc}"]))
        return 1
    print("group_abort: " + "; ".join(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
