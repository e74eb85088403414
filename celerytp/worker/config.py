"""Settings of one rank worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankConfig:
    """Args:
    rank: this worker's rank.
    world_size: ranks in the group.
    group: group name; queues are ``celerytp.<group>.rank.<r>``.
    broker_url: Redis URL (broker, results and coordination keys).
    device: ``auto``, ``cpu`` or ``cuda:K``.
    threads: torch intra-op threads; 0 = the cores divided among the ranks.
    model_roots: directories model paths must lie under (besides the default model's).
    redis_wait_s: how long start-up waits for an unreachable Redis before giving up.
    """

    rank: int
    world_size: int
    group: str
    broker_url: str
    device: str = "auto"
    threads: int = 0
    model_roots: tuple[str, ...] = field(default_factory=tuple)
    redis_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
