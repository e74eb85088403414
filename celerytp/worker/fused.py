"""The fused generation loop: every rank runs it in lockstep, rank 0 samples and broadcasts.

No broker round trip per token: after each forward, rank 0 picks every active row's next
token and whether the row is done, and broadcasts that (B, 2) tensor through the process
group. A finished row leaves the batch and stops costing compute. Plain torch.distributed:
the Celery task and a bare SPMD script drive the same function.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from celerytp.core.protocol import GenSpec, RowResult
from celerytp.core.sampling import SamplingParams
from celerytp.core.stopping import StopChecker
from celerytp.core.validation import PREFILL_CHUNK, prefill_chunks
from celerytp.distributed.tp import TPContext
from celerytp.models import CausalLM
from celerytp.worker.sampling import make_generator, sample_next


@dataclass
class Row:
    """One request of the batch and its progress (the sampling state matters on rank 0 only)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    checker: StopChecker
    cache_row: int
    history: list[int] = field(default_factory=list)  # prompt + generated: repetition penalty
    generator: torch.Generator | None = None
    next_token: int = -1
    finish: str | None = None
    first_token_at: float = 0.0
    finished_at: float = 0.0


class Rank0Hooks:
    """What rank 0 does besides sampling: publish tokens, notice cancellations (no-ops here)."""

    def publish(self, rows: list[Row], tokens: list[int]) -> None:
        """`tokens[i]` was just sampled for `rows[i]`."""

    def finished(self, rows: list[Row]) -> None:
        """These rows are done (their `finish` is set)."""

    def cancelled(self, rows: list[Row]) -> set[str]:
        """Request ids among `rows` whose cancellation was asked for."""
        return set()


def prefill(model: CausalLM, prompt: list[int], cache_row: int) -> torch.Tensor:
    """Run the prompt into cache row `cache_row` in chunks; return the last position's logits (V,)."""
    model.clear_cache(cache_row)
    for start, end in prefill_chunks(len(prompt)):
        piece = torch.tensor(prompt[start:end], dtype=torch.long, device=model.device)
        logits = model.forward_tokens(piece, start, last_only=True, row=cache_row)
    return logits[-1]


class FusedGeneration:
    """Generates a batch of rows on one rank; call `run()` on every rank at once.

    Args:
        model: this rank's shard.
        tp: the process group (rank 0 samples and broadcasts).
        rows: the batch, `cache_row` 0..B-1.
        hooks: rank 0's publishing and cancellation (ignored on other ranks).
    """

    def __init__(self, model: CausalLM, tp: TPContext, rows: list[Row], hooks: Rank0Hooks | None = None):
        self.model = model
        self.tp = tp
        self.rows = rows
        self.hooks = hooks or Rank0Hooks()
        self.is_sampler = tp.rank == 0  # rank 0 samples and decides; the others follow
        self.started = 0.0

    def run(self) -> list[RowResult] | None:
        """Prefill, then decode until every row is done; rank 0 returns the results."""
        self.started = time.perf_counter()
        if len(self.rows) > 1 and max(len(row.prompt) for row in self.rows) <= PREFILL_CHUNK:
            # Short prompts: one padded forward for the whole batch reads the weights once.
            logits = self.model.prefill_rows([row.prompt for row in self.rows], [row.cache_row for row in self.rows])
            first = list(logits)
        else:
            first = [prefill(self.model, row.prompt, row.cache_row) for row in self.rows]
        active = self._advance(self.rows, first)
        while active:
            tokens = torch.tensor([row.next_token for row in active], dtype=torch.long)
            logits = self.model.forward_decode(tokens, [row.cache_row for row in active])  # (A, V)
            active = self._advance(active, list(logits))
        return [self._result(row) for row in self.rows] if self.is_sampler else None

    def _advance(self, active: list[Row], logits: list[torch.Tensor]) -> list[Row]:
        """Rank 0 samples each row and decides who stops; every rank learns it by broadcast."""
        decision = torch.zeros(len(active), 2, dtype=torch.long, device=self.model.device)  # (A, [token, done])
        if self.is_sampler:
            self._sample(active, logits, decision)
        self.tp.broadcast(decision, src=0)
        still = []
        now = time.perf_counter()
        for row, (token, done) in zip(active, decision.tolist()):
            row.next_token = token
            if done:
                row.finish = row.finish or "stop"  # rank 0 knows the real reason
                row.finished_at = now
            else:
                still.append(row)
        return still

    def _sample(self, active: list[Row], logits: list[torch.Tensor], decision: torch.Tensor) -> None:
        now = time.perf_counter()
        tokens = []
        for row, row_logits in zip(active, logits):
            if row.generator is None and row.params.seed is not None:
                row.generator = make_generator(row.params.seed, row_logits.device)
            if row.next_token >= 0:  # the token fed in this step
                row.history.append(row.next_token)
            token = sample_next(row_logits, row.params, row.generator, row.history)
            row.first_token_at = row.first_token_at or now
            row.finish = row.checker.after(token)
            tokens.append(token)
        self.hooks.publish(active, tokens)
        cancelled = self.hooks.cancelled([row for row in active if row.finish is None])
        for row in active:
            if row.request_id in cancelled:
                row.finish = "cancelled"
        done = [row for row in active if row.finish is not None]
        if done:
            self.hooks.finished(done)
        for i, (row, token) in enumerate(zip(active, tokens)):
            decision[i, 0], decision[i, 1] = token, int(row.finish is not None)

    def _result(self, row: Row) -> RowResult:
        return RowResult(
            request_id=row.request_id, token_ids=row.checker.token_ids, finish_reason=row.finish or "stop",
            matched_stop=row.checker.matched, prompt_tokens=len(row.prompt),
            ttft_s=row.first_token_at - self.started, decode_s=row.finished_at - row.first_token_at,
        )


def make_rows(
    specs: list[GenSpec],
    params: list[SamplingParams],
    max_context: int,
    decode: Callable[[list[int]], str] | None = None,
    is_sampler: bool = True,
) -> list[Row]:
    """Rows of validated generate-request specs, in cache rows 0..B-1.

    Only the sampler (rank 0) checks stop strings: the other ranks get none.
    """
    rows = []
    for cache_row, (spec, row_params) in enumerate(zip(specs, params, strict=True)):
        stops = spec.stop if is_sampler else []
        checker = StopChecker(set(spec.eos_token_ids), spec.max_tokens, len(spec.prompt), max_context, stops, decode)
        rows.append(Row(spec.request_id, list(spec.prompt), row_params, checker, cache_row, list(spec.prompt)))
    return rows
