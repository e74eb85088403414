"""Sampling: greedy, seeded reproducibility, top-k/top-p/min-p masks, penalties, logit bias, validation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import MinPLogitsWarper

from celerytp.core.errors import CeleryTPError
from celerytp.core.sampling import SamplingParams
from celerytp.core.validation import check_logit_bias, refuse_step_penalties
from celerytp.worker.sampling import (
    CANDIDATES,
    SLICE_DRAW,
    TOP_P_PREFILTER,
    WHOLE,
    RowSampler,
    candidate_probs,
    draw_over_shards,
    make_generator,
    reshaped_logits,
    sample_candidates,
    sample_rows,
    slice_mode,
    token_logprob,
    top_logprobs,
)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(V,) -> (V,) after temperature, top-k, top-p: the plain full-sort definition, as a reference."""
    logits = logits.float() / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum()


def batched_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """candidate_probs scattered back to (S, V) and normalized, for comparison."""
    probs, ids = candidate_probs(
        logits,
        torch.tensor([p.temperature for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
    )
    out = torch.zeros_like(logits).scatter_add(1, ids, probs)
    return out / out.sum(-1, keepdim=True)


def random_logits(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample_one(logits: torch.Tensor, params: SamplingParams, history: list[int] = ()) -> int:
    return sample_rows(logits[None], [RowSampler.create(params, logits.shape[-1], list(history))])[0]


def test_temperature_zero_is_argmax() -> None:
    for seed in range(5):
        logits = random_logits(seed)
        assert sample_one(logits, SamplingParams()) == int(logits.argmax())
    # top-k / top-p / seed do not change greedy
    logits = random_logits(7)
    assert sample_one(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=1)) == int(logits.argmax())


def test_batched_filters_equal_the_plain_definition() -> None:
    """Every row of one batch, each with its own temperature / top-k / top-p, including rows
    whose nucleus the top-p prefilter cannot hold (a flat distribution over a large vocabulary)."""
    vocab = 3 * TOP_P_PREFILTER
    rows = [random_logits(s, vocab) for s in range(6)] + [torch.linspace(0, 0.5, vocab), torch.randn(vocab) * 0.01]
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=vocab + 5),
        SamplingParams(temperature=0.5, top_p=0.999),
        SamplingParams(temperature=1.0, top_p=0.9),  # nearly flat: the nucleus is most of the vocabulary
        SamplingParams(temperature=1.0, top_p=0.6, top_k=0),
    ]
    batched = batched_probs(torch.stack(rows), params)
    for i, (logits, p) in enumerate(zip(rows, params)):
        expected = reference_probs(logits, p.temperature, p.top_k, p.top_p)
        torch.testing.assert_close(batched[i], expected, atol=1e-6, rtol=1e-4, msg=f"row {i}: {p}")


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch() -> None:
    params = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, seed=42, repetition_penalty=1.2)
    steps = [random_logits(s) for s in range(30)]

    def run(seed: int, neighbours: int) -> list[int]:
        me = RowSampler.create(SamplingParams(**{**params.to_dict(), "seed": seed}), 50, [1, 2])
        others = [RowSampler.create(SamplingParams(temperature=1.0, seed=s), 50) for s in range(neighbours)]
        out = []
        for step in steps:
            batch = torch.stack([step] + [random_logits(99, 50)] * neighbours)
            token = sample_rows(batch, [me, *others])[0]
            me.saw(token)
            out.append(token)
        return out

    assert run(42, 0) == run(42, 3) == run(42, 15)
    assert run(42, 0) != run(43, 0)
    assert make_generator(None) is None


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([0.0, math.log(3.0), -float("inf")])  # p = 1/4, 3/4, 0
    row = RowSampler.create(SamplingParams(temperature=1.0, seed=0), 3)
    draws = [sample_rows(logits[None], [row])[0] for _ in range(4000)]
    assert 2 not in draws
    assert abs(draws.count(1) / len(draws) - 0.75) < 0.03


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = batched_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])[0]
    assert torch.nonzero(probs).flatten().tolist() == [1, 3]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))
    for k in (0, 99):
        assert torch.count_nonzero(batched_probs(logits, [SamplingParams(temperature=1.0, top_k=k)])) == 5


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()

    def kept(p: float) -> list[int]:
        return torch.nonzero(batched_probs(logits, [SamplingParams(temperature=1.0, top_p=p)])[0]).flatten().tolist()

    assert kept(0.5) == [0]
    assert kept(0.6) == [0, 1]
    assert kept(0.8) == [0, 1]
    assert kept(0.81) == [0, 1, 2]
    assert kept(1.0) == [0, 1, 2, 3]
    assert kept(0.01) == [0]  # the most likely token always survives
    torch.testing.assert_close(
        batched_probs(logits, [SamplingParams(temperature=1.0, top_p=0.6)])[0], torch.tensor([0.625, 0.375, 0.0, 0.0])
    )


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold, warm, hot = (batched_probs(logits, [SamplingParams(temperature=t)])[0, 0] for t in (0.5, 1.0, 2.0))
    assert cold > warm > hot


