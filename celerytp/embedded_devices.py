"""Which device the ranks of an embedded cluster (`celerytp generate`/`serve` without --broker) use."""

from __future__ import annotations

import glob

from celerytp.core.errors import CeleryTPError, ErrorKind

EMBEDDED_DEVICES = ("auto", "cpu", "cuda")


def gpu_count() -> int:
    """CUDA devices torch can use here; 0 without touching torch where no NVIDIA device node
    exists (the CLI stays quick on CPU machines)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def embedded_device(spec: str, ranks: int, gpus: int | None = None) -> str:
    """The worker `--device` for `ranks` local ranks: `cuda` and `auto` give rank r cuda:r (NCCL
    refuses two ranks on one GPU, so there must be a GPU per rank), `auto` falls back to the CPU
    with fewer; `cpu` is the CPU. A `cuda` that cannot be met is a bad_request, before anything starts."""
    if spec not in EMBEDDED_DEVICES:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"--device must be one of {', '.join(EMBEDDED_DEVICES)}, got {spec!r}")
    if spec == "cpu":
        return "cpu"
    gpus = gpu_count() if gpus is None else gpus
    if gpus >= ranks:
        return "auto"  # a worker resolves auto to cuda:(rank % GPUs), here cuda:rank
    if spec == "cuda":
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"--device cuda: {ranks} rank(s) need a GPU each, found {gpus}")
    return "cpu"
