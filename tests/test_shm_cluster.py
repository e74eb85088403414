"""Shared-memory collectives inside real rank workers: same greedy tokens with the switch on and
off at TP=2, the segment mapped once per epoch, unmapped on re-init, and nothing left in /dev/shm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from celerytp.cluster import LocalCluster
from celerytp.core.switches import SHM_ENV
from celerytp.distributed import shm

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"


def _mappings(pid: int, group: str) -> set[str]:
    """Names of this group's shared-memory segments that process `pid` maps."""
    prefix = shm.segment_name(group, "")
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[5]).name for line in lines if len(line.split()) > 5 and prefix in line}


def _ranks(cluster: LocalCluster) -> list[int]:
    return [w.pid for w in cluster.workers]


def _leftovers(group: str) -> list[str]:
    return [f for f in os.listdir(shm.SHM_DIR) if f.startswith(shm.segment_name(group, ""))]


def _greedy(cluster: LocalCluster) -> list[int]:
    cluster.leader.load("smol", None, quant="f32")
    return cluster.leader.generate("smol", prompt=PROMPT, max_tokens=24, temperature=0).token_ids


def test_greedy_tokens_same_with_shm_on_and_off_and_no_segment_leaks() -> None:
    with LocalCluster(world_size=2, group="shm_off", env={SHM_ENV: "0"}) as cluster:
        assert all(not _mappings(pid, "shm_off") for pid in _ranks(cluster))
        tokens_off = _greedy(cluster)

    group = "shm_on"
    with LocalCluster(world_size=2, group=group) as cluster:
        comm_id = cluster.leader.ping()[0].comm_id
        expected = {shm.segment_name(group, comm_id)}
        assert all(_mappings(pid, group) == expected for pid in _ranks(cluster))
        assert not _leftovers(group)  # unlinked once both ranks mapped it
        tokens_on = _greedy(cluster)
        assert tokens_on == tokens_off

        cluster.leader.init("epoch-2")  # re-forming the group swaps the segment
        assert all(_mappings(pid, group) == {shm.segment_name(group, "epoch-2")} for pid in _ranks(cluster))
        again = cluster.leader.generate("smol", prompt=PROMPT, max_tokens=24, temperature=0).token_ids
        assert again == tokens_on
    assert not _leftovers(group)
