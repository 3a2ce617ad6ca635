"""TIERGATE_QUOTA_LEASE_S against TIERGATE_QUOTA_REAP_EVERY_S: the reaper renews running requests' leases once a
round, so a lease under three rounds lets a live request's reservation run out (reaped, refunded) mid-answer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


def test_a_lease_shorter_than_three_reap_rounds_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_QUOTA_LEASE_S", "10")
    monkeypatch.setenv("TIERGATE_QUOTA_REAP_EVERY_S", "5")
    with pytest.raises(ValidationError) as caught:
        Settings()
    message = caught.value.errors()[0]["msg"]
    assert "TIERGATE_QUOTA_LEASE_S (10 s)" in message and "TIERGATE_QUOTA_REAP_EVERY_S (5 s)" in message
    assert "3 x" in message


def test_a_lease_of_three_reap_rounds_or_more_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_QUOTA_LEASE_S", "15")
    monkeypatch.setenv("TIERGATE_QUOTA_REAP_EVERY_S", "5")
    assert (Settings().quota_lease_s, Settings().quota_reap_every_s) == (15, 5)
    assert Settings(quota_lease_s=0.5, quota_reap_every_s=0.05).quota_lease_s == 0.5  # the long-answer test's


def test_a_reap_interval_of_zero_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_QUOTA_REAP_EVERY_S", "0")  # the reaper would spin
    with pytest.raises(ValidationError, match="quota_reap_every_s"):
        Settings()
