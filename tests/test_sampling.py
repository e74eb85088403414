"""Sampling: greedy, seeded reproducibility, top-k/top-p masks, repetition penalty, validation."""

from __future__ import annotations

import math

import pytest
import torch

from celerytp.core.sampling import SamplingParams
from celerytp.worker.sampling import (
    apply_repetition_penalty,
    logits_to_probs,
    make_generator,
    sample_next,
    token_logprob,
    top_logprobs,
)


def random_logits(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax() -> None:
    for seed in range(5):
        logits = random_logits(seed)
        assert sample_next(logits, SamplingParams(), None, []) == int(logits.argmax())
    # top-k / top-p / seed do not change greedy
    logits = random_logits(7)
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=1)
    assert sample_next(logits, params, make_generator(1), []) == int(logits.argmax())


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    params = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, seed=42)
    logits = [random_logits(s) for s in range(30)]

    def run(seed: int) -> list[int]:
        gen = make_generator(seed)
        history: list[int] = []
        for step in logits:
            history.append(sample_next(step, params, gen, history))
        return history

    assert run(42) == run(42)
    assert run(42) != run(43)
    assert make_generator(None) is None


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([0.0, math.log(3.0), -float("inf")])  # p = 1/4, 3/4, 0
    gen = make_generator(0)
    params = SamplingParams(temperature=1.0)
    draws = [sample_next(logits, params, gen) for _ in range(4000)]
    assert 2 not in draws
    assert abs(draws.count(1) / len(draws) - 0.75) < 0.03


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    probs = logits_to_probs(logits, temperature=1.0, top_k=2)
    assert torch.nonzero(probs).flatten().tolist() == [1, 3]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))
    assert torch.count_nonzero(logits_to_probs(logits, 1.0, top_k=0)) == 5
    assert torch.count_nonzero(logits_to_probs(logits, 1.0, top_k=99)) == 5


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    kept = lambda p: torch.nonzero(logits_to_probs(logits, 1.0, top_p=p)).flatten().tolist()  # noqa: E731
    assert kept(0.5) == [0]
    assert kept(0.6) == [0, 1]
    assert kept(0.8) == [0, 1]
    assert kept(0.81) == [0, 1, 2]
    assert kept(1.0) == [0, 1, 2, 3]
    assert kept(0.01) == [0]  # the most likely token always survives
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=0.6), torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold, hot = logits_to_probs(logits, 0.5), logits_to_probs(logits, 2.0)
    assert cold[0] > logits_to_probs(logits, 1.0)[0] > hot[0]


def test_repetition_penalty() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    torch.testing.assert_close(out, torch.tensor([1.0, -4.0, 1.0, 0.5]))
    assert logits[0] == 2.0  # input untouched
    # penalty changes the greedy pick away from a repeated token
    params = SamplingParams(repetition_penalty=3.0)
    assert sample_next(logits, params, None, []) == 0
    assert sample_next(logits, params, None, [0]) == 2
    assert apply_repetition_penalty(logits, [], 2.0) is logits


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
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(kwargs)


def test_from_dict() -> None:
    d = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 3, "logprobs": 2}
    params = SamplingParams.from_dict(d)
    assert params.to_dict() == d
    assert SamplingParams.from_dict({"temperature": 1}).temperature == 1  # int accepted for a float
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown sampling params: max_tokens, tempreature"):
        SamplingParams.from_dict({"tempreature": 1.0, "max_tokens": 3})
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]
