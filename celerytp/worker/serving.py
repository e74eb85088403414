"""The serving loop (continuous batching): every rank runs it in lockstep while a model has work.

Each step starts with one broadcast from rank 0 on the control group (distributed/control.py), the plan: the token each running row feeds
next or that the row is done, and the requests admitted into free cache rows (with how much
of their prompt a row already holds). Then every rank runs the same forwards: one decode over
the first R cache rows (finished or free rows ride along masked, no cache is copied) and
prompt chunks of admitted rows up to a per-step token budget, so a long prompt never stalls
running streams for its whole prefill. The ranks then exchange what sampling needs from their
vocabulary slices, not the logits (`_scores`). Rank 0 alone talks to Redis (through a publisher
thread, worker/publisher.py) and samples; whatever it does alone that fails travels in the next
plan as an abort, so no rank is left in a collective.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.images import check_image, content_keys, image_size
from celerytp.core.images import decode as decode_images
from celerytp.core.protocol import GenSpec, RowResult
from celerytp.core.sampling import SamplingParams
from celerytp.core.step_clock import per_step_us, reset, timed
from celerytp.core.stopping import StopChecker
from celerytp.core.switches import SYNC_CHECK_ENV, switch
from celerytp.core.validation import bad_request, check_logit_bias, check_tokens, sampling_params
from celerytp.core.vision_inputs import VisionInputs, check_placeholders, mrope_positions, runs, whole_images
from celerytp.distributed.control import ControlGroup
from celerytp.layers.host_transfer import to_device, to_host
from celerytp.models import CausalLM
from celerytp.worker.grammar import RowGrammar
from celerytp.worker.host_syncs import HOST_READ, HostSyncs
from celerytp.worker.sampling import (
    SLICE_DRAW,
    WHOLE,
    RowSampler,
    draw_in_slice,
    pick_slices,
    sample_candidates,
    sample_rows,
    slice_mode,
    slice_uniforms,
    token_logprob,
    top_logprobs,
)

log = logging.getLogger(__name__)

# Plan commands, and per-row news in a plan.
STEP, EXIT, ABORT = 0, 1, 2
NO_NEWS, FEED, DONE = 0, 1, 2
_HEADER = 2  # [command, payload bytes]
# A row asking for its prompt's log-probabilities keeps each prefill piece's logits whole, (T,
# V_local) floats: its pieces are at most this long, whatever the prefill budget.
PROMPT_LOGPROBS_PIECE = 512


@dataclass
class Sequence:
    """A request in a cache row. Every rank tracks its progress; rank 0 also samples and stops it."""

    spec: GenSpec
    params: SamplingParams
    row: int
    reused: int  # prompt tokens the row already held
    fed: int  # tokens of `feed` in the cache so far
    # What the cache must hold before the row samples: the prompt, and a resumed request's
    # tokens from its earlier attempt where a prefill computes them as its decode steps did
    # (a batch-invariant model: `_feed`).
    feed: list[int] = field(default_factory=list)
    # A resumed request's earlier tokens otherwise, fed back one decode step at a time as that
    # attempt decoded them; rank 0 samples again once they are in.
    forced: list[int] = field(default_factory=list)
    sampled: int = 0  # tokens sampled in this attempt (every rank counts: seeds the slice draws)
    next_token: int = -1  # decoded next (after the prompt is in)
    # rank 0 only
    sampler: RowSampler | None = None
    checker: StopChecker | None = None
    admitted_at: float = 0.0
    queued_s: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)  # s between sampled tokens (the inter-token latency metric)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None  # None first (no context)
    grammar: RowGrammar | None = None  # structured output: the mask of its next token (worker/grammar.py)
    failed: bool = False  # its own processing failed: answered with the error, its row freed in the next plan
    # every rank: the row prefilling the same prompt, whose cache this row copies when it is in
    # (n choices of one request, or equal prompts queued together) instead of computing it again
    source: Sequence | None = None
    # every rank: `feed` as the cache's content (prefix reuse): an image's places keyed by its bytes
    keys: list[int] = field(default_factory=list)
    # every rank: a vision-language request's image features, one row per image token of its
    # prompt (computed at its first prefill piece), and where those tokens sit in `feed`
    image_rows: torch.Tensor | None = None
    image_at: list[int] = field(default_factory=list)
    # every rank, multimodal rotary: the feed's (temporal, height, width) rotary positions, and
    # what a decode step adds to a position after them (CausalLM.set_rope_delta)
    rope: list[list[int]] | None = None
    rope_delta: int = 0

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.feed)


@dataclass
class Finished:
    """A request rank 0 has finished: its result (or error) for the requester."""

    result: RowResult | None = None
    error: CeleryTPError | None = None
    request_id: str = ""


@dataclass
class Events:
    """What rank 0 tells requesters after a step: streamed tokens and finished requests."""

    # (request, token, its index, its logprobs when the request asked for them)
    tokens: list[tuple[GenSpec, int, int, tuple | None]] = field(default_factory=list)
    finished: list[tuple[GenSpec, Finished]] = field(default_factory=list)


class RequestSource(Protocol):
    """Rank 0's side of the loop: the request queue and the requesters (Redis in a worker)."""

    def take(self, count: int) -> list[GenSpec]:
        """Up to `count` queued requests, oldest first (cancelled ones already answered)."""

    def wait(self, seconds: float) -> bool:
        """Wait up to `seconds` for queued work; True when there is some."""

    def publish(self, events: Events, running: list[str], stats: dict[str, int]) -> set[str]:
        """Deliver `events` (perhaps after this returns); which of the `running` request ids are
        known to be cancelled."""

    def yield_wanted(self) -> bool:
        """Another op waits for this rank: stop admitting and end the loop."""

    def try_exit(self) -> bool:
        """End the loop unless requests were queued meanwhile (atomically with submitters)."""


