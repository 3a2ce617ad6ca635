"""A key's `ttl_s` (issued or rotated over HTTP, with the CLI, or through the store's rules) is at least a second, as
a degrade level's TTL: any positive number was taken, and 1e-300 issued a key already expired when it was shown
"once; store it now" (its `expires_at` was its `created_at`); a rotation with it would revoke the old key after its
grace for a new one that never worked."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gateway.cli.main import cli
from gateway.errors import InvalidRequest
from gateway.routes.admin import IssueKey, RotateKey
from gateway.tenants.rules import new_key_expiry, rotation_spans
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


@pytest.mark.parametrize("ttl", [1e-300, 1e-9, 0.5])
def test_the_store_refuses_a_key_lifetime_under_a_second_however_it_is_asked(ttl: float) -> None:
    """The store's own rules (the CLI and any other caller of the store), not only the HTTP body's model."""
    for check in (lambda: new_key_expiry(1000.0, ttl, None), lambda: rotation_spans(60.0, ttl),
                  lambda: new_key_expiry(1000.0, None, 1000.0 + ttl)):
        with pytest.raises(InvalidRequest) as exc:
            check()
        assert exc.value.code == "invalid_duration", ttl
    assert new_key_expiry(1000.0, 1.0, None) == 1001.0 and new_key_expiry(1000.0, None, 1001.0) == 1001.0
    assert rotation_spans(0.0, 1.0) == (0.0, 1.0)


def test_the_cli_refuses_a_key_lifetime_under_a_second(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner, env = CliRunner(), {"TIERGATE_DATA_DIR": str(tmp_path)}
    assert runner.invoke(cli, ["tenants", "create", "acme"], env=env).exit_code == 0
    for ttl in ("0.000000001", "0.5s", "0.001"):
        r = runner.invoke(cli, ["keys", "issue", "--tenant", "acme", f"--ttl={ttl}"], env=env)
        assert r.exit_code == 2 and "at least 1 second" in r.output, (ttl, r.output)
    assert runner.invoke(cli, ["keys", "issue", "--tenant", "acme", "--ttl=1s"], env=env).exit_code == 0
