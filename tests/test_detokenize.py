"""Incremental detokenizing: IncrementalText, StopChecker and StreamText against full decodes (default tokenizer)."""

from __future__ import annotations

import random

import pytest

from celerytp.client.generation import StreamText
from celerytp.core.detokenize import IncrementalText
from celerytp.core.model_files import default_model_path
from celerytp.core.stopping import StopChecker, cut_at_stop
from celerytp.core.tokenizer import _byte_alphabet, load_tokenizer

TEXTS = [
    "Héllo wörld! Ça va? Naïve façade, déjà vu.\n  Zoë's café — ½ price…",
    "天气很好。我们去公园吧！\n東京タワーは高い。한국어도 있어요.",
    "Emoji: 🙂🚀👩‍👩‍👧 family, flags 🇫🇷🇯🇵, and ✓ marks ✔︎.\n\n   indented 🎉 line",
    "   leading spaces\n\n\ttabs and\r\nwindows lines, then 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math and Ω≈ç√∫.",
    "def f(x):\n    return x ** 2  # ∑ over i ∈ ℕ\n\nprint(f(3))\n",
]
MULTIBYTE_STOPS = ["é", "ö", "—", "天气", "。", "🙂", "🚀👩", "🇯🇵", "∈", "𝔦𝔠", "½", "…"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def random_sequences(tok, count: int, length: int, seed: int) -> list[list[int]]:
    """Random ids over the whole vocabulary, and random mixes of single non-ASCII byte tokens (split UTF-8)."""
    rng = random.Random(seed)
    vocab = tok.backend.get_vocab_size()
    byte_ids = [i for b in range(128, 256) if (i := tok.backend.token_to_id(_byte_alphabet()[b])) is not None]
    ascii_ids = tok.encode(" a b\nc")
    out = [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]
    out += [[rng.choice(byte_ids if rng.random() < 0.7 else ascii_ids) for _ in range(length)] for _ in range(count)]
    return out


def all_sequences(tok) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS] + random_sequences(tok, 4, 300, seed=0)


def test_incremental_text_equals_full_decode(tok):
    for ids in all_sequences(tok):
        inc, fed = IncrementalText(tok.decode), ""
        for i, token in enumerate(ids, 1):
            fed += inc.feed(token)
            full = tok.decode(ids[:i])  # ends in U+FFFD while a UTF-8 sequence is incomplete
            assert inc.text == fed == full.rstrip("\ufffd"), (ids[:i], full)


def test_decode_work_per_token_is_bounded(tok):
    ids = (tok.encode(" ".join(TEXTS)) * 40)[:2000]
    counted = {"text": 0, "checker": 0, "stream": 0}

    def counting(name: str):
        def decode(part: list[int]) -> str:
            counted[name] += len(part)
            return tok.decode(part)

        return decode

    inc = IncrementalText(counting("text"))
    checker = StopChecker(set(), 10_000, 0, 10_000, ["never seen", "nor this"], counting("checker"))
    stream = StreamText(counting("stream"), ["never seen", "nor this"])
    for token in ids:
        inc.feed(token)
        assert checker.after(token) is None
        stream.feed(token)
    assert inc.text == tok.decode(ids)
    # Full decodes would be ~1,000 ids per token on average.
    assert all(n / len(ids) < 20 for n in counted.values()), counted


class FullDecodeChecker(StopChecker):
    """The former StopChecker, as a reference: the whole completion decoded and searched after every token."""

    def __init__(self, *args):
        super().__init__(*args)
        self.decode = args[-1]

    def after(self, token: int) -> str | None:
        if token in self.eos_ids:
            return "stop"
        self.token_ids.append(token)
        _, self.matched = cut_at_stop(self.decode(self.token_ids), self.stops)
        if self.matched is not None:
            return "stop"
        return "length" if len(self.token_ids) >= self.max_tokens else None


