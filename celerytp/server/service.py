"""What both front doors (HTTP and the Celery task) do with a request: find the model, run it on
the leader, count it. Blocking calls: the HTTP API runs them in its thread pool."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from celerytp.client.generation import GenerationResult, TokenStream, tokenized
from celerytp.client.leader import Leader
from celerytp.client.registry import replicas
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.images import ImageLimits
from celerytp.core.liveness import read_owners
from celerytp.core.redis_client import broker_errors
from celerytp.core.secrets import clipped
from celerytp.core.tokenizer import load_tokenizer
from celerytp.core.validation import check_tokens
from celerytp.server.limits import RequestLimits
from celerytp.server.metrics import Metrics, RankMemory, record_error, record_served, watch_cluster


def error_code(kind: ErrorKind) -> str:
    """The error kind clients see, over HTTP (`code`) and on the Celery task (its message's
    prefix) alike: `model_not_found` (OpenAI's name) for an unknown model, else the kind itself."""
    return "model_not_found" if kind is ErrorKind.MODEL_NOT_LOADED else str(kind)


def rank_statuses(leader: Leader, timeout: float = 1.0) -> list[dict[str, Any]]:
    """What each live rank of the leader's group says of itself (the `celerytp_status`
    remote-control command, answered even while an op runs: its models, RSS and memory); a rank
    with no live worker or no answer is left out."""
    beats = leader.health()
    names = [f"celerytp.{leader.group}.rank{rank}@{beat['host']}" for rank, beat in enumerate(beats) if beat]
    if not names:
        return []
    answers = leader.app.control.broadcast(
        "celerytp_status", destination=names, reply=True, timeout=timeout, limit=len(names)
    ) or []  # public remote control: a list of {worker name: reply}
    replies = [reply for answer in answers for reply in answer.values() if isinstance(reply, dict)]
    return [r for r in replies if r.get("group") == leader.group and "rank" in r]


def held_by_ranks(leader: Leader, timeout: float = 1.0) -> dict[int, set[str]]:
    """The models each live rank holds now, asked of the rank workers themselves (`rank_statuses`)."""
    return {r["rank"]: set(r["models"]) for r in rank_statuses(leader, timeout)}


class Service:
    """Args:
    leader: the group's leader client.
    metrics: where served requests are counted (None: not counted).
    limits: what one request may ask (server/limits.py), checked by both front doors.
    images: a chat's images: how many, how large, and the media domains whose image URLs are
        fetched (core/images.py); None: from $CELERYTP_ALLOWED_MEDIA_DOMAINS and
        $CELERYTP_MEDIA_FETCH_TIMEOUT (the front door's worker, as `celerytp serve` starts it).
    """

    def __init__(self, leader: Leader, metrics: Metrics | None = None, limits: RequestLimits | None = None,
                 images: ImageLimits | None = None):
        self.leader = leader
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.images = images if images is not None else ImageLimits.from_env(os.environ)
        if metrics is not None:
            watch_cluster(metrics, lambda: leader.redis, leader.group, leader.world_size)
            metrics.watch(RankMemory(leader.group, lambda: rank_statuses(leader)))

    def models(self) -> dict[str, dict]:
        return self.leader.models()

    def loaded(self) -> dict[str, dict]:
        """The model records of every served model, each with its `replicas`; a model this group
        serves is listed only when every rank here confirms it holds it now (a record left by
        workers that restarted is not); when some rank cannot answer, the records as they are."""
        records = self.models()
        held = held_by_ranks(self.leader)
        if len(held) < self.leader.world_size:
            return records
        return {model: record for model, record in records.items()
                if self.leader.group not in record["replicas"] or all(model in h for h in held.values())}

    def resolve(self, name: str | None) -> str:
        """The model id a request names (or the one model served, when it names none). A name
        the registry lacks is looked for once more after rebuilding the registry from the ranks
        (Redis may have restarted without its data)."""
        models = self.models()
        if (name is None and not models) or (name is not None and name not in models):
            self.leader.rebuild_registry()
            models = self.models()
        if name is None:
            if len(models) != 1:
                raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'model': required; loaded: {sorted(models)}")
            return next(iter(models))
        if name not in models:
            raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED,
                                f"model {clipped(name)!r} is not loaded; loaded: {sorted(models)}")
        return name

    def tokenize(self, model_id: str, prompt: str | None, messages: list[dict] | None) -> dict[str, Any]:
        """vLLM's /tokenize answer: the ids a completion (`prompt`) or a chat (`messages`) would feed."""
        record = self.models()[model_id]
        _, ids, _ = tokenized(record, prompt, messages, image_limits=self.images)
        return {"count": len(ids), "max_model_len": record["max_context"], "tokens": ids}

    def detokenize(self, model_id: str, tokens: list[int]) -> dict[str, str]:
        record = self.models()[model_id]
        if tokens:
            check_tokens(tokens, max_context=len(tokens), vocab_size=record["vocab_size"], field="tokens")
        return {"prompt": self.decoder(model_id)(tokens)}

    def decoder(self, model_id: str) -> Callable[[list[int]], str]:
        """Token ids -> text with the model's tokenizer (cached per path)."""
        return load_tokenizer(self.models()[model_id]["path"]).decode

    @broker_errors
    def require_ranks(self, model_id: str) -> None:
        """Refuse at once (rank_lost, naming the ranks) when every group serving the model has a
        rank with no live worker: its request would otherwise wait for a loop that cannot run.
        One whole replica is enough."""
        dead = {}
        for group, world_size in sorted(replicas(self.leader.redis, model_id).items()):
            missing = [rank for rank, owner in enumerate(read_owners(self.leader.redis, group, world_size)) if owner is None]
            if not missing:
                return
            dead[group] = missing
        if dead:
            named = "; ".join(f"rank(s) {ranks} of group {group!r}" for group, ranks in dead.items())
            raise CeleryTPError(ErrorKind.RANK_LOST, f"no live worker holds {named}")

    def generate(self, model_id: str, options: dict[str, Any]) -> GenerationResult:
        self.require_ranks(model_id)
        try:
            result = self.leader.generate(model_id, image_limits=self.images, **options)
        except CeleryTPError as exc:
            self.count_error(model_id, exc)
            if exc.kind is ErrorKind.TIMEOUT and options.get("request_id"):
                self.leader.cancel(options["request_id"])  # nobody waits for it any more
            raise
        self.count(model_id, result)
        return result

    def stream(self, model_id: str, options: dict[str, Any]) -> TokenStream:
        self.require_ranks(model_id)
        return self.leader.stream(model_id, image_limits=self.images, **options)

    def count(self, model_id: str, result: GenerationResult) -> None:
        """Add a finished request to the metrics' counters in Redis (HTTP and Celery front doors alike)."""
        record_served(self.leader.redis, model_id, result)

    def count_error(self, model_id: str, exc: CeleryTPError) -> None:
        record_error(self.leader.redis, model_id, exc.kind)

    def stats(self) -> dict[str, dict[str, int]]:
        return {model: self.leader.serving_stats(model) for model in self.models()}

    def health(self) -> dict[str, Any]:
        """Each rank's heartbeat; `ok` False names the ranks with no live worker."""
        beats = self.leader.health()
        dead = [rank for rank, beat in enumerate(beats) if beat is None]
        ranks = [{"rank": r, "status": "down" if b is None else "up", **(b or {})} for r, b in enumerate(beats)]
        return {"ok": not dead, "dead_ranks": dead, "ranks": ranks, "group": self.leader.group}
