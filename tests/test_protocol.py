"""Message validation: every malformed field is named in a bad_request, nothing is coerced."""

import pytest

from celerytp.core import protocol as p
from celerytp.core.errors import CeleryTPError, ErrorKind


def bad(data, expected_op=None) -> str:
    with pytest.raises(CeleryTPError) as info:
        p.parse_request(data, expected_op)
    assert info.value.kind is ErrorKind.BAD_REQUEST
    return info.value.message


def test_valid_requests_parse():
    assert p.parse_request({"op": "ping", "seq": 1}) == p.PingRequest(seq=1)
    init = p.parse_request({"op": "init", "seq": 2, "comm_id": "abc-1", "timeout_s": 5})
    assert init.comm_id == "abc-1" and init.timeout_s == 5


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"op": "ping"}, "seq"),
        ({"op": "ping", "seq": "1"}, "seq"),
        ({"op": "ping", "seq": True}, "seq"),
        ({"op": "ping", "seq": 0}, "seq"),
        ({"op": "ping", "seq": 1, "extra": 1}, "extra"),
        ({"op": "init", "seq": 1}, "comm_id"),
        ({"op": "init", "seq": 1, "comm_id": "a b"}, "comm_id"),
        ({"op": "init", "seq": 1, "comm_id": "x", "timeout_s": -1}, "timeout_s"),
    ],
)
def test_bad_fields_are_named(data, field):
    assert f"'{field}'" in bad(data)


@pytest.mark.parametrize("data", [None, [], "ping", 3, {"seq": 1}, {"op": "bogus", "seq": 1}, {"op": 7, "seq": 1}])
def test_not_a_request(data):
    assert "op" in bad(data) or "JSON object" in bad(data)


def test_op_must_match_its_task():
    assert "'sanity_check'" in bad({"op": "ping", "seq": 1}, expected_op="sanity_check")


def test_replies_round_trip():
    reply = p.parse_reply(p.error_reply(3, ErrorKind.TIMEOUT, "late"))
    assert reply == p.ErrorReply(rank=3, kind=ErrorKind.TIMEOUT, message="late")
    with pytest.raises(CeleryTPError):
        p.parse_reply({"type": "pong", "rank": 0})