@dataclass
class Scores:
    """A step's sampled rows and what rank 0 picks their tokens from (worker/sampling.py
    `slice_mode`): the whole logits (S, V) when a row needs them, else each row's top candidates
    and log-sum-exp, and for rows drawn over the whole vocabulary every rank's draw in its slice."""

    seqs: list[Sequence]
    forced: list[int | None]  # a replaying row's token from its earlier attempt
    logits: torch.Tensor | None = None  # (S, V)
    values: torch.Tensor | None = None  # (S, K), largest first
    ids: torch.Tensor | None = None  # (S, K)
    lse: torch.Tensor | None = None  # (S,)
    slice_draws: torch.Tensor | None = None  # (S, N, 3): per rank (log-mass, drawn id, its logit)
    drawing: list[int] = field(default_factory=list)  # the rows that keep a rank's slice draw
    kept: dict[int, float] = field(default_factory=dict)  # row -> the raw logit of its kept slice draw

    def logprob(self, i: int, token: int) -> float:
        if self.logits is not None:
            return token_logprob(self.logits[i], token)
        if i in self.kept:
            return self.kept[i] - float(self.lse[i])
        at = (self.ids[i] == token).nonzero()[0, 0]  # any other picked token is a candidate
        return float(self.values[i, at] - self.lse[i])

    def top(self, i: int, n: int) -> list[tuple[int, float]]:
        if self.logits is not None:
            return top_logprobs(self.logits[i], n)
        return list(zip(self.ids[i, :n].tolist(), (self.values[i, :n] - self.lse[i]).tolist(), strict=True))


@dataclass
class Plan:
    command: int
    news: list[tuple[int, int]]  # per cache row: (NO_NEWS | FEED | DONE, token)
    admissions: list[tuple[GenSpec, int, int, int]]  # (spec, row, reused, the row it copies them from or -1)
    error: tuple[str, str] | None = None  # (kind, message) of an abort


