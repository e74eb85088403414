"""schemathesis over a running `celerytp serve`, in a process of its own:

    python tests/api_fuzzer.py URL KEY MODEL EXAMPLES   (prints the failures as one JSON list)

It runs apart from pytest's process on purpose. There, CPython 3.11.7's AST constructor (gh-106905,
fixed in 3.11.8) failed now and then with "AST constructor recursion depth mismatch" when
hypothesis described a strategy's lambda, or pytest rewrote a lazily imported schemathesis module,
while the test's other threads ran. Here nothing runs beside the fuzzer, and nothing rewrites it.

It generates requests, valid and not, from the server's own OpenAPI schema for every operation but
/admin's (a load without a path loads the default model again, an unload could name the served one;
test_admin_fields_are_type_checked covers their fields). A failure is a 5xx, or an answer later
than its limit. Generated bodies name the served model and ask for at most 4 tokens of prompts
clipped to 64 characters a string, so that the valid ones run quickly."""

from __future__ import annotations

import json
import sys
import time

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

REFUSAL_S = 2.0  # a refusal's limit (each took well under 0.1 s here)
ANSWER_S = 30.0  # a generation of at most 2 x 4 tokens, beside the test's prober


def fuzz_the_api(url: str, key: str, model: str, examples: int) -> list[tuple]:
    headers = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json", headers=headers).json())
    failures: list[tuple] = []

    def fuzz(operation) -> None:
        @given(case=operation.as_strategy())
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def one(case) -> None:
            if isinstance(case.body, dict) and operation.path.startswith("/v1/"):
                shorten(case.body, model, operation.path)
            started = time.monotonic()
            response = case.call(base_url=url, headers={**(case.headers or {}), **headers}, timeout=60)
            took = time.monotonic() - started
            limit = ANSWER_S if response.status_code < 300 else REFUSAL_S
            if response.status_code >= 500 or took > limit:
                failures.append((operation.label, response.status_code, round(took, 2), repr(case.body)[:300],
                                 response.text[:300]))

        one()

    for result in schema.get_all_operations():
        operation = result.ok()
        if not operation.path.startswith("/admin"):
            fuzz(operation)
    return failures


def shorten(body: dict, model: str, path: str) -> None:
    body["model"] = model  # past the model lookup (other names get their 404 in a millisecond)
    lengths = [name for name in ("max_completion_tokens", "max_output_tokens") if name in body]
    length = lengths[0] if lengths else "max_output_tokens" if "responses" in path else "max_tokens"
    given = body.get(length)
    body[length] = min(given, 4) if isinstance(given, int) and not isinstance(given, bool) else 4
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], 2)
    for name in ("prompt", "messages", "input", "instructions"):  # short (long ones: test_server_units.py)
        if name in body:
            body[name] = clip_strings(body[name])


def clip_strings(value, size: int = 64):
    if isinstance(value, str):
        return value[:size]
    if isinstance(value, list):
        return [clip_strings(item, size) for item in value]
    if isinstance(value, dict):
        return {key: clip_strings(item, size) for key, item in value.items()}
    return value


if __name__ == "__main__":
    url, key, model, examples = sys.argv[1:5]
    print(json.dumps(fuzz_the_api(url, key, model, int(examples))))
