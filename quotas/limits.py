"""What one admission asks of the quota backend, and what the backend answers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

WINDOW_S = 60.0  # RPM and TPM are counted over any sliding 60 s
# How far before the store's clock a request's arrival may date its money (`dating_instant`). A reserve follows
# its arrival by milliseconds (routing, token counting, the cache lookup); by seconds where the body is slow to come
# (up to `request_receipt_timeout_s`, 30 s by default) or a cascade's second attempt follows a first answer. An
# honest replica's arrival (NTP keeps clocks within milliseconds) stays inside this, so a request arriving just
# before midnight is dated on that day, as its ledger row is. A replica whose clock is off by more, behind or ahead,
# is dated by the store's clock instead: its clock moves no money by more than this, so never into a long-ended
# day's counter (Redis keeps one 2 days: an expired one is a fresh budget) nor into a day to come. A request that
# reserves later than this after arriving across a midnight is dated on the new day (its row on the old one).
MAX_DATING_LAG_S = 60.0


@dataclass(frozen=True)
class ScopeLimits:
    """The limits of one scope (a tenant, or one key), as integers; None means unlimited."""

    scope: str  # "t" for the tenant, "k:<key id>" for a key
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_day_pico: int | None = None
    budget_month_pico: int | None = None

    def is_empty(self) -> bool:
        return all(v is None for v in (self.rpm, self.tpm, self.max_concurrent, self.budget_day_pico,
                                       self.budget_month_pico))


@dataclass(frozen=True)
class ReservationRequest:
    request_id: str
    tenant: str
    scopes: tuple[ScopeLimits, ...]
    tokens: int  # prompt tokens + the output cap
    money_pico: int  # those tokens at the tier's prices
    lease_s: float = 900.0  # a concurrency slot held longer than this is reclaimed (a crashed replica)
    now: float = field(default_factory=time.time)  # when it is asked: the sliding windows and leases run from it
    # The request's arrival (the gateway's clock), the same instant as its ledger row's `ts`
    # (gateway/pipeline/settle.py): its money counts for the arrival's UTC day and month, so a budget's day total is
    # the sum of that day's rows even for a request that arrives before midnight and reserves or settles after it.
    # The store has the last word (`dating_instant`: Redis' clock, or the store's `now`): an arrival more than
    # MAX_DATING_LAG_S before it, or after it, is moved to that bound. None: dated when it is asked (`now`; on
    # Redis, by Redis' clock).
    dated_at: float | None = None
    # The attempt of the same client request this one continues (a cascade's retry on a dearer tier), or None. One
    # client request holds one place in the requests-per-minute window and one concurrency slot for its whole life:
    # a follow-on takes no new place (nor is it refused for rpm), and takes over that attempt's slot where it still
    # holds one (where it does not, it takes a slot as any request does). Its tokens and money count as any attempt's.
    follows: str | None = None

    @property
    def day_number(self) -> int:
        """The UTC day (days since the epoch) that dates its money, by `dated_at` as it stands (a backend that
        dates by `now` clamps it first: see `dating_instant`)."""
        return int((self.now if self.dated_at is None else self.dated_at) // 86400)

    @property
    def day(self) -> str:
        return utc_dates(self.day_number)[0]

    @property
    def month(self) -> str:
        return utc_dates(self.day_number)[1]


def dating_instant(arrival: float | None, now: float, max_lag_s: float = MAX_DATING_LAG_S) -> float:
    """The instant whose day and month a request's money counts for: its arrival, moved into
    [`now` - `max_lag_s`, `now`] (`now`: the store's clock); `now` for a request without one. Redis' scripts
    compute the same (shared.lua `clock`)."""
    if arrival is None:
        return now
    return min(now, max(now - max_lag_s, arrival))


@lru_cache(maxsize=8)
def utc_dates(day_number: int) -> tuple[str, str]:
    """The UTC day (YYYYMMDD) and month (YYYYMM) of a day number since the epoch (POSIX days are 86,400 s): formatted
    once a day, not at every read (a reservation reads them once per scope)."""
    moment = time.gmtime(day_number * 86400)
    return time.strftime("%Y%m%d", moment), time.strftime("%Y%m", moment)


@dataclass(frozen=True)
class Usage:
    """What a scope has used inside the window, after this decision (for x-ratelimit-* headers)."""

    requests: int
    tokens: int
    reset_requests_s: float
    reset_tokens_s: float


@dataclass(frozen=True)
class Spend:
    """What a scope had spent (reservations included) on one day and month, as the store's clock dates them."""

    day: str  # YYYYMMDD
    month: str  # YYYYMM
    day_pico: int
    month_pico: int


@dataclass(frozen=True)
class Decision:
    admitted: bool
    # rpm | tpm | concurrency | budget_day | budget_month | duplicate, or overflow_tpm | overflow_day | overflow_month:
    # a counter admitting it would carry past what it holds (quotas/backends/base.py COUNTER_MAX)
    reason: str | None = None
    scope: str | None = None
    retry_after_s: float = 0.0
    usage: dict[str, Usage] = field(default_factory=dict)  # scope -> usage
    # what a shared store answered besides: each scope's spend after this decision and the store's clock (epoch
    # seconds), so a replica's fallback during an outage starts from the last known spend, on the store's dates
    spent: dict[str, Spend] = field(default_factory=dict)
    clock_s: float | None = None
    # admitted by a replica's fallback in a Redis outage: the mark its ledger row carries (LedgerRow.fallback), so
    # its money reaches Redis from the ledger even if the replica dies first (quotas/backends/journal.py)
    fallback: str | None = None


def seconds_to_next_day(now: float) -> float:
    return 86400 - (now % 86400)


def seconds_to_next_month(now: float) -> float:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    import calendar

    return calendar.timegm((year, month, 1, 0, 0, 0)) - now