class ServingLoop:
    """One model's serving loop on one rank; call `run()` on every rank at once.

    Args:
        model: this rank's shard.
        control: the control group (rank 0 plans and samples; the plan travels here, never on
            the model's group).
        row_tokens: tokens held in each served cache row, kept across loops (prefix reuse).
        prefill_budget: prompt tokens run per step.
        idle_s: how long the loop waits for work before it ends.
        source: rank 0's request queue and requesters (unused on other ranks).
        decode: token ids -> text, for stop strings (rank 0).
        image_features: a vision-language model's images' bytes -> their features, one row per
            image token (worker/image_features.py); None for a text model.
    """

    def __init__(
        self,
        model: CausalLM,
        control: ControlGroup,
        row_tokens: dict[int, list[int]],
        prefill_budget: int,
        idle_s: float,
        source: RequestSource | None = None,
        decode: Callable[[list[int]], str] | None = None,
        tokenizer: object | None = None,
        image_features: Callable[[list[bytes]], torch.Tensor] | None = None,
    ):
        self.model = model
        self.invariant = False  # the model is batch-invariant on every rank: agreed in `run`
        self.control = control
        self.rows = model.max_batch
        self.row_tokens = row_tokens
        self.prefill_budget = prefill_budget
        self.idle_s = idle_s
        self.source = source
        self.decode = decode
        self.tokenizer = tokenizer  # rank 0: compiles requests' grammars (structured output)
        self.image_features = image_features
        self._grammars: dict[str, RowGrammar] = {}  # rank 0: request id -> its matcher, until it has a row
        self.is_sampler = control.rank == 0
        self.running: dict[int, Sequence] = {}  # cache row -> its request
        self.stats = {"steps": 0, "requests": 0, "peak_rows": 0, "reused_tokens": 0, "shared_prompt_tokens": 0,
                      "new_decode_shapes": 0, "images": 0}
        self._news: list[tuple[int, int]] = [(NO_NEWS, 0)] * self.rows
        self._events = Events()
        self._yielding = False
        self._abort: tuple[str, str] | None = None  # rank 0's own failure, sent in the next plan
        self._admitting: list[GenSpec] = []  # rank 0: taken off the queue, not yet in a row
        self.sync_check = switch(SYNC_CHECK_ENV) == "1"
        self.host_waits: Counter[str] = Counter()  # this rank's, by kind, with the sync check on
        self._prompt_pieces: list[tuple[Sequence, int, tuple[torch.Tensor, ...]]] = []  # rank 0: read in `_on_host`

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> dict[str, int]:
        """Serve until the queue stays empty for idle_s (or another op waits); rank 0's figures."""
        reset()
        # What a row prefills and reuses follows it (docs/models.md, "Batch invariance"): every
        # rank must decide alike, also when one could not build the invariant kernel.
        agreed = self.control.all_reduce(torch.tensor([int(self.model.batch_invariant)]), "min")
        self.invariant = bool(agreed[0])
        self._shapes_before = len(self.model.decode_shapes)
        while True:
            plan = timed("step", self._step)
            if plan.command == ABORT:
                raise CeleryTPError(*plan.error)
            if plan.command == EXIT:
                self.flush()
                return self.stats

    def _step(self) -> Plan:
        planned = timed("plan", self._plan) if self.is_sampler else None
        plan = timed("control", lambda: self._exchange(planned))
        if plan.command == ABORT:
            return plan
        self._apply(plan)
        if plan.command == EXIT:
            return plan
        self.stats["steps"] += 1
        self.stats["peak_rows"] = max(self.stats["peak_rows"], len(self.running))
        scores = timed("forward", lambda: self._within_sync_budget(lambda: self._scores(*self._forward())))
        self._count_new_shapes()
        if self.is_sampler and scores is not None:
            self._guarded(lambda: timed("sampling", lambda: self._sample(scores)))
        return plan

    def _within_sync_budget(self, forward: Callable[[], Scores | None]) -> Scores | None:
        """The step's forwards and scores; with CELERYTP_SYNC_CHECK=1, counted (worker/host_syncs.py,
        totals in `host_waits`) and failed when the host waited for the device more than once on
        rank 0 (its one packed copy of what sampling needs) or at all elsewhere. Checked after the
        step's last collective."""
        if not self.sync_check:
            return forward()
        with HostSyncs() as syncs:
            scores = forward()
        self.host_waits.update(syncs.counts)
        over = syncs.over({HOST_READ: 1 if self.is_sampler else 0})
        if over:
            raise CeleryTPError(ErrorKind.INTERNAL, f"step {self.stats['steps']} on rank {self.control.rank} "
                                                    f"made the host wait: {'; '.join(over)}")
        return scores

    def running_requests(self) -> list[GenSpec]:
        """Rank 0: every request this loop holds, in a row or on its way to one (to fail them)."""
        return [seq.spec for seq in self.running.values()] + self._admitting

    def flush(self) -> None:
        """Rank 0: deliver what is still undelivered (results of the last step, cancellations)."""
        if self.is_sampler and (self._events.tokens or self._events.finished):
            events, self._events = self._events, Events()
            self.source.publish(events, [], self._live_stats())

    # ---- rank 0: the plan ----------------------------------------------------------------

    def _plan(self) -> Plan:
        plan = Plan(STEP, self._news, [])
        self._news = [(NO_NEWS, 0)] * self.rows
        if self._abort is not None:
            return Plan(ABORT, plan.news, [], self._abort)
        try:
            self._deliver(plan)
            if not self._yielding:
                self._yielding = self.source.yield_wanted()
            if not self._yielding:
                self._admit(plan)
            if not plan.admissions and len(self.running) == len(_done_rows(plan)):
                self.source.publish(Events(), [], {**self.stats, "running_rows": 0})  # idle now: say so first
                if self._yielding or not self.source.wait(self.idle_s) and self.source.try_exit():
                    plan.command = EXIT
                elif not self._yielding:
                    self._admit(plan)
        except Exception as exc:  # Redis down, a bad queued entry: every rank leaves together
            return Plan(ABORT, plan.news, [], (ErrorKind.INTERNAL, f"rank 0: {type(exc).__name__}: {exc}"))
        return plan

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run rank 0's solo work; a failure becomes the next plan's abort instead of a lone exit."""
        try:
            work()
        except Exception as exc:
            self._abort = (ErrorKind.INTERNAL, f"rank 0: {type(exc).__name__}: {exc}")

    def _deliver(self, plan: Plan) -> None:
        """Publish last step's tokens and results; turn cancellations into finished rows."""
        running = [seq.spec.request_id for row, seq in self.running.items() if plan.news[row][0] != DONE]
        cancelled = timed("publish", lambda: self.source.publish(self._events, running, self._live_stats()))
        self._events = Events()
        for row, seq in self.running.items():
            if seq.spec.request_id in cancelled and plan.news[row][0] != DONE:
                plan.news[row] = (DONE, -1)
                self._events.finished.append((seq.spec, Finished(self._result(seq, "cancelled"))))

    def _admit(self, plan: Plan) -> None:
        taken = {row for _, row, _, _ in plan.admissions}
        free = [r for r in range(self.rows) if (r not in self.running or plan.news[r][0] == DONE) and r not in taken]
        for spec in timed("take", lambda: self.source.take(len(free))) if free else []:
            try:
                self._check(spec)
            except CeleryTPError as exc:  # answered at once; the loop goes on
                self._events.finished.append((spec, Finished(error=exc)))
                continue
            row, reused = max(((r, self._reusable(spec, r)) for r in free),
                              key=lambda choice: (choice[1], -choice[0]))  # longest reuse, then the lowest row
            free.remove(row)
            donor, shared = max(((r, self._reusable(spec, r)) for r in self.running if plan.news[r][0] != DONE),
                                key=lambda choice: choice[1], default=(-1, 0))
            if shared > reused:  # a running row holds more of the prompt (n choices, a shared system prompt)
                plan.admissions.append((spec, row, shared, donor))
            else:
                plan.admissions.append((spec, row, reused, -1))
            self._admitting.append(spec)

    def _reusable(self, spec: GenSpec, row: int) -> int:
        """Tokens of `spec`'s feed that `row` holds already; none for a seeded request on a model
        that is not batch-invariant: reused, its prompt would be computed in another order than
        cold, and its logits, so its draws, would differ in their last bits (docs/serving.md,
        "Reproducible sampling"); none for a request asking for its prompt's log-probabilities
        either: every position's logits must be computed."""
        if (_seeded(spec) and not self.invariant) or spec.prompt_logprobs is not None:
            return 0
        held = self.model.reusable_prefix(self.row_tokens.get(row, []), self._keys(spec))
        return whole_images(held, self._image_runs(spec), -1)  # never ending inside an image seen whole

    def _image_runs(self, spec: GenSpec) -> list[tuple[int, int]]:
        """[start, end) of each image's places in `spec`'s prompt, where a prefill piece must hold
        them whole (a model whose image tokens see each other both ways); else none."""
        vision = self.model.vision
        if not spec.images or not vision.bidirectional:
            return []
        return runs([i for i, t in enumerate(spec.prompt) if t == vision.image_token_id])

    def _feed(self, spec: GenSpec) -> list[int]:
        """The tokens a row prefills for `spec`: a resumed request's earlier tokens too, in one
        pass, where the model computes a prefilled token as its decode step did (batch
        invariance) and the request wants no log-probabilities (those come from decode steps)."""
        params = spec.sampling or {}
        if spec.resumed and self.invariant and not params.get("logprobs") and spec.prompt_logprobs is None:
            return [*spec.prompt, *spec.resumed]
        return spec.prompt

    def _keys(self, spec: GenSpec) -> list[int]:
        """`spec`'s feed as a row's cache holds it: each image's places keyed by its content."""
        feed = self._feed(spec)
        if not spec.images:
            return feed
        vision = self.model.vision
        keys = content_keys(feed[: len(spec.prompt)], vision.image_token_id, self._image_tokens(spec), spec.images)
        return [*keys, *feed[len(spec.prompt) :]]

    def _image_tokens(self, spec: GenSpec) -> list[int]:
        """The places each of `spec`'s images takes (from its size, for a model where that decides)."""
        vision = self.model.vision
        if not vision.sized:
            return [vision.tokens_per_image] * len(spec.images)
        return [_sized_tokens(vision, image) for image in spec.images]

    def _check(self, spec: GenSpec) -> None:
        """What a rank must refuse before a request enters a row (the leader checked it too)."""
        check_tokens([*spec.prompt, *spec.resumed], max_context=self.model.max_context,
                     vocab_size=self.model.config.vocab_size, field="prompt")
        images = decode_images(spec.images)
        for i, image in enumerate(images):  # so that no rank's prefill meets a bad one
            check_image(image, f"images[{i}]")
        tokens = sum(self._image_tokens(spec)) if self.model.vision is not None else 0
        check_placeholders(spec.prompt, self.model.vision, tokens, len(images))
        check_logit_bias(sampling_params(spec.sampling), self.model.config.vocab_size)
        if spec.stop and self.decode is None:
            raise bad_request("stop", "this model was loaded without a tokenizer: stop strings cannot be matched")
        if spec.grammar is not None:  # compiled here, where a bad one is answered alone, and fed what it resumes
            if self.tokenizer is None:
                raise bad_request("grammar", "this model was loaded without a tokenizer: no structured output")
            grammar = RowGrammar.create(self.tokenizer, self.model.config.vocab_size, spec.grammar)
            grammar.advance(list(spec.resumed))
            self._grammars[spec.request_id] = grammar

    def _live_stats(self) -> dict[str, int]:
        return {**self.stats, "running_rows": len(self.running), **per_step_us(self.stats["steps"])}

    def _count_new_shapes(self) -> None:
        """Bucketed decode shapes first met in this loop (models/base.py `decode_shapes`): each a
        CUDA graph recorded while serving."""
        self.stats["new_decode_shapes"] = len(self.model.decode_shapes) - self._shapes_before

    # ---- every rank: exchange and apply the plan -----------------------------------------

    def _exchange(self, plan: Plan | None) -> Plan:
        """Rank 0's plan to every rank: one broadcast, plus one for the admissions when there are any."""
        header = torch.zeros(_HEADER + 2 * self.rows, dtype=torch.long)
        payload = b""
        if plan is not None:
            extra = plan.error if plan.command == ABORT else [[s.model_dump(), *rest] for s, *rest in plan.admissions]
            payload = json.dumps(extra).encode() if extra else b""
            header[0], header[1] = plan.command, len(payload)
            header[_HEADER:] = torch.tensor(plan.news, dtype=torch.long).flatten()
        self.control.broadcast(header, src=0)
        command, size = int(header[0]), int(header[1])
        news = [tuple(pair) for pair in header[_HEADER:].view(self.rows, 2).tolist()]
        if size:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if plan else torch.empty(size, dtype=torch.uint8)
            self.control.broadcast(data, src=0)
            extra = json.loads(data.numpy().tobytes())
        else:
            extra = []
        if command == ABORT:
            return Plan(ABORT, news, [], tuple(extra) if extra else (ErrorKind.INTERNAL, "serving loop aborted"))
        admissions = [(GenSpec.model_validate(s), *rest) for s, *rest in extra]
        return Plan(command, news, admissions)

    def _apply(self, plan: Plan) -> None:
        for row, (kind, token) in enumerate(plan.news):
            seq = self.running.get(row)
            if seq is None or kind == NO_NEWS:
                continue
            if kind == DONE:
                del self.running[row]
            else:
                seq.next_token = token
        for spec, row, reused, donor in plan.admissions:
            if donor >= 0:
                self.model.copy_row(donor, row, reused)
                self.stats["shared_prompt_tokens"] += reused
            else:
                self.model.truncate(row, reused)
            self.model.set_rope_delta(row, 0)  # text's; a prompt's images set theirs once it is in
            feed, keys = self._feed(spec), self._keys(spec)
            self.row_tokens[row] = list(keys[:reused])
            forced = [] if len(feed) > len(spec.prompt) else list(spec.resumed)
            seq = Sequence(spec, sampling_params(spec.sampling), row, reused, reused, feed, forced, keys=keys)
            seq.source = next((s for s in self.running.values() if _shares_prefill(s, seq)), None)
            if self.is_sampler:
                self._for_row(seq, lambda seq=seq: self._start(seq))
            self.running[row] = seq
            self.stats["requests"] += 1
            self.stats["images"] += len(spec.images)
            self.stats["reused_tokens"] += reused
        self._admitting.clear()

    def _start(self, seq: Sequence) -> None:
        spec = seq.spec
        seq.sampler = RowSampler.create(seq.params, self.model.config.vocab_size, [*spec.prompt, *spec.resumed],
                                        spec.resumed)  # its earlier tokens count for the penalties
        seq.sampler.skip(len(spec.resumed))  # a resumed seeded request draws on where it left off
        seq.checker = StopChecker(
            set(spec.eos_token_ids), spec.max_tokens, len(spec.prompt), self.model.max_context, spec.stop, self.decode
        )
        seq.checker.resume(list(spec.resumed))
        seq.admitted_at = time.perf_counter()
        seq.queued_s = max(0.0, time.time() - spec.submitted_at) if spec.submitted_at else 0.0
        seq.logprobs = [] if seq.sampler.params.logprobs else None
        seq.prompt_logprobs = None if spec.prompt_logprobs is None else [None]
        seq.grammar = self._grammars.pop(spec.request_id, None)

    # ---- every rank: the forwards --------------------------------------------------------

    def _forward(self) -> tuple[list[Sequence], torch.Tensor | None]:
        """Decode running rows, prefill admitted ones within the budget: the rows to sample and
        this rank's vocabulary slice of their logits, (S, V_local) in the same order. A step of
        decoding rows alone hands on the decode's own output: no copy (3 MiB at 16 rows)."""
        seqs: list[Sequence] = []
        parts: list[torch.Tensor] = []
        decoding = [seq for seq in self.running.values() if not seq.prefilling and seq.next_token >= 0]
        if decoding:
            width = max(seq.row for seq in decoding) + 1
            tokens, active = [0] * width, [False] * width
            for seq in decoding:
                tokens[seq.row], active[seq.row] = seq.next_token, True
            parts.append(self.model.decode(tokens, active, gather=False))  # (A, V_local) in row order
            seqs += sorted(decoding, key=lambda s: s.row)
            for seq in seqs:
                self.row_tokens[seq.row].append(seq.next_token)
                seq.next_token = -1
        prefilled = self._prefill([seq for seq in self.running.values() if seq.prefilling])
        if prefilled:
            seqs += [seq for seq, _ in prefilled]
            parts.append(torch.stack([row_logits for _, row_logits in prefilled]))
        if not parts:
            return seqs, None
        return seqs, parts[0] if len(parts) == 1 else torch.cat(parts)

    def _prefill(self, waiting: list[Sequence]) -> list[tuple[Sequence, torch.Tensor]]:
        for seq in waiting:
            if seq.source is not None and self.running.get(seq.source.row) is not seq.source:
                seq.source = None  # its source left (cancelled) before its prompt was in: compute it here
        following = [s for s in waiting if s.source is not None]
        out = self._prefill_own([s for s in waiting if s.source is None])
        for seq, logits in list(out):
            for follower in (f for f in following if f.source is seq):
                self.model.copy_row(seq.row, follower.row, seq.fed)
                self.row_tokens[follower.row] = list(self.row_tokens[seq.row])
                self.stats["shared_prompt_tokens"] += seq.fed - follower.fed
                self.stats["reused_tokens"] += seq.fed - follower.fed
                follower.fed = follower.reused = seq.fed  # prompt tokens it did not compute
                follower.source = None
                out.append((follower, logits))
        return out

    def _prefill_own(self, waiting: list[Sequence]) -> list[tuple[Sequence, torch.Tensor]]:
        out = []
        budget = self.prefill_budget
        # A seeded row prefills alone, in whole chunks of the budget (`_reusable`): it goes first,
        # and no batch of new prompts takes the budget while one waits, so it is never starved.
        # (Batch-invariant models compute a row alike in any company: no such care needed.)
        seeded = [] if self.invariant else [s for s in waiting if _seeded(s.spec)]
        waiting = seeded + [s for s in waiting if s not in seeded]
        # a row that asks for its prompt's log-probabilities needs every position's logits
        fresh = [] if seeded else [s for s in waiting if s.fed == 0 and s.spec.prompt_logprobs is None
                                   and not s.spec.images]
        if self.model.batched_prefill and len(fresh) > 1 and sum(len(s.feed) for s in fresh) <= budget:
            # Short new prompts: one padded forward reads the weights once for all of them.
            logits = self.model.prefill_rows([s.feed for s in fresh], [s.row for s in fresh], gather=False)
            for seq, row_logits in zip(fresh, logits):
                self._prefilled(seq, len(seq.feed))
                out.append((seq, row_logits))
            budget -= sum(len(s.feed) for s in fresh)
            waiting = [s for s in waiting if s not in fresh]
        for seq in waiting:
            if budget <= 0:
                break
            every = seq.spec.prompt_logprobs is not None
            chunk = min(self.prefill_budget, PROMPT_LOGPROBS_PIECE) if every else self.prefill_budget
            end = min(len(seq.feed), seq.fed + budget, seq.fed + chunk)
            end = whole_images(end, self._image_runs(seq.spec), seq.fed)
            if seeded and _seeded(seq.spec) and end < min(len(seq.feed), seq.fed + chunk):
                continue  # another seeded row took part of the budget: a whole chunk in a later step
            piece = torch.tensor(seq.feed[seq.fed : end], dtype=torch.long)
            embeds = self._images_in(seq, end)
            rope = [stream[seq.fed : end] for stream in seq.rope] if seq.rope is not None else None
            logits = self.model.forward_tokens(piece, seq.fed, last_only=not every, row=seq.row, gather=False,
                                               embeds=embeds, rope=rope)
            if every:
                self._prompt_scores(seq, logits, end)
            budget -= end - seq.fed
            self._prefilled(seq, end)
            if not seq.prefilling:
                out.append((seq, logits[-1]))
        return out

    def _prompt_scores(self, seq: Sequence, local: torch.Tensor, end: int) -> None:
        """Every rank: the log-probabilities of the prompt tokens that follow the positions of
        `local` (T, V_local), this rank's slice of a prefill piece's logits (prompt[fed:end]),
        in one collective: each rank sends its top candidates and log-sum-exp per position, and
        the target token's logit where its slice holds it (0 elsewhere, so the ranks' sum is the
        logit). Rank 0 appends them to the row's `prompt_logprobs`."""
        targets = seq.spec.prompt[seq.fed + 1 : end + 1]  # the prompt's last position predicts no prompt token
        if not targets:
            return
        local = local[: len(targets)]
        at = to_device(targets, local.device) - self.model.vocab_start
        inside = (at >= 0) & (at < local.shape[1])
        here = local.gather(1, at.clamp(0, local.shape[1] - 1)[:, None])  # (P, 1)
        target_logit = torch.where(inside[:, None], here, torch.zeros_like(here))
        n = seq.spec.prompt_logprobs
        values, ids, lse, extra = self.model.top_candidates(local, max(n, 1), target_logit, lse=True)
        if self.is_sampler:  # read with the step's scores (`_on_host`), in its one copy
            self._prompt_pieces.append((seq, n, (extra.sum(1)[:, 0] - lse, values[:, :n] - lse[:, None], ids[:, :n])))

    def _images_in(self, seq: Sequence, end: int) -> tuple[list[int], torch.Tensor] | None:
        """The image features of `seq`'s prefill piece feed[fed:end]: (their places in the piece, rows).
        The tower runs for the first piece that holds an image's place: not where a reused prefix
        holds them all (a follow-up turn about the same image)."""
        if not seq.spec.images:
            return None
        vision = self.model.vision
        if not seq.image_at:
            seq.image_at = [i for i, t in enumerate(seq.spec.prompt) if t == vision.image_token_id]
            if self.model.mrope:  # the whole feed's: the prompt's, then its resumed tokens' after
                sizes = [image_size(image) for image in decode_images(seq.spec.images)]
                grids = [(1, *vision.grid.patches(*size)) for size in sizes]  # the processor's image_grid_thw
                prompt = len(seq.spec.prompt)
                seq.rope, seq.rope_delta = mrope_positions(seq.spec.prompt, vision.image_token_id, grids, vision.grid.merge)
                seq.rope = [[*s, *range(prompt + seq.rope_delta, len(seq.feed) + seq.rope_delta)] for s in seq.rope]
        picked = [(i - seq.fed, k) for k, i in enumerate(seq.image_at) if seq.fed <= i < end]
        if not picked:
            return None
        if seq.image_rows is None:
            seq.image_rows, _ = self.image_features(decode_images(seq.spec.images))  # (image tokens, hidden)
        return [at for at, _ in picked], seq.image_rows[[k for _, k in picked]]

    def _prefilled(self, seq: Sequence, end: int) -> None:
        self.row_tokens[seq.row].extend(seq.keys[seq.fed : end])
        seq.fed = end
        if not seq.prefilling and seq.rope_delta:
            self.model.set_rope_delta(seq.row, seq.rope_delta)

    def _scores(self, seqs: list[Sequence], local: torch.Tensor | None) -> Scores | None:
        """Every rank: join the rows' vocabulary slices (`local`, (S, V_local)) as rank 0's sampling
        needs them, in one collective: each rank's top candidates per row
        (ParallelLMHead.top_candidates) and its own draws for rows drawn over the whole vocabulary;
        the whole logits only in a step where a row needs them (worker/sampling.py `slice_mode`).
        Every rank decides the same way, from the rows' parameters that every rank holds."""
        if local is None:
            return self._on_host(None)
        forced = [seq.forced.pop(0) if seq.forced else None for seq in seqs]
        # a constrained row needs its whole logits on rank 0 for its grammar's mask
        modes = [WHOLE if seq.spec.grammar is not None else slice_mode(seq.params, f is not None)
                 for seq, f in zip(seqs, forced)]
        drawing = [i for i, (mode, f) in enumerate(zip(modes, forced)) if mode == SLICE_DRAW and f is None]
        extra = self._slice_draws(seqs, local, drawing) if drawing else None
        for i, f in enumerate(forced):
            seqs[i].sampled += f is None
        if WHOLE in modes:
            logits, draws = self.model.gather_logits(local, extra)
            return self._on_host(Scores(seqs, forced, drawing=drawing), logits=logits, slice_draws=draws)
        # a greedy row's top_k is moot: only sampling rows and logprobs widen the candidates
        k = max(1, *(s.params.top_k for s in seqs if not s.params.greedy), *(s.params.logprobs for s in seqs))
        # the log-sum-exp serves log-probabilities only (and costs an exp of every logit)
        values, ids, lse, draws = self.model.top_candidates(local, k, extra, lse=any(s.params.logprobs for s in seqs))
        return self._on_host(Scores(seqs, forced, drawing=drawing), values=values, ids=ids, lse=lse, slice_draws=draws)

    def _on_host(self, scores: Scores | None, **parts: torch.Tensor | None) -> Scores | None:
        """Rank 0: what it samples from (`parts`, Scores fields) and the step's prompt
        log-probabilities, read from the device in one copy. Other ranks read nothing."""
        if not self.is_sampler:
            return scores
        named = {name: t for name, t in parts.items() if t is not None}
        pieces = [t for _, _, piece in self._prompt_pieces for t in piece]
        on_host = to_host([*named.values(), *pieces])
        for name, t in zip(named, on_host):
            setattr(scores, name, t)
        at = len(named)
        for seq, n, _ in self._prompt_pieces:
            logprobs, tops, ids = (t.tolist() for t in on_host[at : at + 3])
            at += 3
            seq.prompt_logprobs += [(lp, list(zip(row_ids, row_top, strict=True)))
                                    for lp, row_ids, row_top in zip(logprobs, ids, tops, strict=True)]
        self._prompt_pieces.clear()
        return scores

    def _slice_draws(self, seqs: list[Sequence], local: torch.Tensor, drawing: list[int]) -> torch.Tensor:
        """(S, 3): this rank's draw in its slice for each of the `drawing` rows (zeros elsewhere),
        seeded by the request's seed and the token's index, so a seeded request draws the same
        whatever shares its batch (worker/sampling.py `draw_in_slice`)."""
        keys = [(seqs[i].params.seed, len(seqs[i].spec.resumed) + seqs[i].sampled) for i in drawing]
        temperature = torch.tensor([seqs[i].params.temperature for i in drawing])
        u, temperature, rows = to_device(torch.stack([slice_uniforms(keys, self.control.rank), temperature,
                                                      torch.tensor(drawing, dtype=torch.float32)]), local.device)
        rows = rows.long()
        draws = draw_in_slice(local.index_select(0, rows), temperature, u, self.model.vocab_start)
        return local.new_zeros(len(seqs), 3).index_copy_(0, rows, draws.to(local.dtype))

    # ---- rank 0: sampling and stopping ---------------------------------------------------

    def _sample(self, scores: Scores) -> None:
        drawn = []
        for i, (seq, token) in enumerate(zip(scores.seqs, scores.forced)):
            if seq.failed:
                continue
            if token is None:
                drawn.append(i)
                continue
            self._news[seq.row] = (FEED, token)  # a resumed row feeds its earlier tokens (delivered and counted already)
            self._for_row(seq, lambda i=i, token=token: self._record_logprobs(scores, i, token))
        if not drawn:
            return
        tokens = self._pick_each(scores, drawn)
        now = time.perf_counter()
        for i, token in tokens.items():
            self._for_row(scores.seqs[i], lambda i=i, token=token: self._take(scores, i, token, now))

    def _take(self, scores: Scores, i: int, token: int, now: float) -> None:
        """Row i sampled `token`: record it, stream it, and stop the row or feed the token next."""
        seq = scores.seqs[i]
        seq.first_token_at = seq.first_token_at or now
        if seq.last_token_at:
            seq.gaps.append(round(now - seq.last_token_at, 4))
        seq.last_token_at = now
        seq.sampler.saw(token)
        self._record_logprobs(scores, i, token)
        ended = seq.grammar is not None and seq.grammar.advance([token])
        reason = seq.checker.after(token) or ("stop" if ended else None)
        if seq.spec.stream and token not in seq.checker.eos_ids:
            logprob = seq.logprobs[-1] if seq.logprobs else None
            self._events.tokens.append((seq.spec, token, len(seq.checker.token_ids) - 1, logprob))
        if reason is None:
            self._news[seq.row] = (FEED, token)
        else:
            self._news[seq.row] = (DONE, token)
            self._events.finished.append((seq.spec, Finished(self._result(seq, reason))))

    def _for_row(self, seq: Sequence, work: Callable[[], None]) -> None:
        """Rank 0's work for one request; if it fails (its grammar, its sampling options, a bug met
        by its data alone) that request ends with the error and the loop and every other row go on.
        Nothing of it touched the group: no collective runs in rank 0's solo work."""
        try:
            work()
        except Exception as exc:
            log.exception("request %s failed in the serving loop", seq.spec.request_id)
            error = exc if isinstance(exc, CeleryTPError) else CeleryTPError(
                ErrorKind.INTERNAL, f"request {seq.spec.request_id} failed: {type(exc).__name__}: {exc}")
            seq.failed = True
            self._news[seq.row] = (DONE, -1)
            self._events.finished.append((seq.spec, Finished(error=error)))

    def _pick_each(self, scores: Scores, rows: list[int]) -> dict[int, int]:
        """Row -> its next token (`_pick`). When the batch fails, each row is picked alone, so only
        a row whose own options or grammar fail is failed (`_for_row`)."""
        try:
            return dict(zip(rows, self._pick(scores, rows), strict=True))
        except Exception:
            tokens: dict[int, int] = {}

            def pick_alone(i: int) -> None:
                tokens[i] = self._pick(scores, [i])[0]

            for i in rows:
                self._for_row(scores.seqs[i], lambda i=i: pick_alone(i))
            return tokens

    def _pick(self, scores: Scores, rows: list[int]) -> list[int]:
        """The next token of each of `rows` (one uniform of its generator each, when it samples)."""
        def samplers(of: list[int]) -> list[RowSampler]:
            return [scores.seqs[i].sampler for i in of]

        plain = [i for i in rows if i not in scores.drawing]
        tokens = {}
        if plain and scores.logits is not None:
            logits = scores.logits[plain]  # a copy: logprobs stay the model's own
            for j, i in enumerate(plain):
                if scores.seqs[i].grammar is not None:
                    scores.seqs[i].grammar.mask(logits[j])
            tokens.update(zip(plain, sample_rows(logits, samplers(plain))))
        elif plain:
            tokens.update(zip(plain, sample_candidates(scores.values[plain], scores.ids[plain], samplers(plain))))
        drawing = [i for i in rows if i in scores.drawing]
        if drawing:  # drawn over the whole vocabulary: keep one rank's draw in its slice
            draws = scores.slice_draws[drawing]  # (D, N, 3)
            for i, row_draws, rank in zip(drawing, draws, pick_slices(draws[..., 0], samplers(drawing))):
                tokens[i] = int(row_draws[rank, 1])
                scores.kept[i] = float(row_draws[rank, 2])
        return [tokens[i] for i in rows]

    def _record_logprobs(self, scores: Scores, i: int, token: int) -> None:
        seq = scores.seqs[i]
        if seq.logprobs is not None:
            seq.logprobs.append((scores.logprob(i, token), scores.top(i, seq.params.logprobs)))

    def _result(self, seq: Sequence, reason: str) -> RowResult:
        now = time.perf_counter()
        first = seq.first_token_at or now
        return RowResult(
            request_id=seq.spec.request_id, token_ids=seq.checker.token_ids, finish_reason=reason,
            matched_stop=seq.checker.matched, prompt_tokens=len(seq.spec.prompt),
            ttft_s=seq.queued_s + (first - seq.admitted_at), decode_s=now - first, queued_s=seq.queued_s,
            reused_tokens=seq.reused, logprobs=seq.logprobs, token_gaps_s=seq.gaps, resumed=bool(seq.spec.resumed),
            prompt_logprobs=seq.prompt_logprobs,
        )