def random_stops(rng: random.Random, text: str) -> list[str]:
    """Two stops: substrings of the text (they span token boundaries), multi-byte ones, or absent ones.

    None holds U+FFFD: a full decode also matches it against a UTF-8 sequence still incomplete, which the
    incremental text holds back until it completes (a stop string of U+FFFD is of no use anyway).
    """
    stops = []
    for _ in range(2):
        kind = rng.random()
        if kind < 0.6 and text:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 8)].partition("\ufffd")[0] or " ")
        elif kind < 0.85:
            stops.append(rng.choice(MULTIBYTE_STOPS))
        else:
            stops.append("absent ✗ string")
    return stops


def run(checker: StopChecker, ids: list[int]) -> tuple[str | None, str | None, list[int]]:
    reason = None
    for token in ids:
        if (reason := checker.after(token)) is not None:
            break
    return reason, checker.matched, checker.token_ids


def test_stop_checker_matches_full_decode(tok):
    rng = random.Random(1)
    eos = {tok.encode("\n")[0]}
    for ids in all_sequences(tok):
        text = tok.decode(ids)
        for _ in range(25):
            stops, max_tokens, eos_ids = random_stops(rng, text), rng.choice([10, 10_000]), rng.choice([set(), eos])
            args = (eos_ids, max_tokens, 5, 10_000, stops, tok.decode)
            new, old = run(StopChecker(*args), ids), run(FullDecodeChecker(*args), ids)
            assert new == old, (stops, ids)
            # A resumed request: the earlier attempt's tokens recorded, the rest fed.
            k = rng.randrange(len(ids))
            resumed, reference = StopChecker(*args), FullDecodeChecker(*args)
            resumed.resume(ids[:k])
            reference.token_ids = list(ids[:k])
            assert run(resumed, ids[k:]) == run(reference, ids[k:]), (stops, ids, k)


def test_no_stops_no_decode():
    checker = StopChecker({0}, 3, 5, 100, [], None)
    assert [checker.after(t) for t in (7, 8, 9)] == [None, None, "length"] and checker.token_ids == [7, 8, 9]


def full_decode_safe_text(decode, ids: list[int], stops: list[str]) -> str:
    """What may be sent after `ids`, from a full decode: the former TokenStream._safe_text.

    That one stripped U+FFFD after cutting at a stop string, so it also held back a U+FFFD of invalid
    UTF-8 just before a stop string (sent at the end instead); here only an incomplete sequence is.
    """
    text, _ = cut_at_stop(decode(ids).rstrip("\ufffd"), stops)
    held = max(
        (n for stop in stops for n in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:n])), default=0
    )
    return text[: len(text) - held]


def test_stream_deltas_match_full_decode(tok):
    rng = random.Random(2)
    for ids in all_sequences(tok):
        text = tok.decode(ids)
        for _ in range(10):
            stops = random_stops(rng, text) if rng.random() < 0.8 else []
            checker, stream = StopChecker(set(), 10_000, 0, 10_000, stops, tok.decode), StreamText(tok.decode, stops)
            sent = ""
            for i, token in enumerate(ids, 1):
                delta = stream.feed(token)
                expected = full_decode_safe_text(tok.decode, ids[:i], stops)[len(sent) :]
                assert delta == expected, (stops, ids[:i])
                sent += delta
                if checker.after(token) is not None:  # the serving loop ends the request here
                    break
            final, _ = cut_at_stop(tok.decode(checker.token_ids), stops)
            assert stream.sent == len(sent) and sent + final[stream.sent :] == final


def test_stream_tokens_go_with_the_delta_that_completes_their_text(tok):
    """StreamText.covered (streamed logprobs follow it): every token whose text is all sent, and
    none whose text is still held back (an open UTF-8 sequence, a possible stop string)."""
    rng = random.Random(3)
    for ids in all_sequences(tok):
        stops = random_stops(rng, tok.decode(ids)) if rng.random() < 0.8 else []
        stream = StreamText(tok.decode, stops)
        for i, token in enumerate(ids, 1):
            stream.feed(token)
            covered = stream.covered
            done = tok.decode(ids[:covered])
            assert covered <= i and not done.endswith("\ufffd") and len(done) <= stream.sent, (stops, ids[:i])
            if covered < i:  # the next token's text is not all out yet (or it has none: a later delta takes it)
                more = tok.decode(ids[: covered + 1])
                assert more.endswith("\ufffd") or len(more) > stream.sent or more == done, (stops, ids[:i])
