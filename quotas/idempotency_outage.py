"""What RedisIdempotency (quotas/idempotency_redis.py) logs while Redis refuses its writes: an outage as one.

Its faults once each (quotas/fault_log.py), the first write it loses once (an owed write given up after its time, or
dropped past the bound on owed writes), and when Redis answers again one line that it recovered and one that counts
the writes lost meanwhile: answers (a retry of their keys may run and be billed again), claims' give-ups, drops. It
was a WARNING per answer owed and an ERROR per owed write given up, each naming its key: up to 10,000 lines at once
after a long outage, and no line when it ended. Each lost write is still named, key and tenant, at DEBUG.
"""

from __future__ import annotations

import logging
from collections import Counter

from quotas.fault_log import FaultLog

# why an owed write is lost ('finish' and 'abandon': given up after its time), as its count is worded
LOST = {
    "finish": "answers given up (a retry of their keys may run and be billed again)",
    "abandon": "give-ups of failed requests' claims given up (their keys stay running until their leases end)",
    "dropped": "writes dropped past the bound on owed writes (their claims stay running until their leases end)",
}


class OutageLog:
    """`failed(exc)` when Redis refuses a script, `lost(why, detail)` when a write is lost, `answered()` when Redis
    runs one (cheap while none failed). Called on the event loop only."""

    def __init__(self, log: logging.Logger, keep_trying_s: float) -> None:
        self.log, self.keep_trying_s = log, keep_trying_s
        self._faults = FaultLog(log, "writing idempotency records to Redis (owed writes retried in the background)",
                                rounds="tries")
        self._lost: Counter[str] = Counter()  # writes lost in this outage, by why (LOST)

    def failed(self, exc: BaseException) -> None:
        self._faults.failed(exc)

    def lost(self, why: str, detail: str) -> None:
        """A write lost: named at DEBUG, counted; the outage's first loss is logged."""
        self.log.debug("%s", detail)
        if not self._lost:
            self.log.error("idempotency writes Redis refused are being lost (given up after %gs owed, or dropped past "
                           "the bound on owed writes): counted, not logged each, until Redis answers again",
                           self.keep_trying_s)
        self._lost[why] += 1

    def answered(self) -> None:
        """Redis ran a script: a logged outage ends with one line, and one more that counts the writes it lost."""
        if not self._faults.failures and not self._lost:  # the common case
            return
        self._faults.ok()
        if self._lost:
            self.log.error("while Redis refused idempotency writes, %s", self.lost_words())
            self._lost.clear()

    def lost_words(self) -> str:
        """The outage's lost writes, counted by why ('' if none)."""
        if not self._lost:
            return ""
        parts = "; ".join(f"{n} {LOST[why]}" for why, n in self._lost.items())
        return f"{sum(self._lost.values())} were lost: {parts}"