@lru_cache(maxsize=256)
def _sized_tokens(vision: VisionInputs, image: str) -> int:
    """Places of an image (as a request carries it) where its size decides them: read once."""
    return vision.tokens(image_size(decode_images([image])[0]))


def _seeded(spec: GenSpec) -> bool:
    """A request with a seed: computed alike whether or not its prompt is cached (`_reusable`)."""
    return (spec.sampling or {}).get("seed") is not None


def _shares_prefill(source: Sequence, seq: Sequence) -> bool:
    """Whether `seq` can take `source`'s prompt cache once it is in rather than compute it: the
    same prompt, still to come, and computed as `seq` would (a seeded row's is computed alone, so
    a copy is bit-exact); not for rows scoring every prompt position (their logits are needed)."""
    return (source.source is None and source.prefilling and source.keys == seq.keys
            and _seeded(source.spec) == _seeded(seq.spec)
            and source.spec.prompt_logprobs is None and seq.spec.prompt_logprobs is None)


def _done_rows(plan: Plan) -> list[int]:
    return [row for row, (kind, _) in enumerate(plan.news) if kind == DONE]


class ListSource:
    """A RequestSource over a Python list, for driving the loop without Redis (bare SPMD runs,
    tests). Results collect in `results` by request id."""

    def __init__(self, specs: list[GenSpec]):
        self.queue = list(specs)
        self.results: dict[str, Finished] = {}
        self.tokens: dict[str, list[int]] = {}

    def take(self, count: int) -> list[GenSpec]:
        taken, self.queue = self.queue[:count], self.queue[count:]
        return taken

    def wait(self, seconds: float) -> bool:
        return bool(self.queue)

    def publish(self, events: Events, running: list[str], stats: dict[str, int]) -> set[str]:
        for spec, token, *_ in events.tokens:
            self.tokens.setdefault(spec.request_id, []).append(token)
        self.results.update((spec.request_id, finished) for spec, finished in events.finished)
        return set()

    def yield_wanted(self) -> bool:
        return False

    def try_exit(self) -> bool:
        return not self.queue
