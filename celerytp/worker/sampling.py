"""Next-token sampling for a batch of rows in one pass (rank 0), each row with its own
parameters and seeded generator.

First the logits are reshaped (vLLM's order): logit_bias added, the repetition penalty from a
per-row presence mask, the presence and frequency penalties from per-row counts of the tokens
this completion generated. Greedy rows then take the argmax. The others: temperature, min_p,
top-k and top-p over a sorted candidate list, then one inverse-CDF draw from a uniform number of
the row's own generator, so a seeded request samples the same tokens whatever else shares its
batch. Top-p needs the vocabulary sorted only as far as its nucleus:
candidates come from a top-k prefilter, and a row falls back to a full sort only when the
prefilter's mass does not reach its top_p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from celerytp.core.sampling import SamplingParams

TOP_P_PREFILTER = 1024  # candidates a top-p row starts from before a full sort is needed


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator seeded with `seed`, or None (use the global RNG) when seed is None."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class RowSampler:
    """One request's sampling state: its parameters, generator and the tokens it has seen.

    Args:
        params: the request's sampling parameters.
        vocab_size: logits width.
        history: tokens already seen (the prompt and any tokens generated before), for the
            repetition penalty.
        generated: the tokens of `history` this completion generated (a resumed request's earlier
            ones), for the presence and frequency penalties.
    """

    params: SamplingParams
    generator: torch.Generator | None
    presence: torch.Tensor | None  # (V,) bool; None when the repetition penalty is off
    counts: torch.Tensor | None = None  # (V,) times generated; None without presence/frequency penalty

    @classmethod
    def create(cls, params: SamplingParams, vocab_size: int, history: list[int] = (),
               generated: list[int] = ()) -> RowSampler:
        presence = counts = None
        if params.repetition_penalty != 1.0:
            presence = torch.zeros(vocab_size, dtype=torch.bool)
            presence[torch.tensor(list(history), dtype=torch.long)] = True
        if params.penalizes_generated:
            counts = torch.zeros(vocab_size).index_add_(
                0, torch.tensor(list(generated), dtype=torch.long), torch.ones(len(generated)))
        return cls(params, make_generator(params.seed), presence, counts)

    def skip(self, draws: int) -> None:
        """Advance the generator past `draws` tokens sampled earlier (one uniform draw each, as in
        sample_rows), so a resumed request samples what an uninterrupted run would."""
        if self.generator is not None and not self.params.greedy:
            for _ in range(draws):
                torch.rand(1, generator=self.generator)

    def saw(self, token: int) -> None:
        """`token` was generated (or, in step mode, fed): it counts for the penalties."""
        if self.presence is not None:
            self.presence[token] = True
        if self.counts is not None:
            self.counts[token] += 1

    def reshape(self, logits: torch.Tensor) -> None:
        """This row's logit_bias, penalties and min_p applied to its raw logits (V,), in place."""
        p = self.params
        if p.logit_bias is not None:
            logits[torch.tensor(list(p.logit_bias))] += torch.tensor(list(p.logit_bias.values()))
        if self.presence is not None:
            seen = logits[self.presence]
            logits[self.presence] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if self.counts is not None:
            logits -= p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0)
        if p.min_p > 0 and not p.greedy:  # the cut after temperature, as the draw sees the logits
            probs = torch.softmax(logits / max(p.temperature, 1e-5), -1)
            logits.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))


def sample_rows(logits: torch.Tensor, rows: list[RowSampler]) -> list[int]:
    """Pick the next token of each row from (B, V) logits; temperature 0 is argmax."""
    logits = reshaped_logits(logits.float().cpu(), rows)
    return _draw(logits, logits.argmax(-1), None, rows)


def reshaped_logits(logits: torch.Tensor, rows: list[RowSampler]) -> torch.Tensor:
    """(B, V) logits as each row's draw sees them (RowSampler.reshape); the input is left as it is,
    so log-probabilities stay the model's own."""
    reshaping = [i for i, row in enumerate(rows) if row.params.reshapes_logits]
    if not reshaping:
        return logits
    logits = logits.clone()
    for i in reshaping:
        rows[i].reshape(logits[i])
    return logits


def sample_candidates(values: torch.Tensor, ids: torch.Tensor, rows: list[RowSampler]) -> list[int]:
    """Pick the next token of each row from its most likely tokens (B, K), largest first
    (ParallelLMHead.top_candidates). Greedy rows take the first; every other row must have a
    top_k in 1..K and nothing that reshapes its logits (`slice_mode` CANDIDATES), so it draws
    exactly what sample_rows would from the whole logits, with the same uniform draw."""
    values, ids = values.float().cpu(), ids.cpu()
    return _draw(values, ids[:, 0].clone(), ids, rows)


# How the serving loop samples a row from the ranks' vocabulary slices (worker/serving.py `_scores`).
CANDIDATES = "candidates"  # from the top candidates the ranks send: greedy, top_k <= 1024
SLICE_DRAW = "slice_draw"  # each rank draws in its slice, rank 0 picks a slice: the whole vocabulary
# the whole logits gathered: top_p alone, top_k > 1024, a penalty, bias or min_p, a replayed token's logprob
WHOLE = "whole"


def slice_mode(params: SamplingParams, replayed: bool = False) -> str:
    """How a row is sampled from vocabulary slices; `replayed`: its token this step is one it
    decoded before (resumed), whose log-probability may be asked for."""
    if params.reshapes_logits or (replayed and params.logprobs > 0):  # greedy too: its argmax may move
        return WHOLE
    if params.greedy or 0 < params.top_k <= TOP_P_PREFILTER:
        return CANDIDATES
    return SLICE_DRAW if params.top_k == 0 and params.top_p == 1 else WHOLE


