"""Prometheus metrics of one server: request counts, token counts, latencies, and the ranks' state
read at scrape time (queue depth, running rows, rank heartbeats)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RankState:
    """A collector that asks the leader for queue and rank figures when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, int]]], ranks_up: Callable[[], list[bool]]):
        self._stats = stats
        self._ranks_up = ranks_up

    def collect(self) -> Iterable[GaugeMetricFamily]:
        queued = GaugeMetricFamily("celerytp_queue_depth", "requests waiting for a KV-cache row", labels=["model"])
        running = GaugeMetricFamily("celerytp_running_rows", "requests decoding in the serving loop", labels=["model"])
        for model, stats in self._stats().items():
            queued.add_metric([model], stats.get("queued", 0))
            running.add_metric([model], stats.get("running_rows", 0) if stats.get("loop_running") else 0)
        up = GaugeMetricFamily("celerytp_rank_up", "1 while the rank's worker heartbeat is live", labels=["rank"])
        for rank, alive in enumerate(self._ranks_up()):
            up.add_metric([str(rank)], int(alive))
        yield from (queued, running, up)


class Metrics:
    """The server's own registry (not the process-global one: several servers in one process stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("celerytp_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("celerytp_prompt_tokens", "prompt tokens of served requests", ["model"], registry=r)
        self.generated_tokens = Counter("celerytp_generated_tokens", "tokens generated", ["model"], registry=r)
        self.finished = Counter("celerytp_finished_requests", "served requests by how they ended (stop, length, cancelled)",
                                ["model", "reason"], registry=r)
        self.ttft = Histogram("celerytp_time_to_first_token_seconds", "request start to its first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("celerytp_inter_token_seconds", "mean time between tokens of a request",
                                     ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.chord_latency = Histogram("celerytp_chord_seconds", "admin ops (load, unload) through chords", ["op"],
                                       buckets=LATENCY_BUCKETS, registry=r)

    def watch(self, collector: RankState) -> None:
        self.registry.register(collector)

    def served(
        self, model: str, prompt_tokens: int, completion_tokens: int, ttft_s: float, decode_s: float, reason: str
    ) -> None:
        self.finished.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generated_tokens.labels(model).inc(completion_tokens)
        if completion_tokens:
            self.ttft.labels(model).observe(ttft_s)
        if completion_tokens > 1:
            self.inter_token.labels(model).observe(decode_s / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
