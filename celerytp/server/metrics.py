"""Prometheus metrics: the set vLLM exports, under names that map one to one (docs/serving.md has
the table), plus per-group and per-rank health.

What served requests add up to (tokens, finish reasons, latency histograms) is kept in Redis, not
in this process: the HTTP API and every `celerytp.generate` front-door worker add to the same
counters (`record_served`), so `/metrics` of any server shows all the traffic of the Redis it
uses. Gauges (running and waiting requests, KV-cache usage, rank heartbeats) are read from Redis
at scrape time, and so are the serving loops' failures by kind (core/loop_failures.py). Only the
HTTP server's own figures (requests by endpoint and status, admin chord latency) live in this
process's registry.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from celerytp.client.registry import discover_groups, served
from celerytp.core.keys import loop_key, loop_stats_key, queue_key
from celerytp.core.liveness import read_owners
from celerytp.core.loop_failures import USUAL_KINDS, counted_loops, loop_failures

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)

# histogram key -> (metric name, help, buckets); the vLLM name each maps to is in docs/serving.md
HISTOGRAMS = {
    "ttft": ("celerytp_time_to_first_token_seconds", "submission (queue time included) to the first token",
             LATENCY_BUCKETS),
    "itl": ("celerytp_inter_token_latency_seconds", "time between consecutive tokens of a request, one per gap",
            TOKEN_GAP_BUCKETS),
    "e2e": ("celerytp_e2e_request_latency_seconds", "a request from its submission to its end", REQUEST_BUCKETS),
    "queue": ("celerytp_request_queue_time_seconds", "a request waiting in the queue for a KV-cache row",
              REQUEST_BUCKETS),
}
FINISH_REASONS = ("stop", "length", "cancelled", "error")
NOT_RUN = ("bad_request", "model_not_loaded", "overloaded")  # refused before it ran: not a finished request


def served_key(model_id: str) -> str:
    """Hash of the model's served-request counters (fields below), shared by every front door.
    Outside `celerytp:<group>:`, so no group name can collide with it."""
    return f"celerytp-metrics:model:{model_id}"


def served_models_key() -> str:
    """Set of the model ids that have counters."""
    return "celerytp-metrics:models"


def _observe(tally: Tally, name: str, value: float, fields: dict[str, float]) -> None:
    buckets = HISTOGRAMS[name][2]
    tally[f"{name}:b{bisect.bisect_left(buckets, value)}"] += 1  # le is inclusive: the first bound >= value
    fields[f"{name}:sum"] = fields.get(f"{name}:sum", 0.0) + value


def record_served(client: redis.Redis, model_id: str, result: Any) -> None:
    """Add one finished request (a GenerationResult, cancelled ones included) to the counters."""
    tally: Tally = Tally()
    sums: dict[str, float] = {}
    reason = result.finish_reason if result.finish_reason in FINISH_REASONS else "stop"
    tally[f"finished:{reason}"] += 1
    tally["prompt_tokens"] += result.prompt_tokens
    tally["generation_tokens"] += result.completion_tokens
    tally["preemptions"] += int(bool(getattr(result, "resumed", False)))
    tally["images"] += getattr(result, "images", 0)
    if result.completion_tokens:
        _observe(tally, "ttft", result.ttft_s, sums)
    for gap in getattr(result, "token_gaps_s", None) or ():
        _observe(tally, "itl", gap, sums)
    _observe(tally, "e2e", result.total_s or result.ttft_s + result.decode_s, sums)
    _observe(tally, "queue", result.queued_s, sums)
    _write(client, model_id, tally, sums)


def record_error(client: redis.Redis, model_id: str, kind: str) -> None:
    """Count a request that ended in an error (one refused before it ran is not counted)."""
    if str(kind) not in NOT_RUN:
        _write(client, model_id, Tally({"finished:error": 1}), {})


def _write(client: redis.Redis, model_id: str, tally: Tally, sums: dict[str, float]) -> None:
    try:
        pipe = client.pipeline(transaction=False)
        pipe.sadd(served_models_key(), model_id)
        for field, count in tally.items():
            if count:
                pipe.hincrby(served_key(model_id), field, count)
        for field, value in sums.items():
            pipe.hincrbyfloat(served_key(model_id), field, value)
        pipe.execute()
    except redis.RedisError as exc:  # the request is answered anyway; a metric is lost
        log.warning("could not count a request of %s: %s", model_id, exc)


def with_model_name(family: Metric) -> Metric:
    """`family` with vLLM's `model_name` label beside each `model` label, same value: vLLM's
    dashboards then work with the metric prefix changed only."""
    family.samples = [s._replace(labels={**s.labels, "model_name": s.labels["model"]}) if "model" in s.labels else s
                      for s in family.samples]
    return family


class ServedCollector:
    """Counters and histograms of served requests, read from Redis at scrape time."""

    def __init__(self, client: Callable[[], redis.Redis]):
        self._client = client

    def collect(self) -> Iterable[Any]:
        try:
            families = list(self._families(self._client()))
        except redis.RedisError as exc:  # Redis down: the scrape shows the rest (and celerytp_rank_up goes missing)
            log.warning("metrics: cannot read the request counters from Redis: %s", exc)
            return
        yield from map(with_model_name, families)

    def _families(self, client: redis.Redis) -> Iterable[Any]:
        models = sorted(m.decode() for m in client.smembers(served_models_key()))
        pipe = client.pipeline(transaction=False)
        for model in models:
            pipe.hgetall(served_key(model))
        counts = {m: {k.decode(): float(v) for k, v in h.items()} for m, h in zip(models, pipe.execute())}
        success = CounterMetricFamily("celerytp_request_success", "finished requests by finish reason",
                                      labels=["model", "finished_reason"])
        finished = CounterMetricFamily("celerytp_finished_requests",
                                       "finished requests by reason (older name of celerytp_request_success)",
                                       labels=["model", "reason"])
        prompt = CounterMetricFamily("celerytp_prompt_tokens", "prompt tokens of finished requests", labels=["model"])
        generation = CounterMetricFamily("celerytp_generation_tokens", "tokens generated", labels=["model"])
        generated = CounterMetricFamily("celerytp_generated_tokens",
                                        "tokens generated (older name of celerytp_generation_tokens)", labels=["model"])
        preempted = CounterMetricFamily("celerytp_num_preemptions",
                                        "requests resumed after the group running them failed", labels=["model"])
        images = CounterMetricFamily("celerytp_images", "images in the prompts of finished requests", labels=["model"])
        for model, c in counts.items():
            for reason in FINISH_REASONS:
                success.add_metric([model, reason], c.get(f"finished:{reason}", 0))
                finished.add_metric([model, reason], c.get(f"finished:{reason}", 0))
            prompt.add_metric([model], c.get("prompt_tokens", 0))
            generation.add_metric([model], c.get("generation_tokens", 0))
            generated.add_metric([model], c.get("generation_tokens", 0))
            preempted.add_metric([model], c.get("preemptions", 0))
            images.add_metric([model], c.get("images", 0))
        yield from (success, finished, prompt, generation, generated, preempted, images)
        for key, (name, help_text, bounds) in HISTOGRAMS.items():
            family = HistogramMetricFamily(name, help_text, labels=["model"])
            for model, c in counts.items():
                running, buckets = 0.0, []
                for i, bound in enumerate([*bounds, float("inf")]):
                    running += c.get(f"{key}:b{i}", 0)
                    buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
                family.add_metric([model], buckets, c.get(f"{key}:sum", 0.0))
            yield family


class _ReadFromRedis:
    """A collector whose families are read from Redis at scrape time (`_families`); when Redis
    cannot be read it yields none and logs why, so the scrape still answers."""

    reading = ""  # what it reads, for the log

    def __init__(self, client: Callable[[], redis.Redis]):
        self._client = client

    def collect(self) -> Iterable[Metric]:
        try:
            families = list(self._families(self._client()))
        except redis.RedisError as exc:
            log.warning("metrics: cannot read %s from Redis: %s", self.reading, exc)
            return
        yield from map(with_model_name, families)

    def _families(self, client: redis.Redis) -> Iterable[Metric]:
        raise NotImplementedError


class ClusterState(_ReadFromRedis):
    """Gauges read from Redis at scrape time: requests running and waiting, KV-cache usage, loop
    state, and the heartbeats of every group's ranks."""

    reading = "the cluster state"

    def __init__(self, client: Callable[[], redis.Redis], group: str, world_size: int):
        super().__init__(client)
        self.group = group
        self.world_size = world_size

    def _families(self, client: redis.Redis) -> Iterable[GaugeMetricFamily]:
        models = served(client)
        waiting = GaugeMetricFamily("celerytp_num_requests_waiting", "requests queued for a KV-cache row",
                                    labels=["model"])
        running = GaugeMetricFamily("celerytp_num_requests_running", "requests in a serving loop's KV-cache rows",
                                    labels=["model", "group"])
        usage = GaugeMetricFamily("celerytp_kv_cache_usage_perc",
                                  "fraction (0-1) of the KV-cache rows of the model in use", labels=["model", "group"])
        looping = GaugeMetricFamily("celerytp_serving_loop_running",
                                    "1 while the group's serving loop of the model runs", labels=["model", "group"])
        depth = GaugeMetricFamily("celerytp_queue_depth",
                                  "requests waiting (older name of celerytp_num_requests_waiting)", labels=["model"])
        rows = GaugeMetricFamily("celerytp_running_rows",
                                 "requests decoding on every replica (older name; see celerytp_num_requests_running)",
                                 labels=["model"])
        pipe = client.pipeline(transaction=False)
        for model, record in models.items():
            pipe.llen(queue_key(model))
            for group in sorted(record["replicas"]):
                pipe.exists(loop_key(group, model))
                pipe.hget(loop_stats_key(group, model), "running_rows")
        answers = iter(pipe.execute())
        for model, record in models.items():
            queued = next(answers)
            waiting.add_metric([model], queued)
            depth.add_metric([model], queued)
            total = 0
            for group in sorted(record["replicas"]):
                alive, rows_now = next(answers), next(answers)
                count = int(rows_now or 0) if alive else 0
                total += count
                running.add_metric([model, group], count)
                looping.add_metric([model, group], int(bool(alive)))
                usage.add_metric([model, group], count / max(1, int(record.get("max_batch") or 1)))
            rows.add_metric([model], total)
        yield from (waiting, running, usage, looping, depth, rows)
        yield from self._health(client, models)

    def _health(self, client: redis.Redis, models: dict[str, dict]) -> Iterable[GaugeMetricFamily]:
        groups = {self.group: self.world_size, **discover_groups(client)}
        for record in models.values():
            for group, size in record["replicas"].items():
                groups[group] = max(size, groups.get(group, 0))
        rank_up = GaugeMetricFamily("celerytp_rank_up",
                                    "1 while the rank's worker heartbeat is live (this server's group)", labels=["rank"])
        group_rank_up = GaugeMetricFamily("celerytp_group_rank_up", "1 while the rank's worker heartbeat is live",
                                          labels=["group", "rank"])
        group_up = GaugeMetricFamily("celerytp_group_up", "1 while every rank of the group has a live worker",
                                     labels=["group"])
        size = GaugeMetricFamily("celerytp_group_world_size", "ranks of the group", labels=["group"])
        for group, world_size in sorted(groups.items()):
            owners = read_owners(client, group, world_size)
            for rank, owner in enumerate(owners):
                group_rank_up.add_metric([group, str(rank)], int(owner is not None))
                if group == self.group:
                    rank_up.add_metric([str(rank)], int(owner is not None))
            group_up.add_metric([group], int(all(owner is not None for owner in owners)))
            size.add_metric([group], world_size)
        yield from (rank_up, group_rank_up, group_up, size)