def test_sampling_from_top_candidates_draws_what_the_whole_logits_give() -> None:
    """The serving loop samples greedy and top-k rows from each row's top candidates (the ranks
    send those, not their vocabulary slices): same tokens as from the whole logits, seed for seed."""
    torch.manual_seed(5)
    logits = torch.randn(6, 500) * 3
    logits[0, [17, 300]] = 50.0  # a tie: the lower id wins, as argmax has it
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=1),
              SamplingParams(temperature=1.3, top_k=5, top_p=0.7, seed=2), SamplingParams(top_k=3),
              SamplingParams(temperature=0.5, top_k=64, seed=3, logprobs=5), SamplingParams(temperature=2.0, top_k=1, seed=4)]
    assert all(slice_mode(p) == CANDIDATES for p in params)
    stable = torch.sort(-logits, stable=True)  # largest first, ties by lower id
    values, ids = -stable.values[:, :64], stable.indices[:, :64]
    for draw in range(20):
        whole = [RowSampler.create(p, 500) for p in params]
        top = [RowSampler.create(p, 500) for p in params]
        for a, b in zip(whole, top):
            if a.generator is not None:
                a.generator.manual_seed(draw)
                b.generator.manual_seed(draw)
        assert sample_candidates(values, ids, top) == sample_rows(logits, whole)
    assert sample_candidates(values, ids, [RowSampler.create(SamplingParams(), 500)] * 6)[0] == 17


@pytest.mark.parametrize(("params", "replayed", "mode"), [
    (SamplingParams(), False, CANDIDATES),
    (SamplingParams(temperature=0.7, top_k=50), False, CANDIDATES),
    (SamplingParams(temperature=1.0), False, SLICE_DRAW),  # over the whole vocabulary
    (SamplingParams(temperature=1.0, top_k=TOP_P_PREFILTER + 1), False, WHOLE),  # past the candidates
    (SamplingParams(temperature=1.0, top_p=0.9), False, WHOLE),  # a nucleus may reach past the candidates
    (SamplingParams(repetition_penalty=1.1), False, WHOLE),
    (SamplingParams(logit_bias={5: 100}), False, WHOLE),  # greedy too: a bias moves the argmax
    (SamplingParams(presence_penalty=0.5), False, WHOLE),
    (SamplingParams(frequency_penalty=-0.5), False, WHOLE),
    (SamplingParams(temperature=0.7, top_k=50, min_p=0.1), False, WHOLE),
    (SamplingParams(min_p=0.1), False, CANDIDATES),  # greedy: min_p keeps the argmax
    (SamplingParams(logprobs=2), True, WHOLE),  # a replayed token's log-probability
    (SamplingParams(logprobs=2), False, CANDIDATES),
])
def test_how_each_row_is_sampled_from_vocabulary_slices(params: SamplingParams, replayed: bool, mode: str) -> None:
    assert slice_mode(params, replayed) == mode


def _draw_over_slices(logits: torch.Tensor, temperature: float, ranks: int, rows: list[RowSampler], index: int) -> list[int]:
    """What the serving loop does for SLICE_DRAW rows: every rank draws in its slice, rank 0 keeps one."""
    bounds = torch.linspace(0, logits.shape[1], ranks + 1).long().tolist()
    shards = [(start, end - start) for start, end in zip(bounds, bounds[1:])]
    assert all(row.params.temperature == temperature for row in rows)
    return draw_over_shards(logits, rows, [index] * len(rows), shards)


