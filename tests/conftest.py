"""Shared fixtures: real Redis, real rank worker processes, real gloo groups."""

from __future__ import annotations

import pytest

from celerytp.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster2():
    """A two-rank LocalCluster shared by a module's tests (each test leaves it usable)."""
    with LocalCluster(world_size=2, group="t2") as cluster:
        yield cluster
