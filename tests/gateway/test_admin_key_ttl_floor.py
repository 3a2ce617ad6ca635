"""A key's `ttl_s` (issued or rotated over HTTP) is at least a second, as a degrade level's TTL: any positive number
was taken, and 1e-300 issued a key already expired when it was shown "once; store it now" (its `expires_at` was its
`created_at`); a rotation with it would revoke the old key after its grace for a new one that never worked."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.routes.admin import IssueKey, RotateKey
from gateway.validation import parse_body


@pytest.mark.parametrize("ttl", [b"1e-300", b"5e-324", b"1e-9", b"0.5"])
@pytest.mark.parametrize(("model", "body"), [(IssueKey, b'{"tenant": "acme", "ttl_s": '),
                                             (RotateKey, b'{"grace_s": 60, "ttl_s": ')])
def test_a_key_lifetime_under_a_second_is_refused_by_name(model: type, body: bytes, ttl: bytes) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_body(body + ttl + b"}", model)
    assert (exc.value.param, exc.value.code) == ("ttl_s", "greater_than_equal")


@pytest.mark.parametrize("ttl", [b"1", b"1.0", b"3600"])
def test_a_second_or_more_is_a_lifetime(ttl: bytes) -> None:
    assert parse_body(b'{"tenant": "acme", "ttl_s": ' + ttl + b"}", IssueKey).ttl_s == float(ttl)
    assert parse_body(b'{"ttl_s": ' + ttl + b"}", RotateKey).ttl_s == float(ttl)
