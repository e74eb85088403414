"""Per-token cost of stop strings (rank 0's StopChecker) and of streamed text deltas (the leader's TokenStream).

Run: python benchmarks/stop_strings.py [--lengths 64 256 1024] [--repeats 20]
No cluster: the default model's tokenizer on a completion of real text (English with accents,
CJK and emoji), fed one token at a time. "before" is the former algorithm, reimplemented here:
the whole completion decoded (and searched) after every token; "after" is the incremental one
(core/detokenize.py). The 2 stop strings never match, so every token is checked. Figures: µs per
token, averaged over a completion of each length, the best of --repeats runs. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from celerytp.client.generation import StreamText
from celerytp.core.model_files import default_model_path
from celerytp.core.stopping import StopChecker, cut_at_stop
from celerytp.core.tokenizer import load_tokenizer

TEXT = (
    "The café on the corner serves crème brûlée and naïve jokes. 東京の天気は晴れです。 "
    "Numbers: 3.14, 2.72; emoji 🙂🚀 and a list:\n  - first item\n  - second item\n"
)
STOPS = ["<|user|>", "\n\nHuman:"]


def old_checker(decode: Callable[[list[int]], str], ids: list[int]) -> None:
    token_ids: list[int] = []
    for token in ids:
        token_ids.append(token)
        _, matched = cut_at_stop(decode(token_ids), STOPS)
        assert matched is None


def new_checker(decode: Callable[[list[int]], str], ids: list[int]) -> None:
    checker = StopChecker(set(), len(ids) + 1, 0, len(ids) + 1, STOPS, decode)
    for token in ids:
        assert checker.after(token) is None


def old_stream(decode: Callable[[list[int]], str], ids: list[int]) -> None:
    sent = ""
    for i in range(1, len(ids) + 1):  # the former TokenStream._safe_text
        text, _ = cut_at_stop(decode(ids[:i]), STOPS)
        text = text.rstrip("\ufffd")
        held = max(
            (n for stop in STOPS for n in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:n])), default=0
        )
        sent += text[: len(text) - held][len(sent) :]


def new_stream(decode: Callable[[list[int]], str], ids: list[int]) -> None:
    stream = StreamText(decode, STOPS)
    for token in ids:
        stream.feed(token)


def per_token_us(run: Callable, decode: Callable[[list[int]], str], ids: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(decode, ids)
        best = min(best, time.perf_counter() - start)
    return round(best / len(ids) * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    tok = load_tokenizer(default_model_path())
    corpus = tok.encode(TEXT * max(args.lengths))  # at least a token per copy
    runs = {
        "stop_before": old_checker, "stop_after": new_checker, "stream_before": old_stream, "stream_after": new_stream,
    }
    figures = {
        length: {name: per_token_us(run, tok.decode, corpus[:length], args.repeats) for name, run in runs.items()}
        for length in args.lengths
    }
    print("µs per token    StopChecker (2 stops)          stream deltas")
    print("tokens      before    after  speed-up     before    after  speed-up")
    for length, f in figures.items():
        print(
            f"{length:6d}  {f['stop_before']:9.1f} {f['stop_after']:8.1f} {f['stop_before'] / f['stop_after']:8.1f}x"
            f"  {f['stream_before']:9.1f} {f['stream_after']:8.1f} {f['stream_before'] / f['stream_after']:8.1f}x"
        )
    print(json.dumps({"us_per_token": figures, "stops": STOPS, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
