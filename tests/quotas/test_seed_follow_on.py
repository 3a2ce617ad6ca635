"""A restarted embedded gateway's request window, seeded from its ledger, counts a cascaded request once, as the live
window did (`ReservationRequest.follows`: the retry on a dearer tier takes no place of its own in the rpm window),
while both attempts' tokens still count against tpm. Before, each attempt's row was a request of its own: after a
restart a cascade counted twice against rpm for the rest of the minute."""

from __future__ import annotations

import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

from quotas.backends.memory import MemoryBackend
from quotas.ledger import Ledger
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.seed import seed_from_ledger
from tests.quotas.test_leases import _row


async def test_a_cascade_seeded_from_the_ledger_holds_one_rpm_place_and_both_attempts_tokens(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    try:
        await ledger.record(_row("first", Decimal("0.000000000100")))
        await ledger.record(replace(_row("second", Decimal("0.000000000200")), cascade_of="first"))
        await ledger.record(_row("other", Decimal("0.000000000100")))
        memory = MemoryBackend()
        seed_from_ledger(memory, ledger)
        lim = ScopeLimits("t", rpm=3, tpm=10_000)
        d = await memory.reserve(ReservationRequest("next", "acme", (lim,), 10, 0, now=time.time()))
        assert d.admitted, d  # two client requests in the window (the cascade and `other`), not three
        assert d.usage["t"].requests == 3 and d.usage["t"].tokens == 3 * 100 + 10  # every attempt's tokens
    finally:
        ledger.close()


async def test_a_follow_on_whose_first_attempt_left_the_window_keeps_a_place(tmp_path: Path) -> None:
    """Where the first attempt's row is not in the last minute, the follow-on's row stays an entry of its own (its
    tokens are the window's; its place, one more than the live window held, errs towards the limit)."""
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    try:
        await ledger.record(replace(_row("first", Decimal(0)), ts=time.time() - 120))
        await ledger.record(replace(_row("second", Decimal(0)), cascade_of="first"))
        memory = MemoryBackend()
        seed_from_ledger(memory, ledger)
        lim = ScopeLimits("t", rpm=10, tpm=10_000)
        d = await memory.reserve(ReservationRequest("next", "acme", (lim,), 10, 0, now=time.time()))
        assert d.admitted and d.usage["t"].requests == 2 and d.usage["t"].tokens == 110, d
    finally:
        ledger.close()
