"""The rank workers' environment switches, read in one place (no torch here), so that the CLI
refuses a mistyped value before it starts anything, and a worker's load fails on it before it
reads a weight.

| variable | values | what it switches |
|---|---|---|
| CELERYTP_COMPILE | auto (default), 1, 0 | compiled decode (models/compiled.py) |
| CELERYTP_PACK_LINEARS | auto (default), 1, 0 | float linears packed for oneDNN (layers/packed_linear.py) |

1 and 0 may also be written true / yes / on and false / no / off.
"""

from __future__ import annotations

import os

COMPILE_ENV = "CELERYTP_COMPILE"
PACK_ENV = "CELERYTP_PACK_LINEARS"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str) -> str:
    """`name`'s value as "auto", "1" or "0" (unset: auto); ValueError for anything else."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in _ON:
        return "1"
    if value in _OFF:
        return "0"
    if value != "auto":
        raise ValueError(f"{name} must be auto, 1 or 0, got {value!r}")
    return value


def check_switches() -> None:
    """Every switch's value, or ValueError naming the first that is not one."""
    for name in (COMPILE_ENV, PACK_ENV):
        switch(name)