@pytest.mark.parametrize("ranks", [1, 3])
def test_drawing_in_slices_samples_the_whole_vocabulary_distribution(ranks: int) -> None:
    """Rank r's slice is kept with its mass, then its own draw: every token with its probability."""
    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    draws = 20000  # as many rows in one batch: one draw each
    rows = [RowSampler.create(SamplingParams(temperature=0.8), 40)] * draws
    counts = torch.bincount(torch.tensor(_draw_over_slices(logits.expand(draws, -1), 0.8, ranks, rows, 0)), minlength=40)
    expected = torch.softmax(logits[0] / 0.8, -1)
    assert (counts / counts.sum() - expected).abs().max() < 0.01


def test_a_seeded_slice_draw_is_reproducible_whatever_shares_the_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 300)
    seeded = SamplingParams(temperature=1.0, seed=7)
    row = RowSampler.create(seeded, 300)
    alone = [_draw_over_slices(logits[:1], 1.0, 2, [row], i)[0] for i in range(8)]
    rows = [RowSampler.create(seeded, 300), RowSampler.create(SamplingParams(temperature=1.0), 300),
            RowSampler.create(SamplingParams(temperature=1.0, seed=8), 300)]
    assert [_draw_over_slices(logits, 1.0, 2, rows, i)[0] for i in range(8)] == alone
    row = RowSampler.create(SamplingParams(temperature=1.0, seed=9), 300)
    assert [_draw_over_slices(logits[:1], 1.0, 2, [row], i)[0] for i in range(8)] != alone


def test_repetition_penalty() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(repetition_penalty=3.0)
    assert sample_one(logits, params) == 0
    assert sample_one(logits, params, [0]) == 2  # the penalty moves greedy off a repeated token
    row = RowSampler.create(SamplingParams(repetition_penalty=2.0), 4, [0, 1, 1])
    plain = RowSampler.create(SamplingParams(), 4)
    both = reshaped_logits(torch.stack([logits, logits]), [row, plain])
    torch.testing.assert_close(both, torch.tensor([[1.0, -4.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]]))
    assert logits[0] == 2.0  # input untouched


def test_logprobs() -> None:
    logits = torch.tensor([0.0, math.log(3.0), -1e9])
    top = top_logprobs(logits, 2)
    assert [t for t, _ in top] == [1, 0]
    assert top[0][1] == pytest.approx(math.log(0.75), abs=1e-6)
    assert top_logprobs(logits, 0) == []
    assert len(top_logprobs(logits, 10)) == 3
    assert token_logprob(logits, 0) == pytest.approx(math.log(0.25), abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(kwargs)


def test_from_dict() -> None:
    d = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1, "presence_penalty": 0.5,
         "frequency_penalty": -1.0, "logit_bias": {7: -100.0, 50256: 5.5}, "min_p": 0.05, "seed": 3, "logprobs": 2}
    params = SamplingParams.from_dict(d)
    assert params.to_dict() == d
    as_json = SamplingParams.from_dict({**d, "logit_bias": {"50256": 5.5, "7": -100}})  # JSON keys are strings
    assert as_json == params and SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams.from_dict({"temperature": 1}).temperature == 1  # int accepted for a float
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown sampling params: max_tokens, tempreature"):
        SamplingParams.from_dict({"tempreature": 1.0, "max_tokens": 3})
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


