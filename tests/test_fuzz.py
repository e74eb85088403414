"""Property-based fuzz: hostile op messages and bad public Leader arguments get typed errors, and
every worker stays alive with the group usable. Real ranks; hypothesis draws the inputs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celerytp.cluster import LocalCluster
from celerytp.core import protocol as p
from celerytp.core.errors import CeleryTPError

pytestmark = pytest.mark.slow

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# init and shutdown are administrative: a valid one legitimately re-forms or stops the group.
FUZZED_OPS = sorted(set(p.REQUESTS) - {"init", "shutdown"})
FIELD_NAMES = sorted({name for cls in p.REQUESTS.values() for name in cls.model_fields} | {"surprise"})


@pytest.fixture(scope="module")
def fuzz_cluster():
    with LocalCluster(world_size=2, group="fuzz") as cluster:
        cluster.leader.load("smol", None, max_batch=2, idle_s=0.1)
        yield cluster


def _still_usable(cluster) -> None:
    assert all(proc.poll() is None for proc in cluster.workers)
    assert [s.observed_sum for s in cluster.leader.sanity_check()] == [2, 2]


def test_hostile_op_messages_get_typed_errors(fuzz_cluster):
    leader = fuzz_cluster.leader

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        op=st.sampled_from(FUZZED_OPS),
        fields=st.dictionaries(st.sampled_from(FIELD_NAMES), JSON, max_size=5),
        model=st.sampled_from(["smol", "nope", "", "../x", "a" * 200]),
    )
    def one(op, fields, model):
        fields = {"model_id": model, **fields} if "model_id" in p.REQUESTS[op].model_fields else fields
        try:
            leader.call(op, fields, timeout=30)
        except CeleryTPError:
            pass  # typed: fine

    one()
    _still_usable(fuzz_cluster)


BAD_NUMBER = st.sampled_from([None, 0, -1, 1, 2, 3, 1.5, -0.5, 2**40, float("inf"), "3", [], {}, True])


def test_bad_public_arguments_get_typed_errors(fuzz_cluster):
    leader = fuzz_cluster.leader

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        prompt=st.one_of(st.none(), st.text(max_size=30), st.integers(), st.lists(st.integers(), max_size=3)),
        max_tokens=st.sampled_from([None, 0, -1, 1, 3, 1.5, 2**40, "3", [], True]),
        temperature=BAD_NUMBER, top_p=BAD_NUMBER, top_k=BAD_NUMBER, seed=BAD_NUMBER,
        stop=st.one_of(st.none(), st.text(max_size=5), st.lists(st.one_of(st.text(max_size=5), st.integers()), max_size=20)),
        mode=st.sampled_from(["fused", "step", "other"]),
    )
    def one(prompt, max_tokens, temperature, top_p, top_k, seed, stop, mode):
        options = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        if max_tokens is None:
            options["max_tokens"] = 2  # keep valid runs short
        try:
            result = leader.generate("smol", prompt=prompt, mode=mode, **options)
        except CeleryTPError:
            return
        assert isinstance(result.text, str) and result.completion_tokens <= 3

    one()
    _still_usable(fuzz_cluster)