class LoopFailures(_ReadFromRedis):
    """celerytp_serving_loop_failures_total{model, kind, group}: the groups' serving loops that
    failed, by kind, read from Redis at scrape time (every replica shows the usual kinds at 0 from
    the start; a loop that ended well is not counted)."""

    reading = "the serving loops' failures"

    def _families(self, client: redis.Redis) -> Iterable[CounterMetricFamily]:
        pairs = counted_loops(client)
        pairs |= {(group, model) for model, record in served(client).items() for group in record["replicas"]}
        family = CounterMetricFamily("celerytp_serving_loop_failures",
                                     "serving loops that failed, by error kind (an idle exit is not a failure)",
                                     labels=["model", "kind", "group"])
        for (group, model), counts in sorted(loop_failures(client, sorted(pairs)).items()):
            for kind in sorted({*map(str, USUAL_KINDS), *counts}):
                family.add_metric([model, kind, group], counts.get(kind, 0))
        yield family


class RankMemory:
    """celerytp_rank_memory_bytes{group, rank, kind}: each live rank's memory as it reports it at
    scrape time (worker/memory.py): its device's free and total, its models' weights and KV
    cache, and its peak."""

    def __init__(self, group: str, statuses: Callable[[], list[dict[str, Any]]]):
        self.group = group
        self._statuses = statuses

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("celerytp_rank_memory_bytes", "a rank's memory by kind: free, total (its "
                                   "device's), weights, kv_cache, peak", labels=["group", "rank", "kind"])
        try:
            statuses = self._statuses()
        except Exception as exc:  # noqa: BLE001 - Redis or the broker down: the scrape shows the rest
            log.warning("metrics: cannot ask the ranks for their memory: %s", exc)
            statuses = []
        for status in sorted(statuses, key=lambda s: s["rank"]):
            for kind, value in sorted((status.get("memory") or {}).items()):
                family.add_metric([self.group, str(status["rank"]), kind], value)
        yield family


class Metrics:
    """The server's registry (not the process-global one: several servers in one process stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("celerytp_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.chord_latency = Histogram("celerytp_chord_seconds", "admin ops (load, unload) through chords", ["op"],
                                       buckets=LATENCY_BUCKETS, registry=r)

    def watch(self, collector: Any) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def watch_cluster(metrics: Metrics, client: Callable[[], redis.Redis], group: str, world_size: int) -> None:
    """Add the Redis-backed collectors of a group's cluster to `metrics`."""
    metrics.watch(ServedCollector(client))
    metrics.watch(ClusterState(client, group, world_size))
    metrics.watch(LoopFailures(client))