def test_logit_bias_forces_and_bans_a_token_greedy_or_sampled() -> None:
    logits = random_logits(3)
    best, second, worst = torch.sort(logits, descending=True).indices[[0, 1, -1]].tolist()
    assert sample_one(logits, SamplingParams(logit_bias={worst: 100})) == worst
    assert sample_one(logits, SamplingParams(logit_bias={best: -100})) == second
    forced = [sample_one(logits, SamplingParams(temperature=1.0, seed=s, logit_bias={worst: 100})) for s in range(20)]
    assert set(forced) == {worst}
    banned = [sample_one(logits, SamplingParams(temperature=1.0, seed=s, logit_bias={best: -100})) for s in range(200)]
    assert best not in banned
    biased = reshaped_logits(logits[None], [RowSampler.create(SamplingParams(logit_bias={2: 1.5, 7: -0.25}), 50)])[0]
    expected = logits.clone()
    expected[2] += 1.5
    expected[7] -= 0.25
    torch.testing.assert_close(biased, expected)


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    vocab, prompt, generated = 50, [1, 2, 3], [3, 4, 4, 9]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4)
    row = RowSampler.create(params, vocab, prompt)
    for token in generated:
        row.saw(token)
    logits = random_logits(4)
    counts = torch.bincount(torch.tensor(generated), minlength=vocab).float()
    expected = logits - 0.7 * (counts > 0).float() + 0.4 * counts  # OpenAI's formula; the prompt's 1, 2 untouched
    torch.testing.assert_close(reshaped_logits(logits[None], [row])[0], expected)
    resumed = RowSampler.create(params, vocab, prompt + generated, generated)  # a resumed request's earlier tokens
    torch.testing.assert_close(reshaped_logits(logits[None], [resumed])[0], expected)
    assert logits.equal(random_logits(4))  # the input stays the model's (log-probabilities)
    penalized = torch.full((vocab,), -5.0)
    penalized[[3, 4]] = 5.0
    row = RowSampler.create(SamplingParams(frequency_penalty=2.0), vocab)
    tokens = []
    for _ in range(4):
        tokens.append(sample_rows(penalized[None], [row])[0])
        row.saw(tokens[-1])
    assert tokens == [3, 4, 3, 4]  # greedy rows too: each repeat costs 2 more


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("min_p", [0.02, 0.1, 0.5, 1.0])
def test_min_p_keeps_what_transformers_keeps(temperature: float, min_p: float) -> None:
    logits = torch.stack([random_logits(s, 200) for s in range(4)])
    rows = [RowSampler.create(SamplingParams(temperature=temperature, min_p=min_p), 200) for _ in range(4)]
    kept = reshaped_logits(logits, rows).isfinite()
    warped = MinPLogitsWarper(min_p)(None, logits / temperature)  # transformers applies it after temperature
    assert kept.equal(warped.isfinite())
    probs, ids = candidate_probs(reshaped_logits(logits, rows), torch.full((4,), temperature),
                                 torch.zeros(4, dtype=torch.long), torch.ones(4))
    drawn = torch.zeros_like(logits).scatter_add(1, ids, probs)
    torch.testing.assert_close(drawn, torch.softmax(warped, -1))
    greedy = RowSampler.create(SamplingParams(min_p=min_p), 200)
    assert reshaped_logits(logits[:1], [greedy]).equal(logits[:1])  # moot for the argmax


def test_a_resumed_penalized_row_samples_what_an_uninterrupted_one_would() -> None:
    """The serving loop resumes a request with its earlier tokens counted (RowSampler.create's
    `generated`) and its generator skipped past their draws."""
    params = SamplingParams(temperature=0.5, seed=11, presence_penalty=2.0, frequency_penalty=2.0,
                            logit_bias={5: 2.0}, min_p=0.05, repetition_penalty=1.1)
    steps = [random_logits(0) / 3 + random_logits(s) / 30 for s in range(12)]  # the penalties decide
    whole = RowSampler.create(params, 50, [1, 2])
    tokens = []
    for step in steps:
        tokens.append(sample_rows(step[None], [whole])[0])
        whole.saw(tokens[-1])
    assert len(set(tokens)) > 3  # precondition: it wanders
    resumed = RowSampler.create(params, 50, [1, 2, *tokens[:5]], tokens[:5])
    resumed.skip(5)
    rest = []
    for step in steps[5:]:
        rest.append(sample_rows(step[None], [resumed])[0])
        resumed.saw(rest[-1])
    assert rest == tokens[5:]


def test_model_dependent_refusals_name_their_field() -> None:
    """Checked on the leader and the ranks before anything runs (core/validation.py)."""
    check_logit_bias(SamplingParams(logit_bias={49151: 5}), 49152)
    with pytest.raises(CeleryTPError, match=r"^\[bad_request\] field 'logit_bias': token ids \[49152\] are outside"):
        check_logit_bias(SamplingParams(logit_bias={3: 1, 49152: 5}), 49152)
    refuse_step_penalties(SamplingParams(logit_bias={3: 1}, min_p=0.5))  # step mode samples these
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(CeleryTPError, match=rf"^\[bad_request\] field '{name}': not available in step mode"):
            refuse_step_penalties(SamplingParams(**{name: 0.5}))
