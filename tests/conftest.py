"""Shared fixtures: real Redis, real rank worker processes, real gloo groups."""

from __future__ import annotations

# hypothesis is imported at start-up: imported late (by its plugin's end-of-run summary, under
# assertion rewriting) it trips CPython 3.11.7's AST recursion check and fails the whole run.
import os

import hypothesis  # noqa: F401
import pytest

# Decode compiles by default for quantized models (models/compiled.py). Compiling at every test
# cluster's load would cost minutes, so the suite decodes eagerly (workers inherit this), and
# tests/test_compiled_decode.py checks compiled decode against eager.
os.environ.setdefault("CELERYTP_COMPILE", "0")

from celerytp.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster2():
    """A two-rank LocalCluster shared by a module's tests (each test leaves it usable)."""
    with LocalCluster(world_size=2, group="t2") as cluster:
        yield cluster
