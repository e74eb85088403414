"""The rank workers' environment switches, read in one place (no torch here), so that the CLI
refuses a mistyped value before it starts anything, and a worker's load fails on it before it
reads a weight. The test suite runs every one at its default (tests/conftest.py sets none); a test
that needs another value sets it itself and says why.

| variable | values (default first) | what it switches |
|---|---|---|
| CELERYTP_COMPILE | auto, 1, 0 | compiled decode (models/compiled.py) |
| CELERYTP_BATCH_INVARIANT | 1, 0 | attention in one fixed order per query (layers/invariant_attention.py) |
| CELERYTP_RECURRENT_PREFILL | steps, chunks | a hybrid model's Gated DeltaNet prefills token by token as decode does, or by the faster chunked rule (layers/gated_deltanet.py) |
| CELERYTP_PACK_LINEARS | auto, 1, 0 | float linears packed for oneDNN (layers/packed_linear.py) |
| CELERYTP_QUANT_KERNEL | auto, dequant, int8pack | the kernel of ggml-format linears (layers/quantized.py) |
| CELERYTP_SHM | 1, 0 | same-host collectives through shared memory (distributed/shm.py) |
| CELERYTP_ALLOW_SLOW_HALF | 0, 1 | load half-precision weights where they decode slower (models/half_precision.py) |
| CELERYTP_DEVICE_PATH_ON_CPU | 0, 1 | a CPU rank takes a CUDA rank's decisions (layers/host_transfer.py `takes_device_path`) |
| CELERYTP_SYNC_CHECK | 0, 1 | fail a serving step that makes the host wait for the device more than its budget (worker/host_syncs.py) |
| CELERYTP_ASYNC_FAILURES | 0, raise, block, hang | tests only: a CPU group's model collectives fail as NCCL's do, seen at the next host sync (distributed/late_failures.py) |

1 and 0 may also be written true / yes / on and false / no / off.
"""

from __future__ import annotations

import os

COMPILE_ENV = "CELERYTP_COMPILE"
INVARIANT_ENV = "CELERYTP_BATCH_INVARIANT"
PACK_ENV = "CELERYTP_PACK_LINEARS"
KERNEL_ENV = "CELERYTP_QUANT_KERNEL"
SHM_ENV = "CELERYTP_SHM"
RECURRENT_PREFILL_ENV = "CELERYTP_RECURRENT_PREFILL"
ALLOW_SLOW_HALF_ENV = "CELERYTP_ALLOW_SLOW_HALF"
DEVICE_PATH_ENV = "CELERYTP_DEVICE_PATH_ON_CPU"
SYNC_CHECK_ENV = "CELERYTP_SYNC_CHECK"
ASYNC_FAILURES_ENV = "CELERYTP_ASYNC_FAILURES"
SWITCHES = {
    COMPILE_ENV: ("auto", "1", "0"),
    INVARIANT_ENV: ("1", "0"),
    PACK_ENV: ("auto", "1", "0"),
    KERNEL_ENV: ("auto", "dequant", "int8pack"),
    SHM_ENV: ("1", "0"),
    RECURRENT_PREFILL_ENV: ("steps", "chunks"),
    ALLOW_SLOW_HALF_ENV: ("0", "1"),
    DEVICE_PATH_ENV: ("0", "1"),
    SYNC_CHECK_ENV: ("0", "1"),
    ASYNC_FAILURES_ENV: ("0", "raise", "block", "hang"),
}
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str) -> str:
    """`name`'s value as one of SWITCHES[name] (unset or empty: the first, its default);
    ValueError naming the variable and its values for anything else."""
    values = SWITCHES[name]
    value = os.environ.get(name, "").strip().lower() or values[0]
    if value in _ON and "1" in values:
        return "1"
    if value in _OFF and "0" in values:
        return "0"
    if value not in values:
        raise ValueError(f"{name} must be {', '.join(values[:-1])} or {values[-1]}, got {value!r}")
    return value


def check_switches() -> None:
    """Every switch's value, or ValueError naming the first that is not one."""
    for name in SWITCHES:
        switch(name)
