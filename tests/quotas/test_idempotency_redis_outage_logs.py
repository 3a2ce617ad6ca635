"""What RedisIdempotency logs while its Redis is down for long: the outage once, the first write it loses once, and
when Redis answers again one line that it recovered and one that counts what was lost (an operator needs the count
of answers given up: their keys may run and be billed again). It was a WARNING per answer owed, then an ERROR per
owed write given up, each naming its key: up to MAX_OWED (10,000) lines at once, and no recovery line. The per-key
detail stays at DEBUG."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from quotas.idempotency import Claim
from quotas.idempotency_redis import RedisIdempotency
from tests.conftest import RedisServer

ANSWERS = 40  # requests answered while Redis is down
GIVE_UPS = 10  # failed requests whose claims are given up while it is down


def lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiergate.idempotency" and r.levelno >= level]


async def test_a_long_outage_is_one_line_and_its_end_one_that_counts_the_writes_lost(
        own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    store = RedisIdempotency(own_redis.url, timeout_s=0.5, keep_trying_s=0.5)
    try:
        claims = [await store.begin("acme", f"k{i}", "fp", f"req-{i}", lease_s=60) for i in range(ANSWERS + GIVE_UPS)]
        assert all(isinstance(c, Claim) for c in claims)
        caplog.set_level(logging.DEBUG, logger="tiergate.idempotency")
        own_redis.stop()
        await asyncio.gather(*(store.finish(c, {"text": "answer"}, ttl_s=60) for c in claims[:ANSWERS]),
                             *(store.abandon(c) for c in claims[ANSWERS:]))
        assert len(store._owed) == ANSWERS + GIVE_UPS  # owed to the background, which keeps trying
        deadline = time.monotonic() + 30
        while store._owed:  # each given up after keep_trying_s
            assert time.monotonic() < deadline, "the owed writes were never given up"
            await asyncio.sleep(0.05)
        during = lines(caplog)
        own_redis.start()
        assert isinstance(await store.begin("acme", "after", "fp", "req-after", lease_s=60), Claim)
    finally:
        await store.close()
    got = lines(caplog)
    assert 2 <= len(during) <= 4, during  # the outage's faults (refused; maybe a dropped connection first), one loss
    assert sum("being lost" in line for line in during) == 1
    assert len(got) - len(during) == 2, got[len(during):]  # recovered, and what was lost meanwhile
    assert got[-2].startswith("writing idempotency records to Redis") and "recovered after" in got[-2]
    assert f"{ANSWERS + GIVE_UPS} were lost" in got[-1]
    assert f"{ANSWERS} answers given up" in got[-1] and f"{GIVE_UPS} give-ups" in got[-1]
    detail = [line for line in lines(caplog, logging.DEBUG) if line.startswith("gave up the")]
    assert len(detail) == ANSWERS + GIVE_UPS and any("'k0'" in line for line in detail)  # each key, at DEBUG
