"""Where a serving step's time goes, when asked: CELERYTP_STEP_PROFILE=1 in a worker's environment.

Each phase adds its nanoseconds to a per-process total; rank 0's serving loop reports the totals
per step as `profile_us_<phase>` in its serving stats (benchmarks/step_cost.py reads them). Off,
every hook is one module-level boolean test, so the loop pays nothing for it.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

ENABLED = os.environ.get("CELERYTP_STEP_PROFILE", "").strip() in ("1", "true", "yes")
T = TypeVar("T")

_totals: dict[str, int] = defaultdict(int)


def timed(phase: str, fn: Callable[[], T]) -> T:
    """Run `fn`, adding its time to `phase` when profiling is on."""
    if not ENABLED:
        return fn()
    start = time.perf_counter_ns()
    try:
        return fn()
    finally:
        _totals[phase] += time.perf_counter_ns() - start


def per_step_us(steps: int) -> dict[str, int]:
    """Each phase's mean µs per step so far (empty when profiling is off)."""
    if not ENABLED or steps <= 0:
        return {}
    return {f"profile_us_{phase}": total // (1000 * steps) for phase, total in _totals.items()}


def reset() -> None:
    _totals.clear()