def slice_uniforms(rows: list[tuple[int | None, int]], rank: int) -> torch.Tensor:
    """One uniform per (seed, token index) row for this rank's draw in its slice: from the seed,
    the index and the rank for a seeded request (reproducible, whatever shares the batch), from
    the global generator otherwise."""
    return torch.cat([
        torch.rand(1) if seed is None else torch.rand(1, generator=make_generator(hash((seed, index, rank)) & _SEED_MASK))
        for seed, index in rows
    ])


_SEED_MASK = 2**63 - 1


def draw_in_slice(local: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, start: int) -> torch.Tensor:
    """Each row's draw from softmax(local / temperature) over this rank's slice (D, V_local), by
    inverse CDF in id order: (D, 3) of the slice's log-sum-exp at that temperature (its mass, for
    `pick_slices`), the drawn global id and its raw logit (for its log-probability)."""
    # float64: a float32 running sum over a slice of ~25k tokens drifts by ~1e-5, enough to move a
    # tail token's boundary past the uniform when the logits differ in their last bits
    x = local.double() / temperature.double().clamp(min=1e-5)[:, None]
    cdf = torch.softmax(x, -1).cumsum(-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=local.shape[1] - 1)  # (D, 1)
    return torch.cat([torch.logsumexp(x, -1, keepdim=True), (at + start).float(), local.gather(1, at).float()], -1)


def pick_slices(slice_lse: torch.Tensor, rows: list[RowSampler]) -> list[int]:
    """Rank 0: which rank's draw each row keeps, rank r with probability exp(lse_r) / sum (D, N).
    A token i of slice r is then kept with probability (m_r / M) (p_i / m_r) = p_i / M: an exact
    draw over the whole vocabulary, one uniform of the row's generator per token, as sample_rows."""
    u = torch.cat([torch.rand(1, generator=row.generator) for row in rows]).double()
    cdf = torch.softmax(slice_lse.double(), -1).cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=slice_lse.shape[1] - 1)[:, 0].tolist()


def draw_over_shards(
    logits: torch.Tensor, rows: list[RowSampler], indices: list[int], shards: list[tuple[int, int]]
) -> list[int]:
    """SLICE_DRAW rows sampled from whole logits (B, V) exactly as the ranks' slice draws and rank
    0's pick would (step mode, and what the serving loop's exchange computes): `indices` are the
    tokens' indices in their completions, `shards` every rank's (start, count)."""
    temperature = torch.tensor([row.params.temperature for row in rows])
    per_rank = [
        draw_in_slice(logits[:, start : start + count], temperature,
                      slice_uniforms([(row.params.seed, i) for row, i in zip(rows, indices)], rank), start)
        for rank, (start, count) in enumerate(shards)
    ]
    draws = torch.stack(per_rank, 1)  # (B, N, 3)
    return [int(draws[b, rank, 1]) for b, rank in enumerate(pick_slices(draws[..., 0], rows))]


def _draw(scores: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor | None, rows: list[RowSampler]) -> list[int]:
    """tokens (B,) hold each row's most likely token; rows that sample replace theirs with a draw
    from `scores` (B, V or K; the token of column j is `ids[:, j]`, or j itself when ids is None)."""
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        params = [rows[i].params for i in drawn]
        u = torch.cat([torch.rand(1, generator=rows[i].generator) for i in drawn])  # (S,)
        probs, columns = candidate_probs(
            scores[drawn],
            torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params]),
        )  # (S, K) each
        cdf = probs.cumsum(-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=columns.shape[1] - 1)  # (S, 1)
        chosen = columns.gather(1, pick)  # (S, 1)
        tokens[drawn] = (chosen if ids is None else ids[drawn].gather(1, chosen))[:, 0]
    return tokens.tolist()


def candidate_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row may draw and their probabilities, most likely first.

    logits (S, V); temperature, top_k (0 = all), top_p (S,). Returns (probs, ids), both
    (S, K): zero probability past a row's own cut. Top-k renormalizes over its k tokens;
    top-p keeps the smallest most-likely set whose mass reaches top_p (never empty).
    """
    S, V = logits.shape
    x = logits / temperature.clamp(min=1e-5)[:, None]
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)  # (S,)
    width = torch.where(k < V, k, torch.where(top_p < 1, min(V, TOP_P_PREFILTER), V))
    values, ids = torch.topk(x, int(width.max()))  # (S, K) sorted
    cut = torch.arange(values.shape[1])[None] >= k[:, None]  # past each row's top-k
    renormalized = torch.softmax(values.masked_fill(cut, float("-inf")), -1)
    whole = torch.softmax(x, -1).gather(1, ids)  # probabilities over the whole vocabulary
    probs = torch.where((k < V)[:, None], renormalized, whole)
    short = (k == V) & (top_p < 1) & (probs.sum(-1) < top_p) & (values.shape[1] < V)
    if bool(short.any()):  # the prefilter missed part of a nucleus: sort those rows fully
        full_values, full_ids = torch.sort(x[short], descending=True)
        probs, ids = _widen(probs, V), _widen(ids, V)
        probs[short], ids[short] = torch.softmax(full_values, -1), full_ids
    mass_before = probs.cumsum(-1) - probs
    return probs.masked_fill(mass_before >= top_p[:, None], 0.0), ids


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def top_logprobs(logits: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens under the model (raw logits) with their log-probabilities."""
    if k <= 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """Log-probability of `token` under the model (raw logits)."""
    return float(torch.log_softmax(logits.float(), dim=-1)[token])
